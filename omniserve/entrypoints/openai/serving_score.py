"""POST /score and /rerank: vLLM's bi-encoder scoring, the cosine similarity of two inputs'
embeddings (``LLM.score``'s), pairing inputs as vLLM does; rerank orders the documents by it."""

from __future__ import annotations

from omniserve.entrypoints.openai.engine_prompt import EnginePrompt
from omniserve.entrypoints.openai.protocol import UsageInfo
from omniserve.entrypoints.openai.score_protocol import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreContent,
    ScoreInput,
    ScoreRequest,
    ScoreResponse,
    ScoreResponseData,
)
from omniserve.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from omniserve.entrypoints.openai.serving_engine import ServingError, to_serving_error
from omniserve.outputs import EmbeddingRequestOutput, ScoringRequestOutput, score_pairs
from omniserve.sampling_params import PoolingParams


class OpenAIServingScores(OpenAIServingEmbedding):
    async def create_score(self, request: ScoreRequest) -> ScoreResponse:
        """Raises ``ServingError`` for anything wrong with the request."""
        (first, second), names = (request.queries, request.documents), request.names
        try:
            pairs = score_pairs(len(_listed(first)), len(_listed(second)), names)
        except ValueError as exc:
            raise to_serving_error(exc) from exc
        request_id = self.new_request_id("score", request.request_id)
        scores, prompt_tokens = await self._score(
            request, request_id, [(names[0], first), (names[1], second)], pairs
        )
        return ScoreResponse(
            id=request_id,
            model=self.models.response_name(request.model),
            data=[ScoreResponseData(index=i, score=score) for i, score in enumerate(scores)],
            usage=UsageInfo(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
        )

    async def do_rerank(self, request: RerankRequest) -> RerankResponse:
        """Raises ``ServingError`` for anything wrong with the request."""
        documents = _listed(request.documents)
        request_id = self.new_request_id("rerank", request.request_id)
        scores, prompt_tokens = await self._score(
            request,
            request_id,
            [("query", request.query), ("documents", request.documents)],
            score_pairs(1, len(documents)),
        )
        order = sorted(range(len(documents)), key=lambda i: -scores[i])
        results = [
            RerankResult(
                index=i,
                document=_echo(documents[i]) if request.return_documents else None,
                relevance_score=scores[i],
            )
            for i in order[: request.top_n or None]
        ]
        return RerankResponse(
            id=request_id,
            model=self.models.response_name(request.model),
            usage=RerankUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
            results=results,
        )

    async def _score(
        self,
        request: ScoreRequest | RerankRequest,
        request_id: str,
        inputs: list[tuple[str, ScoreInput | list[ScoreInput]]],
        pairs: list[tuple[int, int]],
    ) -> tuple[list[float], int]:
        """Each pair's score (``pairs`` index the two ``inputs``: (field, its item or items)),
        and the prompt tokens embedded."""
        lora = self.check_model(request.model)
        self.check_engine()
        self.engine.processor.check_mm_kwargs(request.mm_processor_kwargs or {})
        prompts = []
        for name, given in inputs:
            for i, item in enumerate(_listed(given)):
                where = f"{name}[{i}]" if isinstance(given, list) else name
                prompts.append(self.apply_prompt_options(await self._prompt(item, where, request),
                                                         request))  # fmt: skip
        outputs = await self.embed(prompts, PoolingParams(), request_id, request.priority, lora)
        embedded = [EmbeddingRequestOutput.from_output(output) for output in outputs]
        offset = len(_listed(inputs[0][1]))
        scores = [
            ScoringRequestOutput.from_embeddings(embedded[i], embedded[offset + j]).outputs.score
            for i, j in pairs
        ]
        return scores, sum(output.num_prompt_tokens for output in outputs)

    async def _prompt(
        self, item: ScoreInput, where: str, request: ScoreRequest | RerankRequest
    ) -> EnginePrompt:
        if isinstance(item, ScoreContent):
            return await self.render_parts(item.content, where, request.mm_processor_kwargs)
        prompt = await self.tokenize_text(item, True, where)
        if not prompt.token_ids:
            raise ServingError(f"{where} is empty.", param=where)
        return prompt


def _listed(value: ScoreInput | list[ScoreInput]) -> list[ScoreInput]:
    return value if isinstance(value, list) else [value]


def _echo(item: ScoreInput) -> RerankDocument:
    """A document as a rerank result shows it (vLLM's form)."""
    if isinstance(item, ScoreContent):
        return RerankDocument(multi_modal=item.content)
    return RerankDocument(text=item)
