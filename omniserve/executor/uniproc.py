"""UniProcExecutor: a single worker in the engine-core process."""

from __future__ import annotations

from typing import Any

from omniserve.config import OmniConfig
from omniserve.core.sched_output import SchedulerOutput
from omniserve.executor.abstract import Executor
from omniserve.messages import PendingOutput
from omniserve.worker.worker import worker_class


class UniProcExecutor(Executor):
    supports_async_scheduling = True

    def __init__(self, config: OmniConfig) -> None:
        super().__init__(config)
        self.worker = worker_class(config.parallel_config)(config, rank=0)

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def dispatch_model(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        return self.worker.dispatch_model(scheduler_output)

    def launch_model(self, scheduler_output: SchedulerOutput) -> None:
        self.worker.launch_model(scheduler_output)

    def dispatch_sampling(self, grammar_bitmask: dict[str, bytes]) -> PendingOutput:
        return self.worker.dispatch_sampling(grammar_bitmask)

    def shutdown(self) -> None:
        """Nothing to release: the worker lives and dies with this process."""
