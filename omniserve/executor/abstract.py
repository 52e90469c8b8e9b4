"""Executor: fans engine-core calls out to the workers (one in process, or several)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from omniserve.config import OmniConfig
from omniserve.core.sched_output import SchedulerOutput
from omniserve.messages import ModelRunnerOutput, PendingOutput, ReadyOutput


class Executor(ABC):
    supports_async_scheduling: ClassVar[bool] = False
    """``dispatch_model`` returns before the step's output is back (the engine core can then
    schedule the next step meanwhile)."""

    def __init__(self, config: OmniConfig) -> None:
        self.config = config
        self._failure_callback: Callable[[BaseException], None] | None = None
        self._held_step: SchedulerOutput | None = None  # see launch_model

    @staticmethod
    def get_class(config: OmniConfig) -> type[Executor]:
        """The backend's class: "uni" by default for one rank, "mp" for more, or "ray"."""
        parallel = config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ValueError(
                "Pipeline parallelism (--pipeline-parallel-size > 1) is not supported yet; "
                "use --tensor-parallel-size to split a model across devices."
            )
        backend = parallel.distributed_executor_backend
        if backend is None:
            backend = "uni" if parallel.world_size == 1 else "mp"
        if backend == "uni":
            if parallel.world_size > 1:
                raise ValueError(
                    "The 'uni' executor runs one worker; --tensor-parallel-size "
                    f"{parallel.tensor_parallel_size} needs the 'mp' or 'ray' backend."
                )
            from omniserve.executor.uniproc import UniProcExecutor

            return UniProcExecutor
        if backend == "mp":
            from omniserve.executor.multiproc import MultiprocExecutor

            return MultiprocExecutor
        if backend == "ray":
            from omniserve.executor.ray import RayExecutor

            return RayExecutor
        raise ValueError(
            f"Unknown distributed executor backend {backend!r}; use 'uni', 'mp' or 'ray'."
        )

    def register_failure_callback(self, callback: Callable[[BaseException], None]) -> None:
        """``callback(error)`` runs (on a monitor thread) when a worker dies, so an idle engine
        core learns of it at once instead of at its next step."""
        self._failure_callback = callback

    def _notify_failure(self, error: BaseException) -> None:
        if self._failure_callback is not None:
            self._failure_callback(error)

    def check_health(self) -> None:
        """Raise unless the workers can run another step after one raised (the engine dies)."""
        if self.config.parallel_config.world_size > 1:
            # Ranks that got past the failing op wait in a collective the others never reach.
            raise RuntimeError(
                "A step failed on a parallel worker; the ranks are no longer in step."
            )

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """Call ``method`` on every worker; return their results in rank order."""

    def determine_num_kv_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_kv_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def determine_num_talker_kv_blocks(self) -> int:
        """The speech stage's KV pool (0: the model does not speak)."""
        return min(self.collective_rpc("determine_num_talker_kv_blocks"))

    def initialize_talker_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_talker_kv_cache", (num_blocks,))

    def model_info(self) -> dict[str, Any]:
        """What rank 0 loaded and allocated (see ``Worker.model_info``)."""
        return self.collective_rpc("model_info")[0]

    def start_step_timing(self) -> None:
        """Zero the runners' per-part step timers and turn them on (``StepTimer``)."""
        self.collective_rpc("start_step_timing")

    def profile(self, is_start: bool) -> None:
        """Start or stop every worker's torch profiler (``WorkerProfiler``)."""
        self.collective_rpc("profile", (is_start,))

    def step_timings(self) -> dict[str, dict[str, float]]:
        """Rank 0's step time per part since ``start_step_timing``."""
        return self.collective_rpc("step_timings")[0]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on the workers."""
        # Every rank computes the same sampled tokens; rank 0's answer is the one used.
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    def dispatch_model(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        """Launch one step and return its pending output; here the step has run to its end
        (executors that support async scheduling return before)."""
        return ReadyOutput(self.execute_model(scheduler_output))

    def launch_model(self, scheduler_output: SchedulerOutput) -> None:
        """Launch one step up to its logits; ``dispatch_sampling`` completes it, so that the
        grammar bitmask can be made meanwhile. Here the step is only held, and runs whole when
        it is sampled (executors that can split a step launch its forward now)."""
        self._held_step = scheduler_output

    def dispatch_sampling(self, grammar_bitmask: dict[str, bytes]) -> PendingOutput:
        """Sample the step ``launch_model`` launched; its pending output."""
        scheduler_output, self._held_step = self._held_step, None
        if scheduler_output is None:
            raise RuntimeError("dispatch_sampling without a step from launch_model")
        scheduler_output.grammar_bitmask = grammar_bitmask
        return self.dispatch_model(scheduler_output)

    @abstractmethod
    def shutdown(self) -> None:
        """Release the workers (processes, actors, or the in-process one)."""
