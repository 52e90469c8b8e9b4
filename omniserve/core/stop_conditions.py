"""Stop conditions: when a request is done, checked token by token as sampled tokens arrive.

Stop strings are matched in the front end (they need detokenized text); everything decidable on
token ids is decided here. Pure Python (no torch).
"""

from __future__ import annotations

from omniserve.core.request import Request, RequestStatus


def append_and_check_stop(request: Request, sampled: list[int], max_model_len: int) -> list[int]:
    """Append tokens one by one; stop at the first that finishes the request."""
    for count, token_id in enumerate(sampled, start=1):
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
