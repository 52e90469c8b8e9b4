"""SwiGLU's ``silu(gate) * up`` (``csrc/silu_mul.c``) and GELU (``csrc/gelu.c``), one pass each
for bf16 prefills.

torch makes two passes over a ``[tokens, intermediate]`` activation and writes one between them;
once those no longer stay in cache it takes 3.3x the kernel's time (540 rows of 8,960 on 2 cores:
8.4 ms against 2.5; 4,096 rows: 56 against 42). Below ``MIN_ELEMENTS`` (decode batches) torch's
two passes are as fast or faster (128 rows: 0.60 ms against 0.65), so they keep them. fp32 stays
on torch (its outputs are transformers' to the bit there; the kernel's exp differs from torch's
by an ulp, which bf16's rounding hides).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from omniserve.cpu.build import inference_tensors, load_function
from omniserve.layers.activation import gelu, silu_and_mul

MIN_ELEMENTS = 1 << 21
"""Outputs at least this large take the kernel (measured crossover: 128 to 256 rows of 8,960)."""
GELU_MIN_ELEMENTS = 1 << 15
"""GELU inputs at least this large take its kernel (8 rows of 5,120: 0.022 ms against torch's
0.057)."""

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURE = (_PTR, _I64, _I64, _I64, _PTR, _I64, ctypes.c_int)


def _kernel() -> Any:
    return load_function("silu_mul.c", "omniserve_silu_and_mul_bf16", _SIGNATURE, None)


def cpu_silu_and_mul_available() -> bool:
    """Whether the kernel is built (it is not with ``OMNISERVE_CPU_KERNELS=torch``)."""
    return _kernel() is not None


def cpu_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``SiluAndMul``'s kernel: large bf16 inputs in one pass, others on the torch reference."""
    if (x.dtype != torch.bfloat16 or x.dim() == 0 or x.shape[-1] % 2
            or x.numel() < 2 * MIN_ELEMENTS or not inference_tensors(x)):  # fmt: skip
        return silu_and_mul(x)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype)
    _kernel()(rows.data_ptr(), rows.shape[0], d, rows.stride(0), out.data_ptr(), d,
              torch.get_num_threads())  # fmt: skip
    return out


def _gelu_kernel() -> Any:
    return load_function("gelu.c", "omniserve_gelu_tanh_bf16", (_PTR, _I64, _PTR, ctypes.c_int),
                         None)  # fmt: skip


def cpu_gelu_available() -> bool:
    return _gelu_kernel() is not None


def cpu_gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """``GELU``'s kernel for the tanh form: bf16 inputs from ``GELU_MIN_ELEMENTS`` in one pass
    (torch's takes 2.1-2.6x as long: 4.3 ms against 2.1 on a Qwen3-VL vision MLP's
    ``[784, 4304]``, 0.17 against 0.07 on 32 rows); the rest, and the erf form (torch's is as
    fast), on torch."""
    if (approximate != "tanh" or x.dtype != torch.bfloat16 or x.numel() < GELU_MIN_ELEMENTS
            or not inference_tensors(x)):  # fmt: skip
        return gelu(x, approximate)
    x = x.contiguous()
    out = torch.empty_like(x)
    _gelu_kernel()(x.data_ptr(), x.numel(), out.data_ptr(), torch.get_num_threads())
    return out
