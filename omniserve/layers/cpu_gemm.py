"""Small-batch linear layers and MoE expert blocks on CPUs, through ``csrc/cpu_gemm.c``.

Decode steps multiply a few rows by every weight, which BLAS does at a fraction of the memory
bandwidth; the C kernels stream each weight row once for all rows (about 2x faster up to 8 rows).
From ``MAX_LINEAR_ROWS`` rows on, BLAS's blocking wins and ``F.linear`` runs. The MoE kernel does
a layer's whole expert block in one call (no per-expert torch ops); a prefill's thousands of rows
stay on the torch reference. Both sum in a different order from BLAS: outputs agree to float
rounding (relative ~1e-6), not bit for bit, and do not depend on the other rows of the batch.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from omniserve.cpu_kernels import load_library

_SOURCE = Path(__file__).with_name("csrc") / "cpu_gemm.c"
MAX_LINEAR_ROWS = 32
"""Rows up to which the linear kernel runs (measured: it beats MKL up to 32, ties at 64)."""
MAX_MOE_TOKENS = 64
"""Tokens up to which the MoE kernel runs (a decode batch; each expert sees a share of them)."""


@functools.cache
def _load() -> ctypes.CDLL | None:
    library = load_library(_SOURCE)
    if library is None:
        return None
    i64, ptr, threads = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    library.omniserve_linear_f32.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, threads]
    library.omniserve_linear_f32.restype = ctypes.c_int
    library.omniserve_moe_f32.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ptr, ptr, i64, ptr]
    library.omniserve_moe_f32.argtypes += [threads]
    library.omniserve_moe_f32.restype = ctypes.c_int
    return library


def _plain_fp32(*tensors: torch.Tensor) -> bool:
    """CPU fp32 tensors with no autograd to record: the kernels' domain."""
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; a few CPU fp32 rows go through the C kernel."""
    in_features = weight.shape[-1]
    rows = x.numel() // in_features if in_features else 0
    operands = (x, weight) if bias is None else (x, weight, bias)
    if not 0 < rows <= MAX_LINEAR_ROWS or not _plain_fp32(*operands):
        return F.linear(x, weight, bias)
    library = _load()
    if library is None or not weight.is_contiguous() or (bias is not None and bias.stride(0) != 1):
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, in_features)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(rows, weight.shape[0], dtype=x.dtype)
    library.omniserve_linear_f32(
        x2.data_ptr(),
        x2.stride(0),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        rows,
        weight.shape[0],
        in_features,
        torch.get_num_threads(),
    )
    return out.view(*x.shape[:-1], weight.shape[0])


def moe_supported(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> bool:
    """Whether ``moe`` takes this call: a decode-sized CPU fp32 batch, the kernel built."""
    return (
        0 < x.shape[0] <= MAX_MOE_TOKENS
        and _plain_fp32(x, gate_up_proj, down_proj)
        and gate_up_proj.is_contiguous()
        and down_proj.is_contiguous()
        and _load() is not None
    )


def moe(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The expert block of ``fused_moe.fused_experts`` in one C call (check ``moe_supported``)."""
    library = _load()
    assert library is not None, "moe called without the kernel; check moe_supported()"
    x = x.contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    out = torch.empty_like(x)
    num_experts, _, hidden = gate_up_proj.shape
    status = library.omniserve_moe_f32(
        x.data_ptr(),
        x.shape[0],
        hidden,
        gate_up_proj.data_ptr(),
        down_proj.data_ptr(),
        num_experts,
        down_proj.shape[2],
        weights.data_ptr(),
        ids.data_ptr(),
        ids.shape[1],
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status == -1:
        raise ValueError(f"MoE expert ids must lie in [0, {num_experts}).")
    if status:
        raise MemoryError("The CPU MoE kernel could not allocate its scratch buffers.")
    return out
