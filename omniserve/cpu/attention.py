"""Paged attention for CPUs: the torch backend with decodes in C (``csrc/paged_decode.c``).

The torch path gathers every decode's keys and values into a padded copy and runs SDPA over it,
so each key is read twice and written once per layer. The kernel walks each request's block table
and reads every key and value once, scoring the query heads that share a KV head together; fp32
and bf16 caches (fp32 softmax and sums). Prefill chunks stay on SDPA.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from omniserve.attention.torch_backend import TorchAttentionBackend
from omniserve.cpu.build import KERNEL_DTYPES, load_typed

_ERRORS = {-1: "a block id outside the KV cache", -2: "an allocation failure"}
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURE = (
    (_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _PTR)
    + (_I64,) * 6
    + (ctypes.c_float, _I64, ctypes.c_int)
)


def _kernel(dtype: torch.dtype) -> Any:
    return load_typed("paged_decode.c", "omniserve_paged_decode", dtype, _SIGNATURE, ctypes.c_int)


def kernel_available(dtype: torch.dtype = torch.float32) -> bool:
    """True when the C decode kernel is built for ``dtype`` on this machine."""
    return _kernel(dtype) is not None


class CpuAttentionBackend(TorchAttentionBackend):
    """SDPA for prefill chunks, the C kernel for decodes."""

    name = "cpu"

    def decode_kernel_supports(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """CPU, one element type for query and cache, head rows contiguous, head size a
        multiple of 16."""
        return (
            query.device.type == "cpu"
            and query.dtype == kv_cache.dtype
            and query.dtype in KERNEL_DTYPES
            and query.shape[2] % 16 == 0
            and kv_cache.is_contiguous()
            and query.stride(2) == 1
            and query.stride(1) == query.shape[2]
            and kernel_available(query.dtype)
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
    ) -> None:
        _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
        status = _kernel(query.dtype)(
            query.data_ptr(), query.stride(0), out.data_ptr(), out.stride(0),
            token_rows.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
            block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(),
            token_rows.shape[0], query.shape[1], num_kv_heads, head_size, block_size, num_blocks,
            scale, sliding_window or 0, torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise RuntimeError(f"CPU paged-decode kernel failed: {_ERRORS.get(status, status)}.")
