"""RayExecutor: tensor-parallel workers as Ray actors, on this machine or across a Ray cluster.

``ray.init()`` connects to the cluster ``RAY_ADDRESS`` names, else to one started on this node
with ``ray start``, else starts a local instance on demand. Each engine reserves one placement
group (a ``{"GPU": 1}`` or ``{"CPU": 1}`` bundle per rank, packed onto as few nodes as possible)
and places one ``WorkerWrapper`` actor in each bundle; rank 0's node address and a free port on it
are the ``torch.distributed`` rendezvous. Calls are actor method calls: every rank runs each one,
and a step's result comes from rank 0 only. Ray is an optional extra: ``pip install
omniserve[ray]``.
"""

from __future__ import annotations

import logging
from typing import Any

from omniserve.config import OmniConfig
from omniserve.core.sched_output import SchedulerOutput
from omniserve.executor.abstract import Executor
from omniserve.executor.worker_wrapper import REPLY_ALL, REPLY_RANK0, WorkerWrapper
from omniserve.messages import ModelRunnerOutput

logger = logging.getLogger(__name__)

_PLACEMENT_TIMEOUT_S = 300.0


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            "--distributed-executor-backend ray needs Ray: pip install 'omniserve[ray]'."
        ) from exc
    return ray


class RayExecutor(Executor):
    def __init__(self, config: OmniConfig) -> None:
        super().__init__(config)
        ray = self._ray = _import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from omniserve.worker.worker import resolve_device

        if not ray.is_initialized():
            ray.init(include_dashboard=False)
        self.world_size = config.parallel_config.world_size
        device = "GPU" if resolve_device(config.model_config.device).type == "cuda" else "CPU"
        self._placement_group = placement_group([{device: 1}] * self.world_size, strategy="PACK")
        self._remove_placement_group = remove_placement_group
        self.workers: list[Any] = []
        try:
            if not self._placement_group.wait(_PLACEMENT_TIMEOUT_S):
                raise RuntimeError(
                    f"Ray could not reserve {self.world_size} x {{{device!r}: 1}} within "
                    f"{_PLACEMENT_TIMEOUT_S:.0f} s; cluster resources: "
                    f"{ray.cluster_resources()}."
                )
            actor_cls = ray.remote(WorkerWrapper)
            for rank in range(self.world_size):
                strategy = PlacementGroupSchedulingStrategy(
                    self._placement_group, placement_group_bundle_index=rank
                )
                resources = {"num_gpus": 1} if device == "GPU" else {"num_cpus": 1}
                self.workers.append(
                    actor_cls.options(scheduling_strategy=strategy, **resources).remote(
                        rank, self.world_size
                    )
                )
            host, port = self._get(self.workers[0].node_address.remote())
            # Ray gives each GPU actor its own CUDA_VISIBLE_DEVICES: its device is always 0.
            self._get(
                [w.init_worker.remote(config, f"tcp://{host}:{port}", 0) for w in self.workers]
            )
        except BaseException:
            self.shutdown()
            raise

    def _get(self, refs: Any) -> Any:
        """``ray.get``, with a dead actor reported as the rank it was."""
        try:
            return self._ray.get(refs)
        except self._ray.exceptions.RayActorError as exc:
            raise RuntimeError(f"A tensor-parallel Ray worker died: {exc}") from exc
        except self._ray.exceptions.RayTaskError as exc:
            raise exc.as_instanceof_cause() from None

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return self._get([w.execute_method.remote(method, args, REPLY_ALL) for w in self.workers])

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        # Serialised once into the object store; each actor receives the same object.
        args = self._ray.put((scheduler_output,))
        refs = [w.execute_method.remote("execute_model", args, REPLY_RANK0) for w in self.workers]
        return self._get(refs)[0]

    def shutdown(self) -> None:
        for worker in self.workers:
            self._ray.kill(worker)
        self.workers = []
        if self._placement_group is not None:
            self._remove_placement_group(self._placement_group)
            self._placement_group = None
