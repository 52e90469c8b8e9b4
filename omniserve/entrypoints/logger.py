"""Request logging (vLLM's ``--enable-log-requests``, ``--max-log-len``, ``--enable-log-outputs``).

Each request's parameters and prompt length are logged at INFO when it is submitted, its prompt
(text and token ids, cut to ``max_log_len``) at DEBUG; with outputs on, each finished choice's
text, token ids and finish reason at INFO (a stream's pieces are put together first).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from omniserve.lora.request import LoRARequest
from omniserve.outputs import RequestOutput
from omniserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("omniserve.requests")


def _cut(value: Sequence[Any] | str | None, max_len: int | None) -> Any:
    if value is None or max_len is None or len(value) <= max_len:
        return value
    return value[:max_len]


class RequestLogger:
    def __init__(self, max_log_len: int | None = None, log_outputs: bool = False) -> None:
        if max_log_len is not None and max_log_len < 0:
            raise ValueError(f"max_log_len must be >= 0, got {max_log_len}.")
        self.max_log_len = max_log_len
        self.log_outputs = log_outputs

    def log_inputs(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lora_request: LoRARequest | None,
        num_media_items: int = 0,
    ) -> None:
        logger.info(
            "Received request %s: params: %s, prompt tokens: %d (media placeholders not yet "
            "expanded), media items: %d, lora_request: %s.",
            request_id, params, len(prompt_token_ids), num_media_items,
            lora_request.lora_name if lora_request else None,
        )  # fmt: skip
        logger.debug(
            "Request %s details: prompt: %r, prompt_token_ids: %s.",
            request_id, _cut(prompt, self.max_log_len),
            _cut(prompt_token_ids, self.max_log_len),
        )  # fmt: skip

    def log_output(self, request_id: str, index: int, text: str, token_ids: list[int],
                   finish_reason: str | None) -> None:  # fmt: skip
        logger.info(
            "Generated response %s (choice %d): output: %r, output_token_ids: %s, "
            "finish_reason: %s.",
            request_id, index, _cut(text, self.max_log_len), _cut(token_ids, self.max_log_len),
            finish_reason,
        )  # fmt: skip

    async def watch(
        self, request_id: str, params: SamplingParams, outputs: AsyncGenerator[RequestOutput, None]
    ) -> AsyncGenerator[RequestOutput, None]:
        """``outputs`` passed through; each choice is logged when it finishes."""
        delta = params.output_kind == RequestOutputKind.DELTA
        text: dict[int, str] = {}
        token_ids: dict[int, list[int]] = {}
        try:
            async for output in outputs:
                yield output
                for out in output.outputs:
                    if delta:
                        text[out.index] = text.get(out.index, "") + out.text
                        token_ids.setdefault(out.index, []).extend(out.token_ids)
                    else:
                        text[out.index], token_ids[out.index] = out.text, list(out.token_ids)
                    if out.finish_reason is not None:
                        self.log_output(request_id, out.index, text[out.index],
                                        token_ids[out.index], out.finish_reason)  # fmt: skip
        finally:
            await outputs.aclose()
