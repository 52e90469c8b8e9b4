"""Triton kernels for the elementwise work between a decoder layer's GEMMs on CUDA: RMSNorm (with
the residual add before it fused in), per-head q/k RMSNorm + RoPE in place, and SiLU-and-mul.

In torch each of these is a chain of one-kernel ops (RMSNorm alone is seven: cast, square, mean,
add, rsqrt, multiply, cast and scale), and in a decode step it is their launches, not their bytes,
that cost: on an H200 a 3B thinker's step ran ~30 of them per layer beside 5 GEMMs. Each kernel
here reads its rows once and writes them once, and rounds to the activation dtype exactly where
transformers' modules do, so outputs equal the torch path's but for the order of a norm's sum of
squares. Called with CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omniserve.layers.layernorm import RMSNorm

_SILU_BLOCK = 1024
"""Columns of one SiLU-and-mul program."""


@triton.jit
def _rms_norm_kernel(  # type: ignore[no-untyped-def]
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr,
    stride_x, stride_r, stride_o, stride_s, n, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (row): ``out = weight * cast(x * rsqrt(mean(x^2) + eps))``, with x first replaced
    by ``cast(x + residual)`` (also stored to ``sum``) when HAS_RESIDUAL."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / n
    normed = (xf * tl.math.rsqrt(variance + eps)).to(dtype)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols,
             (w.to(tl.float32) * normed.to(tl.float32)).to(dtype), mask=mask)  # fmt: skip


@triton.jit
def _silu_and_mul_kernel(  # type: ignore[no-untyped-def]
    x_ptr, out_ptr, d, stride_x, stride_o, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (row, column block): ``out = cast(silu(gate)) * up`` of ``x = [gate | up]``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    tl.store(out_ptr + row * stride_o + cols, (silu.to(tl.float32) * up).to(dtype), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_weight_ptr, k_weight_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
    num_q_heads, head_size, half, eps,
    HAS_NORM: tl.constexpr, HEAD_PAD: tl.constexpr, ROUND_PRODUCTS: tl.constexpr,
):  # fmt: skip
    """Program (token, head): one query head (head < num_q_heads) or key head, normalised when
    HAS_NORM, then its first ``2 * half`` features rotated (neox layout), in place; each product
    rounded to the element type when ROUND_PRODUCTS (angles in that type), else the rotation in
    fp32 rounded once (fp32 angles: the vision towers').

    The head is read whole, with each feature's rotation partner (i +- half) read beside it, so
    the program writes only after it has read everything it needs. q and k are selected by
    masks, not branches."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    is_q = head < num_q_heads
    is_k = head >= num_q_heads
    dtype = q_ptr.dtype.element_ty
    e = tl.arange(0, HEAD_PAD)
    in_head = e < head_size
    rotated = e < 2 * half
    first = e < half
    partner = tl.where(first, e + half, e - half)
    q_base = q_ptr + token * stride_qt + head * stride_qh
    k_base = k_ptr + token * stride_kt + (head - num_q_heads) * stride_kh
    x = tl.where(is_q, tl.load(q_base + e, mask=in_head & is_q, other=0.0),
                 tl.load(k_base + e, mask=in_head & is_k, other=0.0))  # fmt: skip
    xp = tl.where(is_q, tl.load(q_base + partner, mask=rotated & is_q, other=0.0),
                  tl.load(k_base + partner, mask=rotated & is_k, other=0.0))  # fmt: skip
    if HAS_NORM:
        xf = x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / head_size + eps)
        w = tl.where(is_q, tl.load(q_weight_ptr + e, mask=in_head & is_q, other=0.0),
                     tl.load(k_weight_ptr + e, mask=in_head & is_k, other=0.0))  # fmt: skip
        wp = tl.where(is_q, tl.load(q_weight_ptr + partner, mask=rotated & is_q, other=0.0),
                      tl.load(k_weight_ptr + partner, mask=rotated & is_k,
                              other=0.0))  # fmt: skip
        x = (w.to(tl.float32) * (xf * rstd).to(dtype).to(tl.float32)).to(dtype)
        xp = (wp.to(tl.float32) * (xp.to(tl.float32) * rstd).to(dtype).to(tl.float32)).to(dtype)
    angle = tl.where(first, e, e - half)
    c = tl.load(cos_ptr + token * stride_ct + angle, mask=rotated, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + token * stride_st + angle, mask=rotated, other=0.0).to(tl.float32)
    # x1 * c - x2 * s and x2 * c + x1 * s, each product rounded as torch rounds it
    xc = x.to(tl.float32) * c
    ps = xp.to(tl.float32) * s
    if ROUND_PRODUCTS:
        xc = xc.to(dtype).to(tl.float32)
        ps = ps.to(dtype).to(tl.float32)
    out = tl.where(rotated, tl.where(first, xc - ps, xc + ps).to(dtype), x)
    tl.store(q_base + e, out, mask=in_head & is_q)
    tl.store(k_base + e, out, mask=in_head & is_k)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as ``[rows, last dim]`` with a unit last stride (a view where it can be)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, RMSNorm(s))`` for ``s = x + residual`` (or ``s = x`` without a residual)."""
    rows = _rows(x)
    n = rows.shape[1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out) if residual is not None else out
    res_rows = _rows(residual) if residual is not None else rows
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, res_rows, weight, out, summed, rows.stride(0), res_rows.stride(0), n, n, n,
            eps, HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n),
        )  # fmt: skip
    return (summed if residual is not None else x), out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for x of width 2d."""
    rows = _rows(x)
    d = rows.shape[1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        grid = (rows.shape[0], triton.cdiv(d, _SILU_BLOCK))
        _silu_and_mul_kernel[grid](rows, out, d, rows.stride(0), d, BLOCK=_SILU_BLOCK)
    return out


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: RMSNorm | None,
    k_norm: RMSNorm | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``QKRotary``'s kernel: q ``[tokens, heads, head_size]`` and k ``[tokens, kv_heads,
    head_size]`` (views of a fresh QKV projection) normalised per head by the layer's norms when
    it has them (with q's epsilon: both take the config's), then rotated by ``cos``/``sin``
    ``[tokens, rotary_dim]`` (q's dtype, or fp32: ``rotate_qk`` says how each rounds); written in
    place and returned."""
    num_tokens, num_q_heads, head_size = q.shape
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("qk_norm_rope needs a unit stride over each head's features.")
    cos, sin = _rows(cos), _rows(sin)
    norms = (q_norm, k_norm) if q_norm is not None and k_norm is not None else None
    q_weight, k_weight = (norms[0].weight, norms[1].weight) if norms else (q, k)
    if num_tokens:
        _qk_norm_rope_kernel[(num_tokens, num_q_heads + k.shape[1])](
            q, k, cos, sin, q_weight, k_weight,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
            num_q_heads, head_size, cos.shape[1] // 2,
            norms[0].variance_epsilon if norms else 0.0,
            HAS_NORM=norms is not None, HEAD_PAD=triton.next_power_of_2(head_size),
            ROUND_PRODUCTS=cos.dtype == q.dtype,
        )  # fmt: skip
    return q, k
