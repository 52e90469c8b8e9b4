from __future__ import annotations

import random

import pytest

from omniserve.core.kv_cache_manager import hash_block_tokens
from omniserve.core.request import Request, RequestStatus
from omniserve.core.scheduler import Scheduler
from omniserve.core.step_failure import fail_step
from omniserve.messages import EngineCoreOutput, FinishReason
from tests.utils import (
    EOS_TOKEN_ID,
    assert_all_free,
    make_request,
    make_requests,
    make_runner_output,
    make_scheduler,
    run_stress,
    run_to_completion,
)


def _step(scheduler: Scheduler, **runner_kwargs: object) -> dict[str, EngineCoreOutput]:
    scheduler_output = scheduler.schedule()
    runner_output = make_runner_output(scheduler, scheduler_output, **runner_kwargs)
    outputs = scheduler.update_from_output(scheduler_output, runner_output).outputs
    return {output.request_id: output for output in outputs}


def test_token_budget_and_chunked_prefill() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=32)
    long, *short = make_requests(1, 100, prefix="long") + make_requests(3, 10)
    for request in [long, *short]:
        scheduler.add_request(request)
    chunks = []
    while scheduler.has_unfinished_requests():
        scheduler_output = scheduler.schedule()
        counts = scheduler_output.num_scheduled_tokens
        assert 0 < scheduler_output.total_num_scheduled_tokens <= 32
        assert sum(counts.values()) == scheduler_output.total_num_scheduled_tokens
        if long.num_output_tokens == 0 and long.request_id in counts:
            chunks.append(counts[long.request_id])
        runner_output = make_runner_output(scheduler, scheduler_output)
        scheduler.update_from_output(scheduler_output, runner_output)
    assert chunks[0] == 32 and len(chunks) > 3  # the long prompt ran in several chunks
    assert sum(chunks) == 100
    assert long.output_token_ids == tuple(range(1, 17))
    assert_all_free(scheduler)


def test_chunks_report_computed_tokens_before_the_step() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=32, block_size=16)
    scheduler.add_request(make_request("a", list(range(1000, 1070))))  # 70 tokens
    first = scheduler.schedule()
    assert [r.num_computed_tokens for r in first.scheduled_new_reqs] == [0]
    assert first.scheduled_new_reqs[0].block_ids == [0, 1]
    scheduler.update_from_output(first, make_runner_output(scheduler, first))
    second = scheduler.schedule()
    cached = second.scheduled_cached_reqs
    assert cached.req_ids == ["a"] and cached.num_computed_tokens == [32]
    assert cached.new_block_ids == [[2, 3]]
    assert second.num_scheduled_tokens == {"a": 32}


def test_long_prefill_threshold_caps_each_chunk() -> None:
    scheduler = make_scheduler(long_prefill_token_threshold=8)
    scheduler.add_request(make_request("a", list(range(1000, 1020))))
    chunks = []
    for _ in range(3):
        so = scheduler.schedule()
        chunks.append(so.num_scheduled_tokens["a"])
        scheduler.update_from_output(so, make_runner_output(scheduler, so))
    assert chunks == [8, 8, 4]


def test_without_chunked_prefill_a_prompt_waits_for_a_budget_it_fits() -> None:
    scheduler = make_scheduler(
        max_num_batched_tokens=64,
        max_model_len=64,
        enable_chunked_prefill=False,
        long_prefill_token_threshold=8,
    )
    a, b = make_requests(2, 40)
    scheduler.add_request(a)
    scheduler.add_request(b)
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {a.request_id: 40}  # b does not fit the 24 left
    assert [r.request_id for r in scheduler.waiting] == [b.request_id]
    scheduler.update_from_output(first, make_runner_output(scheduler, first))
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {a.request_id: 1, b.request_id: 40}


def test_max_num_seqs_limits_running_requests() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    requests = make_requests(5, 10, max_tokens=3)
    for request in requests:
        scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        assert len(so.num_scheduled_tokens) <= 2 and len(scheduler.running) <= 2
        scheduler.update_from_output(so, make_runner_output(scheduler, so))
    assert all(r.output_token_ids == (1, 2, 3) for r in requests)
    assert_all_free(scheduler)


def test_preempted_request_resumes_and_completes() -> None:
    # 2 requests growing to 24 tokens = 6 blocks each; the pool has 8.
    scheduler = make_scheduler(block_size=4, num_blocks=8, max_model_len=32)
    a, b = make_requests(2, 12, max_tokens=12)
    scheduler.add_request(a)
    scheduler.add_request(b)
    outputs: dict[str, list[int]] = {a.request_id: [], b.request_id: []}
    preempted_at = resumed = None
    for step in range(100):
        if not scheduler.has_unfinished_requests():
            break
        so = scheduler.schedule()
        if so.preempted_req_ids and preempted_at is None:
            preempted_at = step
            assert so.preempted_req_ids == {b.request_id}  # the last running request
            assert scheduler.waiting[0] is b and b.status == RequestStatus.PREEMPTED
            assert scheduler.kv_cache_manager.get_block_ids(b.request_id) == []
            assert b.request_id not in so.num_scheduled_tokens
        if preempted_at is not None and resumed is None and so.scheduled_new_reqs:
            (resumed,) = so.scheduled_new_reqs
            assert resumed.req_id == b.request_id
            assert resumed.output_token_ids == outputs[b.request_id]
            assert resumed.prompt_token_ids == b.prompt_token_ids
            assert resumed.eos_token_id == EOS_TOKEN_ID
            # Its own freed blocks were still cached: only the tail is recomputed.
            assert resumed.num_computed_tokens > 0
            num_tokens_after = resumed.num_computed_tokens + so.num_scheduled_tokens[b.request_id]
            assert len(resumed.block_ids) == -(-num_tokens_after // 4)
            assert resumed.block_ids == scheduler.kv_cache_manager.get_block_ids(b.request_id)
        runner_output = make_runner_output(scheduler, so)
        for output in scheduler.update_from_output(so, runner_output).outputs:
            outputs[output.request_id].extend(output.new_token_ids)
    assert preempted_at is not None and resumed is not None
    assert outputs == {a.request_id: list(range(1, 13)), b.request_id: list(range(1, 13))}
    assert b.num_preemptions >= 1
    assert scheduler.make_stats()["num_preemptions"] == scheduler.num_preemptions >= 1
    assert_all_free(scheduler)


def test_priority_policy_admits_and_preempts_by_priority_then_arrival() -> None:
    """Lower priority values run first; ties go by arrival; when KV runs out the least urgent
    running request is preempted, even when it arrived first."""
    scheduler = make_scheduler(
        block_size=4, num_blocks=8, max_model_len=32, max_num_seqs=2, policy="priority"
    )
    low, high, mid, high2 = make_requests(4, 12, max_tokens=12)
    for request, priority, arrival in (
        (low, 5, 0.0),
        (high, -1, 1.0),
        (mid, 0, 2.0),
        (high2, -1, 3.0),
    ):
        request.priority, request.arrival_time = priority, arrival
        scheduler.add_request(request)
    assert list(scheduler.waiting) == [high, high2, mid, low]
    first = scheduler.schedule()
    assert [r.req_id for r in first.scheduled_new_reqs] == [high.request_id, high2.request_id]
    scheduler.update_from_output(first, make_runner_output(scheduler, first))
    fcfs = make_scheduler(policy="fcfs")
    for request, priority in zip(make_requests(3, 4, prefix="f"), (3, 2, 1), strict=True):
        request.priority = priority  # ignored under fcfs
        fcfs.add_request(request)
    assert [r.request_id for r in fcfs.waiting] == ["f-0", "f-1", "f-2"]
    # Both running grow past the pool (2 x 6 blocks > 8): the later of the two urgent ones,
    # high2, is preempted, and goes back ahead of mid and low.
    preempted = set()
    while not preempted:
        so = scheduler.schedule()
        preempted = so.preempted_req_ids
        scheduler.update_from_output(so, make_runner_output(scheduler, so))
    assert preempted == {high2.request_id}
    assert list(scheduler.waiting)[:3] == [high2, mid, low]
    run_to_completion(scheduler)
    assert_all_free(scheduler)


def test_second_identical_prompt_hits_the_prefix_cache() -> None:
    scheduler = make_scheduler(block_size=16)
    first, second = make_requests(2, 40, same_prompt=True, max_tokens=2)
    scheduler.add_request(first)
    run_to_completion(scheduler)
    scheduler.add_request(second)
    so = scheduler.schedule()
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 32 and so.num_scheduled_tokens == {second.request_id: 8}
    assert second.num_cached_tokens == 32
    (output,) = scheduler.update_from_output(so, make_runner_output(scheduler, so)).outputs
    assert output.num_cached_tokens == 32 and output.new_token_ids == [1]
    stats = scheduler.make_stats()
    assert stats["prefix_cache_queries"] == 80 and stats["prefix_cache_hits"] == 32
    assert scheduler.reset_prefix_cache() is False  # second still holds blocks


def test_a_continuation_copies_the_finished_requests_tail_unless_the_step_fails() -> None:
    scheduler = make_scheduler(block_size=4)
    a = make_request("a", list(range(10, 20)), max_tokens=1)  # writes 10 tokens: 2 blocks + 2
    scheduler.add_request(a)
    run_to_completion(scheduler)
    tail = scheduler.kv_cache_manager.block_pool.get_cached_block(
        hash_block_tokens(a.block_hashes[1], [18, 19], ())
    )
    assert tail is not None and tail.ref_cnt == 0
    for attempt in ("b", "c"):
        scheduler.add_request(make_request(attempt, [*range(10, 20), 1]))  # a's tokens + 1
        so = scheduler.schedule()
        (new,) = so.scheduled_new_reqs
        assert new.num_computed_tokens == 10 and so.num_scheduled_tokens == {attempt: 1}
        assert so.kv_block_copies == {attempt: (tail.block_id, new.block_ids[2])}
        if attempt == "b":  # the step raises: b fails, and leaves no tail it may not have copied
            b = scheduler.requests["b"]
            (error,) = fail_step(scheduler, [so]).outputs
            assert error.finish_reason == FinishReason.ERROR and b.num_computed_tokens == 8
    scheduler.update_from_output(so, make_runner_output(scheduler, so))
    run_to_completion(scheduler)
    assert_all_free(scheduler)


def test_a_failed_step_uncaches_the_blocks_it_was_to_write() -> None:
    """With steps in flight (async scheduling) a request can be freed before the step that
    writes its blocks fails: those blocks, offered to the prefix cache when the step was
    scheduled, must serve no hit."""
    scheduler = make_scheduler(block_size=4)
    scheduler.add_request(make_request("a", list(range(10, 19)), max_tokens=1))  # 2 full blocks
    so = scheduler.schedule()
    assert len(so.newly_cached_block_ids) == 2
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # while the step runs
    fail_step(scheduler, [so])
    scheduler.add_request(make_request("b", list(range(10, 19))))
    (new,) = scheduler.schedule().scheduled_new_reqs
    assert new.num_computed_tokens == 0


def test_identical_prompts_admitted_together_share_blocks() -> None:
    scheduler = make_scheduler(block_size=16)
    first, second = make_requests(2, 33, same_prompt=True)
    scheduler.add_request(first)
    scheduler.add_request(second)
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {first.request_id: 33, second.request_id: 1}
    block_ids = [r.block_ids for r in so.scheduled_new_reqs]
    assert block_ids[0][:2] == block_ids[1][:2] and block_ids[0][2] != block_ids[1][2]


def _generate(
    tokens: list[int], *, prompt_len: int = 8, max_model_len: int = 1024, **request_kwargs: object
) -> EngineCoreOutput:
    """Run one request whose i-th sampled token is tokens[i]; return its last output."""
    scheduler = make_scheduler(max_model_len=max_model_len)
    request = make_request("r", list(range(1000, 1000 + prompt_len)), **request_kwargs)
    scheduler.add_request(request)
    generated: list[int] = []
    output = None
    while scheduler.has_unfinished_requests():
        outputs = _step(scheduler, next_token=lambda r: tokens[r.num_output_tokens])
        output = outputs["r"]
        generated.extend(output.new_token_ids)
    assert output is not None and output.finished
    assert list(request.output_token_ids) == generated
    assert_all_free(scheduler)
    return EngineCoreOutput(
        "r", generated, finish_reason=output.finish_reason, stop_reason=output.stop_reason
    )


@pytest.mark.parametrize(
    "tokens, kwargs, expected, reason, stop_reason",
    [
        ([5, EOS_TOKEN_ID, 6, 7], {}, [5, EOS_TOKEN_ID], FinishReason.STOP, None),
        (
            [5, EOS_TOKEN_ID, 6, 7],
            {"ignore_eos": True, "max_tokens": 4},
            [5, EOS_TOKEN_ID, 6, 7],
            FinishReason.LENGTH,
            None,
        ),
        ([5, 6, 7], {"stop_token_ids": [6, 9]}, [5, 6], FinishReason.STOP, 6),
        ([5, 6, 7], {"max_tokens": 2}, [5, 6], FinishReason.LENGTH, None),
        (
            [EOS_TOKEN_ID, 9, EOS_TOKEN_ID, 5],
            {"min_tokens": 2, "stop_token_ids": [9]},
            [EOS_TOKEN_ID, 9, EOS_TOKEN_ID],
            FinishReason.STOP,
            None,
        ),
        ([5, EOS_TOKEN_ID], {"max_tokens": 2}, [5, EOS_TOKEN_ID], FinishReason.STOP, None),
        ([5, 6, 7, 8], {"max_model_len": 10}, [5, 6], FinishReason.LENGTH, None),
    ],
)
def test_stop_conditions(
    tokens: list[int],
    kwargs: dict,
    expected: list[int],
    reason: FinishReason,
    stop_reason: int | None,
) -> None:
    output = _generate(tokens, **kwargs)
    assert output.new_token_ids == expected
    assert output.finish_reason == reason and output.stop_reason == stop_reason


def test_abort_frees_blocks_and_reports_finished_ids() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    a, b, c = make_requests(3, 20)
    for request in (a, b, c):
        scheduler.add_request(request)
    so = scheduler.schedule()
    assert list(so.num_scheduled_tokens) == [a.request_id]
    runner_output = make_runner_output(scheduler, so)
    scheduler.finish_requests([a.request_id, "unknown"], RequestStatus.FINISHED_ABORTED)
    # The step was already running: its result for a is dropped without an output.
    outputs = scheduler.update_from_output(so, runner_output).outputs
    assert outputs == [] and a.status == RequestStatus.FINISHED_ABORTED
    scheduler.finish_requests(c.request_id, RequestStatus.FINISHED_ABORTED)
    so = scheduler.schedule()
    assert so.finished_req_ids == {a.request_id, c.request_id}
    assert list(so.num_scheduled_tokens) == [b.request_id]
    assert scheduler.get_num_unfinished_requests() == 1
    scheduler.finish_requests([b.request_id], RequestStatus.FINISHED_ABORTED)
    assert scheduler.schedule().finished_req_ids == {b.request_id}
    assert_all_free(scheduler)
    with pytest.raises(ValueError):
        scheduler.finish_requests("x", RequestStatus.RUNNING)


def test_prompt_logprobs_are_emitted_on_partial_prefill_steps() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", list(range(1000, 1012)), prompt_logprobs=1))
    first = _step(scheduler, prompt_logprobs=True)["a"]
    assert first.new_token_ids == [] and not first.finished
    assert first.new_prompt_logprobs is not None and len(first.new_prompt_logprobs.ranks) == 8
    second = _step(scheduler, prompt_logprobs=True)["a"]
    assert second.new_token_ids == [1] and len(second.new_prompt_logprobs.ranks) == 4


def test_add_request_validates() -> None:
    scheduler = make_scheduler(max_model_len=16)
    scheduler.add_request(make_request("a", [1, 2]))
    with pytest.raises(ValueError, match="already"):
        scheduler.add_request(make_request("a", [1, 2]))
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(make_request("b", list(range(17))))
    with pytest.raises(ValueError, match="fewer than one max_model_len=64 sequence needs"):
        make_scheduler(max_model_len=64, block_size=16, num_blocks=3)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_randomized_stress_keeps_invariants_and_frees_everything(seed: int) -> None:
    rng = random.Random(seed)
    scheduler = make_scheduler(
        block_size=4,
        num_blocks=10,
        max_model_len=24,
        max_num_batched_tokens=16,
        max_num_seqs=6,
        long_prefill_token_threshold=rng.choice([0, 6]),
    )
    prefixes = [[rng.randrange(1, 50) for _ in range(12)] for _ in range(3)]

    def new_request(i: int) -> Request:
        prompt = rng.choice(prefixes)[: rng.randrange(0, 12)]
        prompt += [rng.randrange(1, 50) for _ in range(rng.randrange(1, 5))]
        return make_request(
            f"r{i}",
            prompt,
            max_tokens=rng.randrange(1, 13),
            prompt_logprobs=1 if rng.random() < 0.1 else None,
        )

    run_stress(scheduler, rng, new_request)
