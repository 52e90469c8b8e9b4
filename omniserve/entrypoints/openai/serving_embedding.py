"""POST /v1/embeddings: each input's (or the rendered conversation's) embedding, its final
hidden states pooled (``LLM.embed``'s), as OpenAI's embeddings response."""

from __future__ import annotations

import asyncio
import base64
from http import HTTPStatus

import numpy as np

from omniserve.entrypoints.openai.embedding_protocol import (
    EmbeddingChatRequest,
    EmbeddingCompletionRequest,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
)
from omniserve.entrypoints.openai.engine_prompt import EnginePrompt
from omniserve.entrypoints.openai.protocol import UsageInfo
from omniserve.entrypoints.openai.score_protocol import ClassificationCompletionRequest
from omniserve.entrypoints.openai.serving_engine import (
    OpenAIServing,
    ServingError,
    final_output,
    split_prompts,
)
from omniserve.lora.request import LoRARequest
from omniserve.outputs import RequestOutput
from omniserve.sampling_params import PoolingParams, embedding_params


class OpenAIServingEmbedding(OpenAIServing):
    prompt_field = "input"

    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse:
        """Raises ``ServingError`` for anything wrong with the request."""
        lora = self.check_model(request.model)
        self.check_engine()
        if isinstance(request, EmbeddingChatRequest):
            prompts = [self.apply_prompt_options(await self.render_chat(request), request)]
        else:
            prompts = await self.input_prompts(request)
        request_id = self.new_request_id("embd", request.request_id)
        outputs = await self.pool(
            prompts, PoolingParams(request.normalize, request.dimensions, task="embed"), request_id,
            request.priority, lora,
        )  # fmt: skip
        data = []
        for index, output in enumerate(outputs):
            assert output.pooled is not None  # embed() checked
            vector = output.pooled.astype("<f4", copy=False)
            embedding: list[float] | str = (
                base64.b64encode(vector.tobytes()).decode()
                if request.encoding_format == "base64"
                else np.asarray(vector, dtype=np.float64).tolist()
            )
            data.append(EmbeddingData(index=index, embedding=embedding))
        return EmbeddingResponse(
            id=request_id,
            model=self.models.response_name(request.model),
            data=data,
            usage=prompt_usage(outputs),
        )

    async def input_prompts(
        self, request: EmbeddingCompletionRequest | ClassificationCompletionRequest
    ) -> list[EnginePrompt]:
        """OpenAI's ``input`` forms (text or token ids, one or many), tokenized, checked and
        truncated as the request asks."""
        given = [await self.prompt_of(p, request.add_special_tokens)
                 for p in split_prompts(request.input)]  # fmt: skip
        return [self.apply_prompt_options(p, request) for p in given]

    async def pool(
        self,
        prompts: list[EnginePrompt],
        pooling: PoolingParams,
        request_id: str,
        priority: int,
        lora: LoRARequest | None,
    ) -> list[RequestOutput]:
        """Each prompt's finished pooling request (embedding or classification, as ``pooling``
        says; its ``pooled`` values set)."""
        params = embedding_params(pooling)
        generators = await self.start_generation(prompts, params, request_id, priority, lora)
        outputs = await asyncio.gather(*(final_output(g) for g in generators))
        for index, output in enumerate(outputs):
            if output.pooled is None:
                raise ServingError(
                    f"The engine returned no embedding for input {index}.",
                    HTTPStatus.INTERNAL_SERVER_ERROR,
                )
        return outputs


def prompt_usage(outputs: list[RequestOutput]) -> UsageInfo:
    """A pooling request's usage: its prompts' tokens (it generates none)."""
    prompt_tokens = sum(output.num_prompt_tokens for output in outputs)
    return UsageInfo(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
