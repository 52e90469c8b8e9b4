"""The model runner's step timer: off by default, and read through the engine's utilities."""

from __future__ import annotations

import pytest

from omniserve.engine.data_parallel import combine_results
from omniserve.worker.step_timing import PARTS, StepTimer


def test_the_timer_records_nothing_until_started() -> None:
    import torch

    timer = StepTimer(torch.device("cpu"))
    with timer.part("sampler"):
        pass
    timer.count_step(prefill=True)
    assert set(timer.snapshot()["seconds"].values()) == {0.0}
    timer.start()
    with timer.part("sampler"):
        sum(range(10_000))
    timer.count_step(prefill=False)
    snap = timer.snapshot()
    assert list(snap["seconds"]) == list(PARTS) and snap["seconds"]["sampler"] > 0
    assert snap["steps"] == {"prefill": 0.0, "decode": 1.0}


def test_data_parallel_engines_timings_add_up() -> None:
    one = {"seconds": {"sampler": 1.0}, "steps": {"prefill": 1.0, "decode": 2.0}}
    two = {"seconds": {"sampler": 0.5}, "steps": {"prefill": 3.0, "decode": 0.0}}
    assert combine_results("get_step_timings", [one, two]) == {
        "seconds": {"sampler": 1.5},
        "steps": {"prefill": 4.0, "decode": 2.0},
    }
    assert combine_results("start_step_timing", [None, None]) is None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_step_timings_through_the_engine_core_process(tiny_checkpoint) -> None:
    from omniserve import LLM, SamplingParams

    llm = LLM(str(tiny_checkpoint("Qwen3ForCausalLM")), max_model_len=256)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        prompts = [{"prompt_token_ids": [5, 6, 7]}]
        llm.generate(prompts, params, use_tqdm=False)  # untimed: the timer is off
        assert llm.llm_engine.get_step_timings()["steps"] == {"prefill": 0.0, "decode": 0.0}
        llm.llm_engine.start_step_timing()
        llm.generate(prompts, params, use_tqdm=False)
        timings = llm.llm_engine.get_step_timings()
    finally:
        llm.shutdown()
    # The prompt prefills in one step (sampling the first token), then three decode steps.
    assert timings["steps"] == {"prefill": 1.0, "decode": 3.0}
    seconds = timings["seconds"]
    assert seconds["encoders"] == 0.0 and seconds["speech stage"] == 0.0  # a text model
    for part in ("prefill steps: forward + logits", "decode steps: forward + logits", "sampler"):
        assert seconds[part] > 0, part
