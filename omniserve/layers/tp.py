"""Tensor-parallel rank, size and collectives as seen by the layers.

Layers read the group once, at construction. The tensor-parallel group is the default
``torch.distributed`` group when one is initialised (each engine's executor starts its own workers,
so their world is exactly the TP group: pipeline parallel size is 1, and data-parallel replicas
are separate engines with separate groups) and a single rank otherwise, where every collective
is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def get_tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def divide(numerator: int, denominator: int, what: str = "") -> int:
    """Exact division, with an error that names the sizes (and ``what`` they count) when a
    dimension does not shard evenly."""
    if numerator % denominator:
        counted = f" ({what})" if what else ""
        raise ValueError(
            f"{numerator}{counted} is not divisible by the tensor-parallel size {denominator}; "
            "choose a --tensor-parallel-size that divides it."
        )
    return numerator // denominator


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel ranks (in place)."""
    if get_tp_size() > 1:
        dist.all_reduce(x)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order."""
    world = get_tp_size()
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)
