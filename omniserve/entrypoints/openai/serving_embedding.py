"""POST /v1/embeddings: each input's (or the rendered conversation's) embedding, the final
hidden state at its last position (``LLM.embed``'s), as OpenAI's embeddings response."""

from __future__ import annotations

import asyncio
import base64
from http import HTTPStatus

import numpy as np

from omniserve.entrypoints.openai.embedding_protocol import (
    EmbeddingChatRequest,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
)
from omniserve.entrypoints.openai.protocol import UsageInfo
from omniserve.entrypoints.openai.serving_engine import (
    OpenAIServing,
    ServingError,
    final_output,
    split_prompts,
)
from omniserve.sampling_params import PoolingParams, embedding_params


class OpenAIServingEmbedding(OpenAIServing):
    prompt_field = "input"

    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse:
        """Raises ``ServingError`` for anything wrong with the request."""
        lora = self.check_model(request.model)
        self.check_engine()
        if isinstance(request, EmbeddingChatRequest):
            given = [await self.render_chat(request)]
        else:
            given = [await self.prompt_of(p, request.add_special_tokens)
                     for p in split_prompts(request.input)]  # fmt: skip
        prompts = [self.apply_prompt_options(p, request) for p in given]
        params = embedding_params(PoolingParams(request.normalize, request.dimensions))
        request_id = self.new_request_id("embd", request.request_id)
        generators = await self.start_generation(
            prompts, params, request_id, request.priority, lora
        )
        outputs = await asyncio.gather(*(final_output(g) for g in generators))
        data = []
        for index, output in enumerate(outputs):
            if output.pooled is None:
                raise ServingError(
                    f"The engine returned no embedding for input {index}.",
                    HTTPStatus.INTERNAL_SERVER_ERROR,
                )
            vector = output.pooled.astype("<f4", copy=False)
            embedding: list[float] | str = (
                base64.b64encode(vector.tobytes()).decode()
                if request.encoding_format == "base64"
                else np.asarray(vector, dtype=np.float64).tolist()
            )
            data.append(EmbeddingData(index=index, embedding=embedding))
        prompt_tokens = sum(o.num_prompt_tokens for o in outputs)
        return EmbeddingResponse(
            id=request_id,
            model=self.models.response_name(request.model),
            data=data,
            usage=UsageInfo(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
        )
