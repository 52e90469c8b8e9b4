"""Triton fused MoE for CUDA: token-expert pairs sorted by expert, then two grouped GEMMs.

The torch reference (``fused_moe.torch_fused_experts``) loops over experts in Python; on a GPU that
is one pair of tiny launches per active expert. Here the whole layer is two kernel launches plus a
few sync-free torch ops:

1. ``align_pairs_by_expert``: the ``N * top_k`` token-expert pairs are grouped by expert and each
   expert's segment is padded to a multiple of ``BLOCK_M``, so every ``BLOCK_M`` rows of the
   sorted order belong to one expert. The grid is sized by an upper bound on the block count
   rather than the exact count, so nothing waits on the device (no ``.item()``).
2. ``_grouped_gemm_kernel`` with the stacked ``gate_up_proj [E, 2I, H]``: each program gathers its
   pairs' token rows of ``x``, multiplies by its expert's gate and up tiles (two fp32 accumulators)
   and writes ``silu(gate) * up`` per pair -> ``[P, I]``; the SiLU-and-mul never leaves registers.
3. The same kernel with ``down_proj [E, H, I]`` over those activations, scaling each row by its
   routing weight in the epilogue -> ``[P, H]`` in fp32.
4. A sum over ``top_k`` folds pairs back to tokens (deterministic, unlike atomic adds).

Inputs may be fp32, bf16 or fp16; dot products accumulate in fp32, and fp32 inputs use IEEE
(not TF32) dots so results match torch's default matmul. Quantized experts (a stacked
4-bit or FP8 layout ``quantized_loading.quantize_experts`` keeps) are decoded tile by tile in the
kernel, each weight ``(code - zero) * scale`` or ``e4m3 * scale`` in fp32 rounded once to the
activations' dtype, as the torch reference dequantizes them.
"""

from __future__ import annotations

from typing import NamedTuple, TypeAlias

import torch
import triton
import triton.language as tl

from omniserve.layers.quantization import QuantizedMatrix
from omniserve.triton_utils import INTERPRETED, dot

Experts: TypeAlias = torch.Tensor | QuantizedMatrix
"""A projection of every expert: stacked weights, or their codes."""


class ExpertAlignment(NamedTuple):
    """Pairs grouped by expert, each expert's segment padded to whole ``block_m`` blocks."""

    sorted_pair_ids: torch.Tensor
    """``[max_blocks * block_m]`` int32 pair ids (``token * top_k + k``); ``num_pairs`` pads."""
    block_expert_ids: torch.Tensor
    """``[max_blocks]`` int32 expert of each block; -1 for blocks past the last used one."""


def align_pairs_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> ExpertAlignment:
    """Group the pairs of ``topk_ids [N, top_k]`` by expert with torch ops that never sync.
    Pairs of id ``E`` (another rank's experts) are grouped last, in blocks of expert -1.

    The block count is bounded by ``ceil(P / block_m) + min(E + 1, P)``: each expert that
    receives ``c > 0`` pairs needs ``ceil(c / block_m) < c / block_m + 1`` blocks.
    """
    device = topk_ids.device
    flat_ids = topk_ids.flatten().long()  # [P]
    num_pairs = flat_ids.numel()
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))  # [E + 1]
    blocks_per_expert = (counts + block_m - 1) // block_m  # [E + 1]
    block_end = blocks_per_expert.cumsum(0)  # [E + 1] exclusive end block of each expert
    first_block = block_end - blocks_per_expert  # [E + 1]
    first_pair = counts.cumsum(0) - counts  # [E + 1] each expert's first position, sorted

    order = torch.argsort(flat_ids, stable=True)  # [P] pair ids sorted by expert
    sorted_experts = flat_ids[order]  # [P]
    rank_in_expert = torch.arange(num_pairs, device=device) - first_pair[sorted_experts]
    slots = first_block[sorted_experts] * block_m + rank_in_expert  # [P]

    max_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts + 1, num_pairs)
    sorted_pair_ids = torch.full(
        (max_blocks * block_m,), num_pairs, dtype=torch.int32, device=device
    )
    sorted_pair_ids[slots] = order.to(torch.int32)
    blocks = torch.arange(max_blocks, device=device)
    # Experts with no blocks share their predecessor's end, so right=True skips them.
    block_expert_ids = torch.searchsorted(block_end, blocks, right=True)  # [max_blocks]
    block_expert_ids = torch.where(block_expert_ids < num_experts, block_expert_ids, -1)
    return ExpertAlignment(sorted_pair_ids, block_expert_ids.to(torch.int32))


@triton.jit
def _weight_tile(  # type: ignore[no-untyped-def]
    w_base,
    s_base,
    z_base,
    offs_n,
    ks,
    mask,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sg,
    group_size,
    CODE_BITS: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """The ``[len(ks), len(offs_n)]`` tile of one expert's ``w.T`` in ``DTYPE``: loaded, or
    decoded from its codes (``(code - zero) * scale`` / ``e4m3 * scale`` in fp32, rounded once)."""
    if CODE_BITS == 0:
        return tl.load(w_base + offs_n[None, :] * stride_wn + ks[:, None] * stride_wk, mask=mask,
                       other=0.0)  # fmt: skip
    groups = offs_n[None, :] * stride_sn + (ks[:, None] // group_size) * stride_sg
    scale = tl.load(s_base + groups, mask=mask, other=0.0)
    if CODE_BITS == 4:
        byte = tl.load(w_base + offs_n[None, :] * stride_wn + (ks[:, None] // 2) * stride_wk,
                       mask=mask, other=0).to(tl.int32)  # fmt: skip
        code = (byte >> ((ks[:, None] % 2) * 4)) & 0xF
        zero = tl.load(z_base + groups, mask=mask, other=0).to(tl.int32)
        value = (code - zero).to(tl.float32)
    else:  # e4m3: 4 exponent bits (bias 7), 3 mantissa bits, read as bytes
        byte = tl.load(w_base + offs_n[None, :] * stride_wn + ks[:, None] * stride_wk, mask=mask,
                       other=0).to(tl.int32)  # fmt: skip
        magnitude = byte & 0x7F
        normal = ((magnitude << 20) + (120 << 23)).to(tl.float32, bitcast=True)
        subnormal = magnitude.to(tl.float32) * 0.001953125  # mantissa * 2^-9
        value = tl.where(magnitude >= 8, normal, subnormal)
        value = tl.where((byte & 0x80) != 0, -value, value)
    return (value * scale).to(DTYPE)


# The pair count changes with every step's token count: unspecialized, so that Triton compiles
# the kernel once per block shape (see ``warm_up``), not per class of the count, while serving.
@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_gemm_kernel(  # type: ignore[no-untyped-def]
    a_ptr,  # [rows, K]: tokens (gate_up pass) or pairs (down pass)
    w_ptr,  # [E, N or 2N, K]: stacked expert weights, out = a @ w[e].T
    out_ptr,  # [P, N]: one row per pair
    scale_ptr,  # quantized w: [E, N or 2N, K / group_size] fp32 scales
    zero_ptr,  # 4-bit w: zero points, as the scales
    sorted_pair_ids_ptr,
    block_expert_ids_ptr,
    topk_weights_ptr,  # [P]
    num_pairs,
    N,
    K,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    stride_se,
    stride_sn,
    stride_sg,
    group_size,
    CODE_BITS: tl.constexpr,  # 0: w holds the weights; 4 or 8: w holds 4-bit or FP8 codes
    PAIRS_PER_A_ROW: tl.constexpr,  # top_k when a holds tokens, 1 when it holds pairs
    GATED: tl.constexpr,  # w rows are [gate | up]; write silu(gate) * up
    APPLY_ROUTING_WEIGHT: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert_id = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)
    if expert_id < 0:
        return  # the grid is sized by an upper bound on the number of blocks
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair_ids = tl.load(sorted_pair_ids_ptr + offs_m)  # [BLOCK_M]
    row_valid = pair_ids < num_pairs  # padding slots hold num_pairs
    a_rows = (pair_ids // PAIRS_PER_A_ROW).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
    # [BLOCK_K, BLOCK_N] tiles of w[e].T; the up half of a gated weight starts N rows further.
    w_base = w_ptr + expert_id * stride_we
    s_base = scale_ptr + expert_id * stride_se
    z_base = zero_ptr + expert_id * stride_se
    dtype = a_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        ks = k_start + offs_k
        k_valid = ks < K
        a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        w_mask = k_valid[:, None] & n_valid[None, :]
        w = _weight_tile(w_base, s_base, z_base, offs_n, ks, w_mask, stride_wn, stride_wk,
                         stride_sn, stride_sg, group_size, CODE_BITS, dtype)  # fmt: skip
        acc = dot(a, w, acc, UPCAST_DOT, DOT_PRECISION)
        if GATED:
            up = _weight_tile(w_base + N * stride_wn, s_base + N * stride_sn,
                              z_base + N * stride_sn, offs_n, ks, w_mask, stride_wn, stride_wk,
                              stride_sn, stride_sg, group_size, CODE_BITS, dtype)  # fmt: skip
            acc_up = dot(a, up, acc_up, UPCAST_DOT, DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak

    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up  # silu(gate) * up
    if APPLY_ROUTING_WEIGHT:
        weights = tl.load(topk_weights_ptr + pair_ids, mask=row_valid, other=0.0)
        acc = acc * weights.to(tl.float32)[:, None]
    out_rows = pair_ids.to(tl.int64)
    out_ptrs = out_ptr + out_rows[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & n_valid[None, :])


def _block_size(dim: int, cap: int) -> int:
    # tl.dot needs every block dimension >= 16; small dims get one power-of-two block.
    return max(16, min(cap, triton.next_power_of_2(dim)))


_BLOCK_MS = (16, 32, 64)
"""The pair-block heights ``_block_m`` picks from: each is a compiled variant of the kernel."""


def _block_m(num_pairs: int, num_experts: int) -> int:
    """Small blocks when experts see few pairs (decode), to waste little padding."""
    pairs_per_expert = num_pairs / num_experts
    return next((m for m in _BLOCK_MS[:-1] if pairs_per_expert <= m), _BLOCK_MS[-1])


def _grouped_gemm(
    a: torch.Tensor,
    weight: Experts,
    out: torch.Tensor,
    alignment: ExpertAlignment,
    topk_weights: torch.Tensor,
    block_m: int,
    *,
    pairs_per_a_row: int,
    gated: bool,
) -> None:
    """``out[p] = f(a[p // pairs_per_a_row] @ weight[expert(p)].T)`` for every pair ``p``."""
    num_pairs, n = out.shape
    k = a.shape[1]
    block_n = _block_size(n, 64)
    block_k = _block_size(k, 64 if a.element_size() <= 2 else 32)
    grid = (alignment.block_expert_ids.numel(), triton.cdiv(n, block_n))
    if isinstance(weight, QuantizedMatrix):
        codes, scales, bits = weight.codes.view(torch.uint8), weight.scales, weight.bits
        zeros = scales if weight.zeros is None else weight.zeros  # (FP8: never read)
        group_size = k // scales.shape[2]
    else:
        codes, scales, zeros, bits, group_size = weight, weight, weight, 0, 1  # (not read)
    _grouped_gemm_kernel[grid](
        a,
        codes,
        out,
        scales,
        zeros,
        alignment.sorted_pair_ids,
        alignment.block_expert_ids,
        topk_weights,
        num_pairs,
        n,
        k,
        a.stride(0),
        a.stride(1),
        codes.stride(0),
        codes.stride(1),
        codes.stride(2),
        out.stride(0),
        out.stride(1),
        scales.stride(0),
        scales.stride(1),
        scales.stride(2),
        group_size,
        CODE_BITS=bits,
        PAIRS_PER_A_ROW=pairs_per_a_row,
        GATED=gated,
        APPLY_ROUTING_WEIGHT=not gated,
        UPCAST_DOT=INTERPRETED,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else None,  # fp32: no TF32
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )


def triton_fused_experts(
    x: torch.Tensor,
    gate_up_proj: Experts,
    down_proj: Experts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``sum_k w_k * down_e(silu(gate_e x) * up_e x)``, same contract as the torch reference.

    x ``[N, H]``; gate_up_proj ``[E, 2I, H]``; down_proj ``[E, H, I]`` (or their codes);
    topk_* ``[N, top_k]``.
    """
    block_m = _block_m(topk_ids.numel(), gate_up_proj.shape[0])
    return _fused_experts(x, gate_up_proj, down_proj, topk_weights, topk_ids, block_m)


def warm_up(gate_up_proj: Experts, down_proj: Experts, top_k: int, dtype: torch.dtype) -> None:
    """Compile the kernel for every block height ``_block_m`` can pick, about a second each, at
    start-up rather than in the first step whose token count needs it: one token per height
    (``dtype``: the activations')."""
    device = gate_up_proj.scales.device if isinstance(gate_up_proj, QuantizedMatrix) else (
        gate_up_proj.device
    )  # fmt: skip
    x = torch.zeros(1, gate_up_proj.shape[2], dtype=dtype, device=device)
    topk_ids = torch.arange(top_k, device=device).unsqueeze(0) % gate_up_proj.shape[0]
    topk_weights = torch.full((1, top_k), 1 / top_k, dtype=dtype, device=device)
    for block_m in _BLOCK_MS:
        _fused_experts(x, gate_up_proj, down_proj, topk_weights, topk_ids, block_m)


def _fused_experts(
    x: torch.Tensor,
    gate_up_proj: Experts,
    down_proj: Experts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block_m: int,
) -> torch.Tensor:
    stored = [w.dtype for w in (gate_up_proj, down_proj) if isinstance(w, torch.Tensor)]
    if any(dtype != x.dtype for dtype in stored):
        raise ValueError(f"dtype mismatch: x {x.dtype}, experts {stored}")
    num_tokens, hidden_size = x.shape
    num_experts, intermediate_size = gate_up_proj.shape[0], down_proj.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    alignment = align_pairs_by_expert(topk_ids, num_experts, block_m)
    pair_weights = topk_weights.reshape(num_pairs).contiguous()  # [P]

    act = torch.empty(num_pairs, intermediate_size, dtype=x.dtype, device=x.device)  # [P, I]
    _grouped_gemm(
        x, gate_up_proj, act, alignment, pair_weights, block_m, pairs_per_a_row=top_k, gated=True
    )
    # [P, H]; zeros: the skipped pairs' rows (another rank's experts) are never written
    pair_out = torch.zeros(num_pairs, hidden_size, dtype=torch.float32, device=x.device)
    _grouped_gemm(
        act, down_proj, pair_out, alignment, pair_weights, block_m, pairs_per_a_row=1, gated=False
    )
    return pair_out.view(num_tokens, top_k, hidden_size).sum(dim=1).to(x.dtype)  # [N, H]
