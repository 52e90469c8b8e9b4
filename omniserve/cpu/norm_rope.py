"""RMSNorm, and per-head q/k RMSNorm + rotary embedding, in one pass each (``csrc/norm_rope.c``).

In torch these are five to ten elementwise passes over every row of a prefill; the kernels read
each row once and write it once, rounding where transformers' ops round (so outputs equal
torch's but for the order of the norm's sum of squares). fp32 RMSNorm stays on torch's own fused
``F.rms_norm``; bf16 has none.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from omniserve.cpu.build import inference_tensors, load_function, load_typed
from omniserve.layers.layernorm import RMSNorm, rms_norm
from omniserve.layers.rotary_embedding import rotate_qk

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURE = (_PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, ctypes.c_float)
_SIGNATURE += (_PTR, _PTR, _I64, _I64, ctypes.c_int)


_RMS_SIGNATURE = (_PTR, _I64, _I64, _I64, _PTR, ctypes.c_float, _PTR, ctypes.c_int)


def _kernel(dtype: torch.dtype, angles: torch.dtype) -> Any:
    """The kernel for q/k of ``dtype`` rotated by angles of ``angles``: the same dtype, or fp32
    for bf16 (the vision towers' rotation, computed in fp32)."""
    if angles == dtype:
        return load_typed("norm_rope.c", "omniserve_qk_norm_rope", dtype, _SIGNATURE, None)
    if (dtype, angles) == (torch.bfloat16, torch.float32):
        return load_function("norm_rope.c", "omniserve_qk_norm_rope_bf16_f32", _SIGNATURE, None)
    return None


def _rms_kernel() -> Any:
    return load_function("norm_rope.c", "omniserve_rms_norm_bf16", _RMS_SIGNATURE, None)


class CpuRMSNorm:
    """A bf16 ``RMSNorm`` layer in one pass; other inputs take the torch reference."""

    def __init__(self, layer: RMSNorm) -> None:
        self.layer = layer

    @staticmethod
    def supports(layer: RMSNorm) -> bool:
        return layer.weight.dtype == torch.bfloat16 and _rms_kernel() is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight, eps = self.layer.weight, self.layer.variance_epsilon
        rows = x.reshape(-1, x.shape[-1]) if x.dim() else x
        usable = (
            x.dtype == torch.bfloat16
            and x.dim() >= 1
            and inference_tensors(x, weight)
            and rows.stride(-1) == 1
            and rows.shape[0] > 0
        )
        if not usable:
            return rms_norm(x, weight, eps)
        out = torch.empty(x.shape, dtype=x.dtype)
        _rms_kernel()(
            rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), weight.data_ptr(), eps,
            out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return out


def _heads_in_rows(x: torch.Tensor) -> bool:
    """``[tokens, heads, head_size]`` with contiguous head rows (a view of a qkv output is)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: RMSNorm | None,
    k_norm: RMSNorm | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotate_qk`` in one pass where the kernel applies (writes into q and k, returns them)."""
    kernel = _kernel(q.dtype, cos.dtype)
    norms = [n.weight for n in (q_norm, k_norm) if n is not None]
    usable = (
        kernel is not None
        and (q_norm is None) == (k_norm is None)
        and all(t.dtype == q.dtype for t in (k, *norms))
        and sin.dtype == cos.dtype
        and inference_tensors(q, k, cos, sin, *norms)
        and _heads_in_rows(q)
        and _heads_in_rows(k)
        and cos.is_contiguous()
        and sin.is_contiguous()
        and q.shape[0] > 0
    )
    if not usable:
        return rotate_qk(q, k, cos, sin, q_norm, k_norm)
    kernel(
        q.data_ptr(), q.stride(0), q.shape[1], k.data_ptr(), k.stride(0), k.shape[1], q.shape[0],
        q.shape[2], None if q_norm is None else q_norm.weight.data_ptr(),
        None if k_norm is None else k_norm.weight.data_ptr(),
        0.0 if q_norm is None else q_norm.variance_epsilon, cos.data_ptr(), sin.data_ptr(),
        cos.stride(0), cos.shape[1], torch.get_num_threads(),
    )  # fmt: skip
    return q, k
