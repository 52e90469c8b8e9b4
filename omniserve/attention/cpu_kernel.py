"""Call the C paged-decode kernel (``csrc/paged_decode.c``) on CPUs.

Built and loaded by :mod:`omniserve.cpu_kernels`; without it, decoding stays on the torch path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from omniserve.cpu_kernels import load_function

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
_ERRORS = {-1: "a block id outside the KV cache", -2: "an allocation failure"}


_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURE = (
    (_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _PTR)
    + (_I64,) * 6
    + (ctypes.c_float, _I64, ctypes.c_int)
)


def _kernel() -> Any:
    return load_function(_SOURCE, "omniserve_paged_decode_f32", _SIGNATURE, ctypes.c_int)


def kernel_available() -> bool:
    """True when decode attention on CPU fp32 tensors can use the C kernel."""
    return _kernel() is not None


def supports(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """The kernel's domain: CPU, fp32, head rows contiguous, head size a multiple of 16."""
    return (
        query.device.type == "cpu"
        and query.shape[2] % 16 == 0
        and query.dtype == torch.float32
        and kv_cache.dtype == torch.float32
        and kv_cache.is_contiguous()
        and query.stride(2) == 1
        and query.stride(1) == query.shape[2]
        and kernel_available()
    )


def paged_decode(
    query: torch.Tensor,
    out: torch.Tensor,
    token_rows: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None,
) -> None:
    """Write attention for the decode tokens at ``token_rows`` of ``query`` into ``out``.

    query/out ``[num_tokens, num_heads, head_size]``; token_rows ``[n]`` int64; block_table
    ``[n, max_blocks]`` int32 and seq_lens ``[n]`` int32 (contiguous) for the same n requests;
    kv_cache ``[2, num_blocks, block_size, num_kv_heads, head_size]``.
    """
    kernel = _kernel()
    assert kernel is not None, "paged_decode called without the kernel; check supports()"
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    num_heads = query.shape[1]
    status = kernel(
        query.data_ptr(),
        query.stride(0),
        out.data_ptr(),
        out.stride(0),
        token_rows.data_ptr(),
        kv_cache[0].data_ptr(),
        kv_cache[1].data_ptr(),
        block_table.data_ptr(),
        block_table.stride(0),
        seq_lens.data_ptr(),
        token_rows.shape[0],
        num_heads,
        num_kv_heads,
        head_size,
        block_size,
        num_blocks,
        scale,
        sliding_window or 0,
        torch.get_num_threads(),
    )
    if status:
        raise RuntimeError(f"CPU paged-decode kernel failed: {_ERRORS.get(status, status)}.")
