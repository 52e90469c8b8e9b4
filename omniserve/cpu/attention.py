"""Paged attention for CPUs: the torch backend with decodes in C (``csrc/paged_decode.c``).

The torch path gathers every decode's keys and values into a padded copy and runs SDPA over it,
so each key is read twice and written once per layer. The kernel walks each request's block table
and reads every key and value once, scoring the query heads that share a KV head together; fp32
and bf16 caches, and fp8 ones (e4m3, e5m2) under an fp32 or bf16 query (fp32 softmax and sums).
Prefill chunks stay on SDPA.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from omniserve.attention.torch_backend import TorchAttentionBackend
from omniserve.cpu.build import KERNEL_DTYPES, load_function

_ERRORS = {-1: "a block id outside the KV cache", -2: "an allocation failure"}
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURE = (
    (_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _PTR)
    + (_I64,) * 6
    + (ctypes.c_float, ctypes.c_float, _I64, ctypes.c_int)
)


_FP8_CACHES = {torch.float8_e4m3fn: "_e4m3", torch.float8_e5m2: "_e5m2"}


def _kernel(dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> Any:
    """The instance for a ``dtype`` query and output over a ``cache_dtype`` cache (None: the
    same), or None."""
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    suffix = KERNEL_DTYPES.get(dtype)
    cache = "" if cache_dtype == dtype else _FP8_CACHES.get(cache_dtype)
    if suffix is None or cache is None:
        return None
    name = f"omniserve_paged_decode_{suffix}{cache}"
    return load_function("paged_decode.c", name, _SIGNATURE, ctypes.c_int)


def kernel_available(
    dtype: torch.dtype = torch.float32, cache_dtype: torch.dtype | None = None
) -> bool:
    """True when the C decode kernel is built for ``dtype`` (over ``cache_dtype``) here."""
    return _kernel(dtype, cache_dtype) is not None


class CpuAttentionBackend(TorchAttentionBackend):
    """SDPA for prefill chunks, the C kernel for decodes."""

    name = "cpu"

    def decode_kernel_supports(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """CPU, an fp32 or bf16 query over a cache of its type or fp8, head rows contiguous,
        head size a multiple of 16."""
        return (
            query.device.type == "cpu"
            and query.shape[2] % 16 == 0
            and kv_cache.is_contiguous()
            and query.stride(2) == 1
            and query.stride(1) == query.shape[2]
            and kernel_available(query.dtype, kv_cache.dtype)
        )

    def decode_kernel(
        self,
        query: torch.Tensor,
        out: torch.Tensor,
        token_rows: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        scale: float,
        sliding_window: int | None,
        value_scale: float = 1.0,
    ) -> None:
        _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
        status = _kernel(query.dtype, kv_cache.dtype)(
            query.data_ptr(), query.stride(0), out.data_ptr(), out.stride(0),
            token_rows.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
            block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(),
            token_rows.shape[0], query.shape[1], num_kv_heads, head_size, block_size, num_blocks,
            scale, value_scale, sliding_window or 0, torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise RuntimeError(f"CPU paged-decode kernel failed: {_ERRORS.get(status, status)}.")
