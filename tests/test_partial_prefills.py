"""vLLM's partial-prefill caps (``--max-num-partial-prefills``, ``--max-long-partial-prefills``),
which vLLM's V1 scheduler takes and never enforces: at most so many requests prefill in a step,
at most so many long ones, decodes never wait for a seat, and a short prompt passes a long one
that has no seat."""

from __future__ import annotations

import pytest

from omniserve.config import SchedulerConfig
from omniserve.core.scheduler import Scheduler
from tests.utils import assert_all_free, make_request, make_runner_output, make_scheduler


def _prefilling(scheduler: Scheduler, counts: dict[str, int]) -> list[str]:
    """The requests of a step's counts whose window is (part of) their prompt."""
    return [r for r in counts if scheduler.requests[r].num_output_tokens == 0]


def _run(scheduler: Scheduler) -> list[dict[str, int]]:
    """Every step's token counts, to the end; each step is checked against the caps."""
    steps = []
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        steps.append(dict(so.num_scheduled_tokens))
        scheduler.update_from_output(so, make_runner_output(scheduler, so))
    assert_all_free(scheduler)
    return steps


def _prompt(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def test_at_most_n_requests_prefill_per_step_and_decodes_never_wait():
    scheduler = make_scheduler(max_num_batched_tokens=256, max_num_partial_prefills=2)
    # The threshold defaults to vLLM's 4% of max_model_len (1024): chunks of at most 40.
    assert scheduler.scheduler_config.long_prefill_token_threshold == 40
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", _prompt(100, 1000 + 200 * i), max_tokens=4))
    prefilled: set[str] = set()
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        counts = so.num_scheduled_tokens
        prefilling = _prefilling(scheduler, counts)
        assert len(prefilling) <= 2 and all(counts[r] <= 40 for r in prefilling)
        decoding = [r for r in scheduler.running if r.num_output_tokens]
        # every decoding request that has its token back runs this step
        assert all(r.request_id in counts for r in decoding if not r.num_output_placeholders)
        prefilled.update(prefilling)
        scheduler.update_from_output(so, make_runner_output(scheduler, so))
    assert prefilled == {"r0", "r1", "r2", "r3"}
    assert_all_free(scheduler)


def test_short_prompts_pass_a_long_one_without_a_seat():
    scheduler = make_scheduler(
        max_num_batched_tokens=64, long_prefill_token_threshold=16,
        max_num_partial_prefills=3, max_long_partial_prefills=1,
    )  # fmt: skip
    for name, length, start in (("long1", 80, 1000), ("long2", 80, 2000),
                                ("short1", 10, 3000), ("short2", 12, 4000)):  # fmt: skip
        scheduler.add_request(make_request(name, _prompt(length, start), max_tokens=2))
    steps = []
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        counts = so.num_scheduled_tokens
        steps.append(dict(counts))
        # what was left of each prompt before the step (schedule() advanced them)
        rests = {r: scheduler.requests[r].num_tokens - scheduler.requests[r].num_computed_tokens
                 + n for r, n in counts.items() if r in _prefilling(scheduler, counts)}  # fmt: skip
        assert sum(rest > 16 for rest in rests.values()) <= 1  # one long prefill at a time
        assert all(n <= 16 for n in counts.values())  # the threshold caps every chunk
        scheduler.update_from_output(so, make_runner_output(scheduler, so))
    assert_all_free(scheduler)
    assert set(steps[0]) == {"long1", "short1", "short2"}  # long2 waits for long1's seat
    # long2 starts once the rest of long1 is within the threshold (no longer long)
    assert "long2" in steps[4] and steps[4]["long1"] == 16 and "long2" not in steps[3]


def test_one_at_a_time_keeps_whole_chunks():
    """vLLM's rule: the 4% default applies to more than one seat only; one seat keeps the
    budget's chunks."""
    scheduler = make_scheduler(max_num_batched_tokens=64, max_num_partial_prefills=1)
    assert scheduler.scheduler_config.long_prefill_token_threshold == 0
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", _prompt(100, 1000 + 200 * i), max_tokens=3))
    steps = _run(scheduler)
    for counts in steps:
        assert len([r for r, n in counts.items() if n > 1]) <= 1
    assert steps[0] == {"r0": 64}


def test_settings_are_checked():
    with pytest.raises(ValueError, match="max_long_partial_prefills \\(3\\) must be <= "):
        SchedulerConfig(max_num_partial_prefills=2, max_long_partial_prefills=3)
    with pytest.raises(ValueError, match="max_num_partial_prefills must be >= 1"):
        SchedulerConfig(max_num_partial_prefills=0)
    with pytest.raises(ValueError, match="needs chunked prefill"):
        SchedulerConfig(max_num_partial_prefills=2, enable_chunked_prefill=False,
                        max_num_batched_tokens=4096)  # fmt: skip
    only_long = SchedulerConfig(max_long_partial_prefills=1, max_model_len=2000)
    assert only_long.long_prefill_token_threshold == 80
    given = SchedulerConfig(max_num_partial_prefills=4, long_prefill_token_threshold=100)
    assert given.long_prefill_token_threshold == 100
    assert SchedulerConfig().long_prefill_token_threshold == 0


def test_flags(tiny_checkpoint):
    from omniserve.engine.arg_utils import EngineArgs
    from omniserve.entrypoints.cli import build_parser

    model = str(tiny_checkpoint("Qwen2ForCausalLM"))
    parser = build_parser()
    parsed = parser.parse_args(["serve", "--model", model, "--max-num-partial-prefills", "4",
                                "--max-long-partial-prefills", "2"])  # fmt: skip
    parsed.check_flags(parser, parsed)
    config = EngineArgs.from_cli_args(parsed).create_config().scheduler_config
    assert (config.max_num_partial_prefills, config.max_long_partial_prefills) == (4, 2)
    assert config.long_prefill_token_threshold == int(config.max_model_len * 0.04)
