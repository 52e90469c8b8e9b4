"""Stop conditions: when a request is done, checked token by token as sampled tokens arrive.

Stop strings are matched in the front end (they need detokenized text), except a speaking
request's (``check_text_stop``, with a matcher the engine core supplies); everything decidable on
token ids is decided here. Pure Python (no torch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from omniserve.core.request import Request, RequestStatus
from omniserve.messages import FinishReason

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}
"""A finished status -> the finish reason the engine reports."""


class TextStop(Protocol):
    """Matches stop strings in a request's output text, fed the new tokens each step."""

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None: ...


NO_TOKEN_ERROR = (
    "Output token {index}: no token is possible. This request's constraints (its structured "
    "output, allowed_token_ids, bad_words, logit_bias and min_tokens together) exclude every "
    "token here, or the model's scores were not finite."
)


def append_and_check_stop(request: Request, sampled: list[int], max_model_len: int) -> list[int]:
    """Append tokens one by one; stop at the first that finishes the request. A negative id
    (the sampler had no token to give) ends it in error."""
    for count, token_id in enumerate(sampled, start=1):
        if token_id < 0:
            request.status = RequestStatus.FINISHED_ERROR
            request.error = NO_TOKEN_ERROR.format(index=request.num_output_tokens)
            return sampled[: count - 1]
        request.append_output_token_ids([token_id])
        status = check_stop(request, token_id, max_model_len)
        if status is not None:
            request.status = status
            return sampled[:count]
    return list(sampled)


def check_stop(request: Request, token_id: int, max_model_len: int) -> RequestStatus | None:
    """A stop token ends the request only once more than ``min_tokens`` are out; length
    limits always apply. A stop token wins over a length limit reached on the same token."""
    params = request.sampling_params
    if request.num_output_tokens > params.min_tokens:
        if token_id == request.eos_token_id and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None


def waits_for_tokens_in_flight(request: Request, max_model_len: int) -> bool:
    """Whether a request with tokens of steps still in flight must wait for them before its next
    step (async scheduling): it may finish on them (length). What sampling reads of them does
    not wait: the worker reads the last step's token back before it samples a request with
    penalties or bad words, and the engine core samples a step with a grammar once the step
    before it is back."""
    num_in_flight = request.num_output_placeholders
    return num_in_flight > 0 and (
        request.num_output_tokens + num_in_flight >= request.max_tokens
        or request.num_tokens + num_in_flight >= max_model_len
    )


def check_text_stop(
    request: Request, new_token_ids: list[int], make_text_stop: Callable[[Request], TextStop]
) -> None:
    """End a speaking request's text at a stop string now, before the next step's talker could
    read a token past it (its final token, which completed the stop string, is not spoken, as
    with any last token)."""
    if (
        request.speech is None
        or not request.sampling_params.stop
        or not new_token_ids
        or request.is_finished
    ):
        return
    if request.text_stop is None:
        request.text_stop = make_text_stop(request)
    stop_string = request.text_stop.update(new_token_ids, stop_terminated=False)
    if stop_string is not None:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = stop_string
