"""POST /v1/embeddings: each input's (or the rendered conversation's) embedding, its final
hidden states pooled (``LLM.embed``'s), as OpenAI's embeddings response. POST /pooling: vLLM's
raw pooling result of any task (``LLM.encode``'s)."""

from __future__ import annotations

import asyncio
import base64
import sys
from http import HTTPStatus

import numpy as np
import torch

from omniserve.entrypoints.openai.embedding_protocol import (
    EmbeddingChatRequest,
    EmbeddingCompletionRequest,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingChatRequest,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
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
        data = [EmbeddingData(index=index, embedding=encode_pooled(output, request))
                for index, output in enumerate(outputs)]  # fmt: skip
        return EmbeddingResponse(
            id=request_id,
            model=self.models.response_name(request.model),
            data=data,
            usage=prompt_usage(outputs),
        )

    async def create_pooling(self, request: PoolingRequest) -> PoolingResponse:
        """Raises ``ServingError`` for anything wrong with the request."""
        lora = self.check_model(request.model)
        self.check_engine()
        params = self._pooling_params(request)
        if isinstance(request, PoolingChatRequest):
            prompts = [self.apply_prompt_options(await self.render_chat(request), request)]
        else:
            prompts = await self.input_prompts(request)
        request_id = self.new_request_id("pool", request.request_id)
        outputs = await self.pool(prompts, params, request_id, request.priority, lora)
        return PoolingResponse(
            id=request_id,
            model=self.models.response_name(request.model),
            data=[
                PoolingData(index=index, data=encode_pooled(output, request))
                for index, output in enumerate(outputs)
            ],  # fmt: skip
            usage=prompt_usage(outputs),
        )

    def _pooling_params(self, request: PoolingRequest) -> PoolingParams:
        """The task (the model's when the request names none) and its fields: ``normalize``
        (or vLLM's newer ``use_activation``) for the embed tasks, ``use_activation`` for the
        classify tasks."""
        config = self.engine.model_config
        task = request.task or config.pooling_task
        if task not in config.pooling_tasks:
            raise ServingError(
                f"task: {config.architecture} answers {', '.join(config.pooling_tasks)}, not "
                f"{task} (the classify tasks need a sequence classifier).",
                param="task",
            )
        if task.endswith("classify"):
            if request.normalize is not None:
                raise ServingError(f"normalize: applies to the embed tasks, not {task}.")
            return PoolingParams(task=task, use_activation=request.use_activation)
        normalize = request.normalize
        if request.use_activation is not None:
            if normalize not in (None, request.use_activation):
                raise ServingError("use_activation: contradicts normalize (give one of them).")
            normalize = request.use_activation
        return PoolingParams(normalize, request.dimensions, task=task)

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


_EMBED_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}  # fmt: skip
_SAME_SIZE_INTS = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


def encode_pooled(
    output: RequestOutput, request: EmbeddingRequest | PoolingRequest
) -> list[float] | list[list[float]] | str:
    """A pooling result as the request's ``encoding_format`` asks: floats (nested for a row
    per position), or base64 of its values' bytes in ``embed_dtype`` and ``endianness``, row
    after row (vLLM's encoding)."""
    assert output.pooled is not None  # pool() checked
    if request.encoding_format != "base64":
        return np.asarray(output.pooled, dtype=np.float64).tolist()
    dtype = _EMBED_DTYPES[request.embed_dtype]
    values = torch.from_numpy(np.ascontiguousarray(output.pooled)).to(dtype)
    raw = values.view(_SAME_SIZE_INTS[dtype.itemsize]).numpy()
    order = sys.byteorder if request.endianness == "native" else request.endianness
    if order != sys.byteorder:
        raw = raw.byteswap()
    return base64.b64encode(raw.tobytes()).decode()


def prompt_usage(outputs: list[RequestOutput]) -> UsageInfo:
    """A pooling request's usage: its prompts' tokens (it generates none)."""
    prompt_tokens = sum(output.num_prompt_tokens for output in outputs)
    return UsageInfo(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
