"""A step that raised: undo it and pin the failure on the request that caused it, so one bad
request never fails the others (the scheduler's ``isolate_suspect`` then runs suspects alone).
Pure Python (no torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omniserve.core.request import RequestStatus
from omniserve.core.sched_output import SchedulerOutput
from omniserve.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason

if TYPE_CHECKING:
    from omniserve.core.scheduler import Scheduler


def fail_step(scheduler: Scheduler, scheduler_outputs: list[SchedulerOutput]) -> EngineCoreOutputs:
    """Undo steps whose execution raised (with async scheduling, the one that raised and
    those launched after it, which build on it), and pin the failure on the request that
    caused it.

    A request alone in the steps is the cause: it finishes with an error. Several requests
    all go back to waiting (recompute) as suspects and then run one at a time until each has
    sampled a token (``Scheduler.isolate_suspect``), so a repeat failure has a single cause and no
    innocent request fails. Encoder-cache entries the steps were to fill are dropped: the
    workers may not hold them. No other step may be in flight.
    """
    requests = list({req_id: scheduler.requests[req_id] for so in scheduler_outputs
                     for req_id in so.num_scheduled_tokens
                     if req_id in scheduler.requests}.values())  # fmt: skip
    for so in scheduler_outputs:
        for req_id, num_tokens in so.num_scheduled_tokens.items():
            if req_id in scheduler.requests:
                # The optimistic advance did not happen: that KV was never (all) written.
                scheduler.requests[req_id].num_computed_tokens -= num_tokens
    for so in scheduler_outputs:
        scheduler.kv_cache_manager.uncache(so.newly_cached_block_ids)
        for req_id in so.kv_block_copies.keys() & scheduler.requests.keys():
            # Nor perhaps the prefix hit's partial block the step was to copy first.
            request = scheduler.requests[req_id]
            request.num_computed_tokens -= request.num_computed_tokens % scheduler.block_size
    for request in requests:
        request.num_output_placeholders = 0
    outputs: list[EngineCoreOutput] = []
    if len({r for so in scheduler_outputs for r in so.num_scheduled_tokens}) == 1:
        for request in requests:
            scheduler.running.remove(request)
            request.status = RequestStatus.FINISHED_ERROR
            scheduler.free_request(request)
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=FinishReason.ERROR,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                )
            )
    else:
        for request in reversed(requests):  # preempt() puts each at the head, in order
            scheduler.running.remove(request)
            scheduler.preempt(request)
            request.suspect = True
    for so in scheduler_outputs:
        if so.talker is not None and scheduler.talker is not None:
            # A talker's state in the workers may be half-advanced: its request fails.
            for req_id in so.talker.num_scheduled_tokens:
                reported = any(o.request_id == req_id for o in outputs)
                if req_id in scheduler.talker.requests:
                    scheduler.finish_requests(req_id, RequestStatus.FINISHED_ERROR)
                    if not reported:
                        error = EngineCoreOutput(req_id, [], finish_reason=FinishReason.ERROR)
                        outputs.append(error)
    by_id = {request.request_id: request for request in requests}
    scheduler.encoder_cache_manager.discard(
        by_id[req_id].mm_features[i].identifier
        for so in scheduler_outputs
        for req_id, items in so.scheduled_encoder_inputs.items()
        if req_id in by_id
        for i in items
    )
    return EngineCoreOutputs(outputs=outputs)
