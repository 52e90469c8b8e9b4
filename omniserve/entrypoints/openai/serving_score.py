"""POST /score and /rerank: vLLM's scoring (``LLM.score``'s), pairing inputs as vLLM does: the
cosine similarity of two inputs' embeddings, or a one-label classifier's (a cross-encoder's)
probability of the pair; rerank orders the documents by it. POST /classify: a sequence
classifier's label probabilities (``LLM.classify``'s)."""

from __future__ import annotations

from omniserve.entrypoints.openai.engine_prompt import EnginePrompt
from omniserve.entrypoints.openai.protocol import UsageInfo
from omniserve.entrypoints.openai.score_protocol import (
    ClassificationChatRequest,
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
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
from omniserve.entrypoints.openai.serving_embedding import OpenAIServingEmbedding, prompt_usage
from omniserve.entrypoints.openai.serving_engine import (
    ServingError,
    to_serving_error,
)
from omniserve.entrypoints.score_utils import score_pair_text, score_pairs
from omniserve.lora.request import LoRARequest
from omniserve.outputs import EmbeddingRequestOutput, ScoringRequestOutput
from omniserve.sampling_params import PoolingParams


class OpenAIServingScores(OpenAIServingEmbedding):
    async def create_classification(self, request: ClassificationRequest) -> ClassificationResponse:
        """Raises ``ServingError`` for anything wrong with the request."""
        lora = self.check_model(request.model)
        self.check_engine()
        if isinstance(request, ClassificationChatRequest):
            prompts = [self.apply_prompt_options(await self.render_chat(request), request)]
        else:
            prompts = await self.input_prompts(request)
        request_id = self.new_request_id("classify", request.request_id)
        pooling = PoolingParams(task="classify", use_activation=request.use_activation)
        outputs = await self.pool(prompts, pooling, request_id, request.priority, lora)
        names = self.engine.model_config.hf_config.id2label
        data = []
        for index, output in enumerate(outputs):
            probs = [float(p) for p in output.pooled]  # type: ignore[union-attr]
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append(ClassificationData(index=index, label=names.get(best), probs=probs,
                                           num_classes=len(probs)))  # fmt: skip
        return ClassificationResponse(
            id=request_id,
            model=self.models.response_name(request.model),
            data=data,
            usage=prompt_usage(outputs),
        )

    async def create_score(self, request: ScoreRequest) -> ScoreResponse:
        """Raises ``ServingError`` for anything wrong with the request."""
        (first, second), names = (request.queries, request.documents), request.names
        try:
            pairs = score_pairs(len(_listed(first)), len(_listed(second)), names)
        except ValueError as exc:
            raise to_serving_error(exc) from exc
        request_id = self.new_request_id("score", request.request_id)
        scores, usage = await self._score(
            request, request_id, [(names[0], first), (names[1], second)], pairs
        )
        return ScoreResponse(
            id=request_id,
            model=self.models.response_name(request.model),
            data=[ScoreResponseData(index=i, score=score) for i, score in enumerate(scores)],
            usage=usage,
        )

    async def do_rerank(self, request: RerankRequest) -> RerankResponse:
        """Raises ``ServingError`` for anything wrong with the request."""
        documents = _listed(request.documents)
        request_id = self.new_request_id("rerank", request.request_id)
        scores, usage = await self._score(
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
            usage=RerankUsage(prompt_tokens=usage.prompt_tokens, total_tokens=usage.total_tokens),
            results=results,
        )

    async def _score(
        self,
        request: ScoreRequest | RerankRequest,
        request_id: str,
        inputs: list[tuple[str, ScoreInput | list[ScoreInput]]],
        pairs: list[tuple[int, int]],
    ) -> tuple[list[float], UsageInfo]:
        """Each pair's score (``pairs`` index the two ``inputs``: (field, its item or items))
        and the usage: the cosine similarity of the two embeddings, or a one-label classifier's
        (a cross-encoder's) probability of the pair's texts joined."""
        lora = self.check_model(request.model)
        self.check_engine()
        self.engine.processor.check_mm_kwargs(request.mm_processor_kwargs or {})
        try:
            cross_encodes = self.engine.model_config.cross_encodes()
        except ValueError as exc:
            raise to_serving_error(exc) from exc
        if cross_encodes:
            return await self._cross_encode(request, request_id, inputs, pairs, lora)
        prompts = []
        for name, given in inputs:
            for i, item in enumerate(_listed(given)):
                prompt = await self._prompt(item, _where(name, given, i), request)
                prompts.append(self.apply_prompt_options(prompt, request))
        outputs = await self.pool(
            prompts, PoolingParams(task="embed"), request_id, request.priority, lora
        )
        embedded = [EmbeddingRequestOutput.from_output(output) for output in outputs]
        offset = len(_listed(inputs[0][1]))
        scores = [
            ScoringRequestOutput.from_embeddings(embedded[i], embedded[offset + j]).outputs.score
            for i, j in pairs
        ]
        return scores, prompt_usage(outputs)

    async def _cross_encode(
        self,
        request: ScoreRequest | RerankRequest,
        request_id: str,
        inputs: list[tuple[str, ScoreInput | list[ScoreInput]]],
        pairs: list[tuple[int, int]],
        lora: LoRARequest | None,
    ) -> tuple[list[float], UsageInfo]:
        """``_score`` by a one-label sequence classifier: each pair's texts joined end to end
        (vLLM's form for a decoder-based reranker), or rendered by ``--chat-template`` as vLLM's
        score template (a "query" and a "document" message), classified."""
        texts = []
        for name, given in inputs:
            for i, item in enumerate(_listed(given)):
                if isinstance(item, ScoreContent):
                    where = _where(name, given, i)
                    raise ServingError(
                        f"{where}: this model is a cross-encoder of text pairs; send text.",
                        param=where,
                    )
                texts.append(item)
        offset = len(_listed(inputs[0][1]))
        template = self.renderer.chat_template
        prompts = []
        for i, j in pairs:
            where = _where(inputs[1][0], inputs[1][1], j)
            text = score_pair_text(self.text_tokenizer("Scoring text pairs"), texts[i],
                                   texts[offset + j], template)  # fmt: skip
            prompt = await self._prompt(text, where, request)
            prompts.append(self.apply_prompt_options(prompt, request))
        outputs = await self.pool(
            prompts, PoolingParams(task="classify"), request_id, request.priority, lora
        )
        scores = [float(output.pooled[0]) for output in outputs]  # type: ignore[index]
        return scores, prompt_usage(outputs)

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


def _where(name: str, given: ScoreInput | list[ScoreInput], index: int) -> str:
    """The request field of item ``index`` of ``given`` (field ``name``)."""
    return f"{name}[{index}]" if isinstance(given, list) else name


def _echo(item: ScoreInput) -> RerankDocument:
    """A document as a rerank result shows it (vLLM's form)."""
    if isinstance(item, ScoreContent):
        return RerankDocument(multi_modal=item.content)
    return RerankDocument(text=item)
