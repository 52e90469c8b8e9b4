"""Mixture-of-experts: top-k routing and the expert computation.

Expert weights are stacked, ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` (the layout
transformers keeps in memory), and loaded from the per-expert checkpoint keys
``experts.{e}.gate_proj/up_proj/down_proj.weight``. Under tensor parallelism each rank holds a slice
of every expert's intermediate dimension and the outputs are summed across ranks; with expert
parallelism (vLLM's ``--enable-expert-parallel``, ``expert_parallel``) each rank holds its share of
the experts whole instead, computes the token-expert pairs routed to them (the others' ids are
mapped to ``num_local_experts``, which every kernel skips) and the same sum adds the ranks' parts:
the activations are replicated under tensor parallelism, so no token moves between ranks.

A device backend may give a layer a ``kernel`` after loading (``omniserve.cpu`` does: the whole
expert block in one C call), and quantized experts have one from the start
(``quantized_loading.quantize_experts``); otherwise ``fused_experts`` runs: CUDA tensors go to
the Triton grouped-GEMM kernel (``triton_fused_moe``, imported lazily so CPU runs never load
triton), and everything else to the torch reference, which groups token-expert pairs by expert
and runs one matmul pair per expert that received tokens, accumulating with ``index_add_``; idle
experts cost nothing.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from omniserve.config import EXPERT_PLACEMENTS
from omniserve.layers.tp import divide, get_tp_rank, get_tp_size, tp_all_reduce
from omniserve.layers.weight_utils import (
    LoadedWeight,
    WeightRoute,
    copy_weight,
    materialize,
    set_weight_loader,
)

if TYPE_CHECKING:
    from omniserve.config import QuantizationConfig


_placement: str | None = None


@contextlib.contextmanager
def expert_parallel(placement: str | None) -> Iterator[None]:
    """MoE layers built inside hold whole experts, each rank its share (``placement``: "linear",
    contiguous blocks, or "round_robin", vLLM's ``--expert-placement-strategy``); None: every
    expert, sliced by tensor parallelism."""
    global _placement
    if placement is not None and placement not in EXPERT_PLACEMENTS:
        raise ValueError(f"expert placement must be one of {EXPERT_PLACEMENTS}, not "
                         f"{placement!r}.")  # fmt: skip
    before, _placement = _placement, placement
    try:
        yield
    finally:
        _placement = before


def local_experts(num_experts: int, rank: int, size: int, placement: str) -> list[int]:
    """The experts rank ``rank`` of ``size`` holds: "linear", a contiguous block (the first
    ``num_experts % size`` ranks one more); "round_robin", every ``size``-th."""
    if placement == "round_robin":
        return list(range(rank, num_experts, size))
    base, extra = divmod(num_experts, size)
    start = rank * base + min(rank, extra)
    return list(range(start, start + base + (rank < extra)))


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax in fp32, top-k, optional renormalisation -> (weights, expert ids), ``[N, top_k]``.

    The weights are cast back to the logits' dtype, as transformers does.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [N, num_experts]
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights.to(router_logits.dtype), topk_ids


def fused_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``sum_k w_k * down_e(silu(gate_e x) * up_e x)`` over each token's selected experts.

    x ``[N, H]``; gate_up_proj ``[E, 2I, H]``; down_proj ``[E, H, I]``; topk_* ``[N, top_k]``.
    Triton kernel on CUDA, torch reference elsewhere.
    """
    if x.is_cuda:
        from omniserve.layers.triton_fused_moe import triton_fused_experts

        return triton_fused_experts(x, gate_up_proj, down_proj, topk_weights, topk_ids)
    return torch_fused_experts(x, gate_up_proj, down_proj, topk_weights, topk_ids)


class ExpertMatrices(Protocol):
    """One projection of every expert, indexed by expert (a stacked weight, or quantized experts
    dequantizing the one asked for)."""

    def __len__(self) -> int: ...

    def __getitem__(self, expert: int) -> torch.Tensor: ...


def torch_fused_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor | ExpertMatrices,
    down_proj: torch.Tensor | ExpertMatrices,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
) -> torch.Tensor:
    """The reference for ``fused_experts``: one matmul pair per expert that received tokens
    (``linear``: ``F.linear``, or a backend's product on such a plain weight)."""
    out = torch.zeros_like(x)  # [N, H]
    flat_ids = topk_ids.flatten()  # [N * top_k]
    order = torch.argsort(flat_ids, stable=True)
    # (ids past the experts are other ranks' experts: skipped)
    counts = torch.bincount(flat_ids, minlength=len(gate_up_proj)).tolist()[: len(gate_up_proj)]
    token_of_pair = order // topk_ids.shape[1]  # [N * top_k] token of each sorted pair
    weight_of_pair = topk_weights.flatten()[order]
    start = 0
    for expert_id, count in enumerate(counts):
        if count == 0:
            continue
        tokens = token_of_pair[start : start + count]
        # (experts kept in bf16 under fp32 activations, or quantized, are widened here, one at a
        # time)
        gate_up, down = gate_up_proj[expert_id].to(x.dtype), down_proj[expert_id].to(x.dtype)
        gate, up = linear(x[tokens], gate_up).chunk(2, dim=-1)  # [n, I] each
        expert_out = linear(F.silu(gate) * up, down)  # [n, H]
        out.index_add_(0, tokens, expert_out * weight_of_pair[start : start + count, None])
        start += count
    return out


class MoEKernel(Protocol):
    """A backend's implementation of one layer's expert block (``fused_experts`` semantics)."""

    def __call__(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor: ...


class FusedMoE(nn.Module):
    """The experts of one MoE layer (routing is the caller's: it owns the router's semantics)."""

    kernel: MoEKernel | None = None
    quantization: QuantizationConfig | None = None

    _EXPERT_KEY: ClassVar[re.Pattern[str]] = re.compile(
        r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
    )
    _FUSED_KEY: ClassVar[re.Pattern[str]] = re.compile(
        r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$"
    )

    def __init__(
        self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.placement = _placement if self.tp_size > 1 else None
        """Expert parallelism's placement (None: every expert, sliced)."""
        self.expert_ids = (
            local_experts(num_experts, self.tp_rank, self.tp_size, self.placement)
            if self.placement is not None
            else list(range(num_experts))
        )  # the experts this rank holds, in their stacked order
        self.num_local_experts = len(self.expert_ids)
        self._local_index = {e: i for i, e in enumerate(self.expert_ids)}
        # Under expert parallelism: expert id -> its stacked index, ``num_local_experts`` for
        # another rank's (which the kernels skip).
        expert_map = None
        if self.placement is not None:
            expert_map = torch.full((num_experts,), self.num_local_experts, dtype=torch.int64)
            expert_map[self.expert_ids] = torch.arange(self.num_local_experts)
        self.expert_map: torch.Tensor | None
        self.register_buffer("expert_map", expert_map, persistent=False)
        self.intermediate_size_per_partition = (
            intermediate_size if self.placement else divide(intermediate_size, self.tp_size)
        )
        local = self.intermediate_size_per_partition
        self.shard_start = 0 if self.placement else self.tp_rank * local
        """Where this rank's slice of an expert's intermediate dimension starts."""
        self.gate_up_proj = nn.Parameter(
            torch.empty(self.num_local_experts, 2 * local, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, local))
        experts = range(num_experts)  # (another rank's experts are skipped by the loader)
        set_weight_loader(
            self.gate_up_proj,
            self.weight_loader,
            {(e, s) for e in experts for s in ("gate_proj", "up_proj")},
        )
        set_weight_loader(self.down_proj, self.weight_loader, {(e, "down_proj") for e in experts})

    @classmethod
    def split_fused_experts(
        cls,
        weights: Iterable[tuple[str, LoadedWeight]],
        hidden_size: int,
        intermediate_size: int,
    ) -> Iterator[tuple[str, LoadedWeight]]:
        """Per-expert keys (what ``route_expert_weight`` reads) for checkpoints that store each
        projection of all experts as one tensor (Qwen3-VL-MoE): ``...experts.gate_up_proj``
        ``[E, 2I, H]`` and ``...experts.down_proj`` ``[E, H, I]`` as transformers keeps them,
        or transposed in the last two dims as the hub's checkpoints store them. As transformers
        decides, a tensor is transposed exactly when its shape is not the first form."""
        for name, loaded in weights:
            match = cls._FUSED_KEY.match(name)
            if match is None:
                yield name, loaded
                continue
            gate_up = match["proj"] == "gate_up_proj"
            expected = (2 * intermediate_size, hidden_size) if gate_up else (
                hidden_size, intermediate_size
            )  # fmt: skip
            tensor = materialize(loaded)
            if tensor.dim() == 3 and tuple(tensor.shape[1:]) != expected:
                tensor = tensor.transpose(1, 2)
            if tensor.dim() != 3 or tuple(tensor.shape[1:]) != expected:
                raise ValueError(
                    f"Cannot load checkpoint tensor {name!r}: shape {tuple(loaded.shape)}, "
                    f"expected [num_experts, {expected[0]}, {expected[1]}] or its last two dims "
                    "swapped."
                )
            prefix = match["prefix"]
            for e, rows in enumerate(tensor):
                if gate_up:
                    yield f"{prefix}.{e}.gate_proj.weight", rows[:intermediate_size]
                    yield f"{prefix}.{e}.up_proj.weight", rows[intermediate_size:]
                else:
                    yield f"{prefix}.{e}.down_proj.weight", rows

    @classmethod
    def route_expert_weight(cls, name: str) -> WeightRoute | None:
        """``...experts.3.up_proj.weight`` -> ``(...experts.gate_up_proj, (3, "up_proj"))``."""
        match = cls._EXPERT_KEY.match(name)
        if match is None:
            return None
        proj = match["proj"]
        param = "down_proj" if proj == "down_proj" else "gate_up_proj"
        return f"{match['prefix']}.{param}", (int(match["expert"]), proj)

    def expert_shape(self, proj: str) -> tuple[int, int]:
        """A checkpoint matrix's shape: gate/up ``[I, H]``, down ``[H, I]``."""
        if proj == "down_proj":
            return self.hidden_size, self.intermediate_size
        return self.intermediate_size, self.hidden_size

    def weight_loader(
        self, param: nn.Parameter, loaded: LoadedWeight, expert_id: int, proj: str
    ) -> None:
        local = self.intermediate_size_per_partition
        # This rank keeps slice tp_rank of I.
        shard_dim = 1 if proj == "down_proj" else 0
        expected = self.expert_shape(proj)
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"Shape mismatch for expert {expert_id} {proj}: expected {expected}, "
                f"got {tuple(loaded.shape)}."
            )
        if (index := self.local_expert(expert_id)) is None:
            return  # another rank's expert
        target = param.data[index]
        if proj != "down_proj":
            target = target.narrow(0, 0 if proj == "gate_proj" else local, local)
        copy_weight(target, loaded, shard_dim, self.shard_start)

    def local_expert(self, expert_id: int) -> int | None:
        """The stacked index of expert ``expert_id`` here; None where another rank holds it."""
        return self._local_index.get(expert_id)

    def warm_up(self) -> None:
        """Compile the Triton kernel's variants before serving, where it is the one that runs."""
        if not self.gate_up_proj.is_cuda:
            return
        if self.kernel is None:
            from omniserve.layers.triton_fused_moe import warm_up

            warm_up(self.gate_up_proj, self.down_proj, self.top_k, self.gate_up_proj.dtype)
        elif (warm_kernel := getattr(self.kernel, "warm_up", None)) is not None:
            warm_kernel()

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        if self.expert_map is not None:  # this rank's experts; the others' ids past them
            topk_ids = self.expert_map[topk_ids]
        if self.kernel is not None:
            out = self.kernel(x, topk_weights, topk_ids)
        else:
            out = fused_experts(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)
        return tp_all_reduce(out) if self.tp_size > 1 else out
