"""Linear layers that shard themselves across tensor-parallel ranks.

Column-parallel layers split the output dimension (each rank computes a slice of the features);
row-parallel layers split the input dimension and sum the partial products across ranks. Fused
layers (q/k/v, gate/up) hold several checkpoint matrices in one weight so one matmul serves them
all; their ``weight_loader`` takes a shard id naming which checkpoint matrix is being written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from omniserve.layers.tp import divide, get_tp_rank, get_tp_size, tp_all_reduce
from omniserve.layers.weight_utils import (
    LoadedWeight,
    copy_weight,
    default_weight_loader,
    set_weight_loader,
)

if TYPE_CHECKING:
    from omniserve.layers.lora import LoRASlots
    from omniserve.layers.quantization import QuantizationConfig


def _check_shape(param: torch.Tensor, expected: tuple[int, ...], loaded: LoadedWeight) -> None:
    if tuple(loaded.shape) != expected:
        raise ValueError(
            f"Shape mismatch: expected checkpoint shape {expected} for a parameter "
            f"of local shape {tuple(param.shape)}, got {tuple(loaded.shape)}."
        )


class LinearKernel(Protocol):
    """A backend's implementation of one layer's ``x @ weight.T + bias``."""

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


class LinearBase(nn.Module):
    """A layer computing ``x @ weight.T (+ bias)``, through a backend's ``kernel`` when set (a
    quantized layer always has one), plus the step's LoRA adapters' products when it has ``lora``
    slots."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    kernel: LinearKernel | None = None
    lora: LoRASlots | None = None
    input_size: int
    output_size: int
    quantization: QuantizationConfig | None = None
    """Set when the weight is quantized (``layers/quantization.py`` says which tensors hold it)."""
    keeps_dtype: bool = False
    """Set on layers whose weight's dtype other code reads (transformers' towers cast their
    inputs to it), so the weight stays in the model's dtype (``keep_bf16_weights`` skips it)."""

    def checkpoint_rows(self, *shard: object) -> int:
        """Output features of the checkpoint matrix that ``shard`` (a loader's shard id) names:
        a quantized weight's per-block scales are widened to per-row ones with it."""
        return self.output_size

    def apply_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = F.linear(x, self.weight, bias) if self.kernel is None else self.kernel(x, bias)
        return out if self.lora is None else self.lora.add_delta(x, out)


class ReplicatedLinear(LinearBase):
    """A full copy on every rank (small matrices such as an MoE router)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply_linear(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """``y = x W^T + b`` with W's rows (output features) split evenly across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_partition = divide(output_size, self.tp_size, "output features")
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size))
        self.bias = nn.Parameter(torch.empty(self.output_size_per_partition)) if bias else None
        for param in (self.weight, self.bias):
            if param is not None:
                set_weight_loader(param, self.weight_loader, self._shard_ids())

    def _shard_ids(self) -> set[tuple[object, ...]] | None:
        return None

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight) -> None:
        _check_shape(param, (self.output_size, *param.shape[1:]), loaded)
        copy_weight(param.data, loaded, 0, self.tp_rank * self.output_size_per_partition)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply_linear(x, self.bias)  # [*, output_size_per_partition]


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices side by side (gate_proj + up_proj), shard id = index."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def _shard_ids(self) -> set[tuple[object, ...]]:
        return {(i,) for i in range(len(self.output_sizes))}

    def checkpoint_rows(self, *shard: object) -> int:
        return self.output_sizes[shard[0]]  # type: ignore[call-overload]

    def weight_loader(  # type: ignore[override]
        self,
        param: nn.Parameter,
        loaded: LoadedWeight,
        shard_id: int,
    ) -> None:
        _check_shape(param, (self.output_sizes[shard_id], *param.shape[1:]), loaded)
        size = divide(self.output_sizes[shard_id], self.tp_size)
        offset = divide(sum(self.output_sizes[:shard_id]), self.tp_size)
        copy_weight(param.data.narrow(0, offset, size), loaded, 0, self.tp_rank * size)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; output layout per rank is ``[q | k | v]``.

    Query heads split across ranks; KV heads split too, or are replicated when there are fewer
    KV heads than ranks (each rank then holds the one KV head its query heads read).
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        tp_size = get_tp_size()
        self.head_size = head_size
        self.num_heads = divide(total_num_heads, tp_size, "attention heads")
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            if tp_size % total_num_kv_heads:
                raise ValueError(
                    f"The tensor-parallel size {tp_size} is not a multiple of the "
                    f"{total_num_kv_heads} KV heads, so they cannot be replicated evenly."
                )
            self.num_kv_head_replicas = tp_size // total_num_kv_heads
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "KV heads")
            self.num_kv_head_replicas = 1
        self.q_size = self.num_heads * head_size  # per rank
        self.kv_size = self.num_kv_heads * head_size
        self.total_sizes = {
            "q": total_num_heads * head_size,
            "k": total_num_kv_heads * head_size,
            "v": total_num_kv_heads * head_size,
        }
        super().__init__(hidden_size, (self.q_size + 2 * self.kv_size) * tp_size, bias)

    def _shard_ids(self) -> set[tuple[object, ...]]:
        return {("q",), ("k",), ("v",)}

    def checkpoint_rows(self, *shard: object) -> int:
        return self.total_sizes[shard[0]]  # type: ignore[index]

    def weight_loader(  # type: ignore[override]
        self,
        param: nn.Parameter,
        loaded: LoadedWeight,
        shard_id: str,
    ) -> None:
        _check_shape(param, (self.total_sizes[shard_id], *param.shape[1:]), loaded)
        if shard_id == "q":
            offset, size, source_index = 0, self.q_size, self.tp_rank
        else:
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, source_index = self.kv_size, self.tp_rank // self.num_kv_head_replicas
        copy_weight(param.data.narrow(0, offset, size), loaded, 0, source_index * size)


class RowParallelLinear(LinearBase):
    """``y = x W^T + b`` with W's columns (input features) split; partial sums are all-reduced.

    The input arrives already split (the output of a column-parallel layer), so no scatter is
    needed. The bias is added once, after the reduction.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = divide(input_size, self.tp_size, "input features")
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition))
        set_weight_loader(self.weight, self.weight_loader)
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None
        if self.bias is not None:
            set_weight_loader(self.bias, default_weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight) -> None:
        # Columns per rank from the parameter, not the features: a quantized weight's tensors
        # hold features two to a byte, or one column per group (layers/quantization.py).
        _check_shape(param, (param.shape[0], param.shape[1] * self.tp_size), loaded)
        copy_weight(param.data, loaded, 1, self.tp_rank * param.shape[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.apply_linear(x, self.bias)
        out = tp_all_reduce(self.apply_linear(x, None))
        return out if self.bias is None else out + self.bias
