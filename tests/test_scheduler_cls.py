"""vLLM's --scheduler-cls: the engine core schedules with a user's subclass of omniserve's
Scheduler, given as module.Class (or, in the Python API, the class itself); anything else is
refused at start-up naming the setting."""

from __future__ import annotations

from typing import Any

import pytest

from omniserve import LLM, SamplingParams
from omniserve.core.scheduler import Scheduler
from omniserve.engine.arg_utils import EngineArgs
from omniserve.engine.core import VLLM_SCHEDULER, scheduler_class


class CountingScheduler(Scheduler):
    """Schedules as the engine's own, counting its steps."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps = 0

    def schedule(self) -> Any:
        self.steps += 1
        return super().schedule()


@pytest.mark.parametrize("spec", ["tests.test_scheduler_cls.CountingScheduler", CountingScheduler])
def test_engine_schedules_with_the_named_class(tiny_checkpoint: Any, spec: Any) -> None:
    path = str(tiny_checkpoint("Qwen3ForCausalLM"))
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
        llm = LLM(path, max_model_len=256, kv_cache_memory="4MiB", scheduler_cls=spec)
    try:
        (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        assert type(scheduler) is CountingScheduler
        assert len(out.outputs[0].token_ids) == 5 and scheduler.steps >= 5
    finally:
        llm.llm_engine.shutdown()


def test_scheduler_cls_refusals(tiny_checkpoint: Any) -> None:
    path = str(tiny_checkpoint("Qwen3ForCausalLM"))
    assert scheduler_class("") is scheduler_class(VLLM_SCHEDULER) is Scheduler
    for spec, message in (
        ("collections.OrderedDict", "OrderedDict is not a subclass of omniserve.core.scheduler"),
        ("no_such_module.Scheduler", "--scheduler-cls: cannot import 'no_such_module'"),
        ("Scheduler", "is not module:Class"),
    ):
        with pytest.raises(ValueError, match=message):
            EngineArgs(model=path, scheduler_cls=spec).create_config()

    def local() -> type:
        class Local(Scheduler):
            pass

        return Local

    with pytest.raises(ValueError, match="give a class importable from its module"):
        EngineArgs(model=path, scheduler_cls=local()).create_config()
