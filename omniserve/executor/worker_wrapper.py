"""WorkerWrapper: one tensor-parallel rank, the part both distributed executors share.

It joins the ``torch.distributed`` group (gloo on CPU, NCCL on CUDA), builds the ``Worker`` and
runs the calls the executor broadcasts. ``MultiprocExecutor`` drives one in each worker process;
``RayExecutor`` makes it a Ray actor.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from omniserve import envs
from omniserve.config import OmniConfig

REPLY_ALL = "all"
"""Reply mode of a call whose result every rank returns (e.g. the KV block count)."""
REPLY_RANK0 = "rank0"
"""Reply mode of a call only rank 0 answers (a step: every rank samples the same tokens)."""


class WorkerWrapper:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.worker: Any = None  # a Worker once init_worker ran

    def init_worker(self, config: OmniConfig, init_method: str, local_rank: int) -> None:
        """Join the process group, then build the model (each rank loads only its shards)."""
        from omniserve.worker.worker import resolve_device, worker_class

        device = resolve_device(config.model_config.device)
        if device.type == "cuda":
            torch.cuda.set_device(local_rank)
        elif envs.num_threads() is None:
            # The ranks share the machine's cores (an explicit thread count is split by Worker).
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // self.world_size))
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=init_method,
            rank=self.rank,
            world_size=self.world_size,
        )
        self.worker = worker_class(config.parallel_config)(config, self.rank)

    def execute_method(self, method: str, args: tuple, reply: str = REPLY_ALL) -> Any:
        """Run ``Worker.method(*args)``; ranks other than 0 return None for ``REPLY_RANK0``."""
        result = getattr(self.worker, method)(*args)
        return result if reply == REPLY_ALL or self.rank == 0 else None

    def node_address(self) -> tuple[str, int]:
        """(Ray actors only) this node's address and a free TCP port on it: rank 0's answer is
        the process group's rendezvous point."""
        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
