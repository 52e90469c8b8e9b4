"""--enable-log-requests / --max-log-len / --enable-log-outputs: what a request's log lines say."""

from __future__ import annotations

import asyncio
import logging

import pytest

from omniserve.entrypoints.logger import RequestLogger
from omniserve.lora.request import LoRARequest
from omniserve.outputs import CompletionOutput, RequestOutput
from omniserve.sampling_params import RequestOutputKind, SamplingParams


def _output(text: str, ids: list[int], finish: str | None) -> RequestOutput:
    out = CompletionOutput(index=0, text=text, token_ids=ids, cumulative_logprob=None,
                           logprobs=None, finish_reason=finish)  # fmt: skip
    return RequestOutput(request_id="r", prompt="p", prompt_token_ids=[1], outputs=[out],
                         finished=finish is not None)  # fmt: skip


def test_inputs_are_logged_cut_to_max_log_len(caplog):
    caplog.set_level(logging.DEBUG, logger="omniserve.requests")
    RequestLogger(max_log_len=5).log_inputs(
        "cmpl-1", "a long prompt text", list(range(100)), SamplingParams(max_tokens=3),
        LoRARequest("sql", 1, "/a"), num_media_items=2,
    )  # fmt: skip
    info, debug = (r.getMessage() for r in caplog.records)
    assert info.startswith("Received request cmpl-1: params: SamplingParams(")
    assert "prompt tokens: 100" in info and "media items: 2" in info
    assert "lora_request: sql." in info
    assert "prompt: 'a lon'" in debug and "prompt_token_ids: [0, 1, 2, 3, 4]." in debug
    with pytest.raises(ValueError, match="max_log_len"):
        RequestLogger(max_log_len=-1)


def test_a_streamed_choice_is_logged_whole_when_it_finishes(caplog):
    caplog.set_level(logging.INFO, logger="omniserve.requests")

    async def stream():
        for text, ids, finish in (("Hel", [1], None), ("lo", [2], None), ("!", [3], "stop")):
            yield _output(text, ids, finish)

    async def consume(params: SamplingParams) -> int:
        return len([o async for o in RequestLogger(log_outputs=True).watch("r", params, stream())])

    delta = SamplingParams(output_kind=RequestOutputKind.DELTA)
    assert asyncio.run(consume(delta)) == 3
    (record,) = caplog.records
    assert record.getMessage() == (
        "Generated response r (choice 0): output: 'Hello!', output_token_ids: [1, 2, 3], "
        "finish_reason: stop."
    )
