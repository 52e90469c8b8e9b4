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
_SIGNATURE = (_PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, ctypes.c_float,
              _PTR, _PTR, _I64, _I64, ctypes.c_int)  # fmt: skip


_RMS_SIGNATURE = (_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, ctypes.c_float, _PTR, _PTR,
                  ctypes.c_int)  # fmt: skip


FUSED_ADD_MIN_ROWS = 8
"""From this many rows the residual add runs in the norm's pass; below, torch's add of a decode
step's few rows costs less than checking the second input for the kernel (about 3 us a call,
two calls a layer)."""


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
    """A bf16 ``RMSNorm`` layer in one pass, and with the residual add before it in the same
    pass (``add``); other inputs take the torch reference. Lean on the host: a decode step
    calls it twice per layer."""

    def __init__(self, layer: RMSNorm) -> None:
        self.layer = layer
        self.cols = layer.weight.shape[0]

    @staticmethod
    def supports(layer: RMSNorm) -> bool:
        return layer.weight.dtype == torch.bfloat16 and _rms_kernel() is not None

    def _row_stride(self, rows: torch.Tensor) -> int:
        """How far apart the rows of ``rows`` (1-D or 2-D) lie where the kernel can read them in
        place (0: it cannot, or there are none, or autograd records them)."""
        if (
            rows.dtype != torch.bfloat16
            or rows.dim() not in (1, 2)
            or rows.shape[-1] != self.cols
            or rows.stride(-1) != 1
            or rows.numel() == 0
            or not inference_tensors(rows, self.layer.weight)
        ):
            return 0
        return self.cols if rows.dim() == 1 else rows.stride(0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]) if x.dim() > 2 else x
        stride = self._row_stride(rows)
        if not stride:
            return rms_norm(x, self.layer.weight, self.layer.variance_epsilon)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        self._run(rows, stride, 0, 0, 0, out.data_ptr())
        return out

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(residual + x, norm(residual + x))``, the sum rounded to bf16 as torch's add
        rounds it, in one pass (from ``FUSED_ADD_MIN_ROWS`` rows of 2-D inputs: a decoder's)."""
        few = x.numel() < FUSED_ADD_MIN_ROWS * self.cols
        stride = 0 if few or x.shape != residual.shape else self._row_stride(x)
        res_stride = self._row_stride(residual) if stride else 0
        if not res_stride:
            summed = residual + x
            return summed, self(summed)
        summed = torch.empty_like(residual, memory_format=torch.contiguous_format)
        out = torch.empty_like(summed)
        self._run(x, stride, residual.data_ptr(), res_stride, summed.data_ptr(), out.data_ptr())
        return summed, out

    def _run(
        self, x: torch.Tensor, stride: int, residual: int, res_stride: int, summed: int, out: int
    ) -> None:
        _rms_kernel()(
            x.data_ptr(), x.numel() // self.cols, self.cols, stride, residual or None, res_stride,
            self.layer.weight.data_ptr(), self.layer.variance_epsilon, summed or None, out,
            torch.get_num_threads(),
        )  # fmt: skip


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
