"""Adapters on the decoder's linear layers, several per step.

Each adapted layer holds ``max_loras`` slots on the device: ``a`` ``[slot, width, in]`` and
``bt`` ``[slot, width, out]`` (B transposed), where a fused layer's slices (q/k/v, gate/up) each
own ``max_lora_rank`` of the width (smaller ranks are zero-padded), so one pair of matmuls serves
the whole layer. The step's ``LoRAMapping`` says which tokens run with which slot; a layer adds
``(x[rows] @ a.T) @ bt`` to its output for each (the adapter's scaling is folded into ``bt``),
through a backend's ``kernel`` where it has one. Tensor parallelism shards as the base weight
does: ``bt`` with a column-parallel layer's outputs, ``a`` with a row-parallel layer's inputs (the
product is then a partial sum, reduced with the layer's own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from omniserve.config import LoRAConfig
from omniserve.forward_context import current_forward_context
from omniserve.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from omniserve.lora.adapter import LoRAPair


@dataclass(frozen=True)
class LoRAMapping:
    """One step's adapters: (slot, token rows) pairs; rows None means every token."""

    groups: list[tuple[int, torch.Tensor | None]]


def _shard_ids(layer: LinearBase) -> list[tuple[object, ...]]:
    """The layer's checkpoint matrices, as its weight loader names them."""
    if isinstance(layer, QKVParallelLinear):
        return [("q",), ("k",), ("v",)]
    if isinstance(layer, MergedColumnParallelLinear):
        return [(i,) for i in range(len(layer.output_sizes))]
    return [()]


class LoRAKernel(Protocol):
    """A backend's ``y += (x @ a.T) @ bt``, on ``bt`` in the layout ``pack`` gives it (once per
    adapter); ``add`` returns False where it does not take the tensors (torch then runs it)."""

    def pack(self, bt: torch.Tensor) -> torch.Tensor: ...

    def add(
        self, x: torch.Tensor, a: torch.Tensor, packed: torch.Tensor, y: torch.Tensor
    ) -> bool: ...


class LoRASlots:
    """One layer's adapter slots and the delta it adds to its output."""

    kernel: LoRAKernel | None = None

    def __init__(
        self, layer: ColumnParallelLinear | RowParallelLinear, config: LoRAConfig,
        dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        self.layer = layer
        self.shards = _shard_ids(layer)
        self.rank = config.max_lora_rank
        if isinstance(layer, RowParallelLinear):
            self.in_features, self.out_features = layer.input_size_per_partition, layer.output_size
        else:
            self.in_features, self.out_features = layer.input_size, layer.output_size_per_partition
        width = len(self.shards) * self.rank
        slots = config.max_loras
        self.a = torch.zeros(slots, width, self.in_features, dtype=dtype, device=device)
        self.bt = torch.zeros(slots, width, self.out_features, dtype=dtype, device=device)
        """B transposed (``[width, out]``): the expand reads it along the outputs."""
        self.packed: list[torch.Tensor | None] = [None] * slots
        """Each slot's ``bt`` in the kernel's layout (with a kernel)."""

    def empty(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A host copy of one slot, to fill with an adapter's pairs (pinned for a GPU's slots,
        so that filling a slot does not wait for the steps before it)."""
        pin = self.a.device.type == "cuda"
        return (torch.zeros(self.a.shape[1:], dtype=self.a.dtype, pin_memory=pin),
                torch.zeros(self.bt.shape[1:], dtype=self.bt.dtype, pin_memory=pin))  # fmt: skip

    def place(
        self, a: torch.Tensor, bt: torch.Tensor, pair: LoRAPair, shard: tuple[object, ...]
    ) -> None:
        """Write ``pair`` (full checkpoint shapes) into a host slot as this rank holds it."""
        if shard not in self.shards:
            raise ValueError(f"no shard {shard}")
        first = self.shards.index(shard) * self.rank
        cols = slice(first, first + pair.rank)
        scaled_b = (pair.b.double() * pair.scaling).to(bt.dtype)
        if isinstance(self.layer, RowParallelLinear):
            local_a = torch.zeros(pair.rank, self.in_features, dtype=a.dtype)
            self.layer.weight_loader(local_a, pair.a)
            a[cols] = local_a
            if scaled_b.shape[0] != self.out_features:
                raise ValueError(f"lora_B has {scaled_b.shape[0]} rows, the layer "
                                 f"{self.out_features} outputs")  # fmt: skip
            bt[cols] = scaled_b.T
            return
        if pair.a.shape[1] != self.in_features:
            raise ValueError(f"lora_A has {pair.a.shape[1]} columns, the layer "
                             f"{self.in_features} inputs")  # fmt: skip
        a[cols] = pair.a.to(a.dtype)
        local_b = torch.zeros(self.out_features, pair.rank, dtype=bt.dtype)
        self.layer.weight_loader(local_b, scaled_b, *shard)
        bt[cols] = local_b.T

    def load(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Fill ``slot`` with an adapter's host copy (None: the adapter leaves the layer be)."""
        if weights is None:
            self.a[slot].zero_()
            self.bt[slot].zero_()
        else:
            self.a[slot].copy_(weights[0], non_blocking=True)
            self.bt[slot].copy_(weights[1], non_blocking=True)
        if self.kernel is not None:
            self.packed[slot] = self.kernel.pack(self.bt[slot])

    def _product_into(self, x: torch.Tensor, slot: int, y: torch.Tensor) -> None:
        a, packed = self.a[slot], self.packed[slot]
        if self.kernel is None or packed is None or not self.kernel.add(x, a, packed, y):
            y.addmm_(x @ a.T, self.bt[slot])

    def add_delta(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        context = current_forward_context()
        mapping = context.lora_mapping if context is not None else None
        if mapping is None:
            return out
        x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        for slot, rows in mapping.groups:
            if rows is None:
                self._product_into(x2, slot, out2)
            else:
                delta = out2.new_zeros(rows.shape[0], out2.shape[1])
                self._product_into(x2.index_select(0, rows), slot, delta)
                out2.index_add_(0, rows, delta)
        return out
