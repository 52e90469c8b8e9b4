"""The attention-backend contract: write one step's keys/values into the paged cache, then attend.

Paged KV layout (one tensor per attention layer, allocated by the model runner):
``kv_cache[2, num_blocks, block_size, num_kv_heads, head_size]``; index 0 holds keys, 1 values.
Token ``t`` of a request lives in slot ``block_table[req][t // block_size] * block_size +
t % block_size``; the runner precomputes the slots of the new tokens as ``slot_mapping``.

The cache is in the model's dtype, or in an fp8 format (``--kv-cache-dtype fp8``): keys and
values are divided by the layer's scales (``kv_scales``: a checkpoint's calibrated ones, else
vLLM's 1) and rounded to it as they are stored (saturating at its largest value), and widened
exactly and multiplied back as they are read (folded into the softmax scale and the output), the
products then run as for the model's dtype.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from omniserve.attention.metadata import AttentionMetadata

FP8_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                 "fp8_e5m2": torch.float8_e5m2}  # fmt: skip


def kv_cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for ``CacheConfig.cache_dtype``."""
    return FP8_KV_DTYPES.get(cache_dtype, model_dtype)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def to_fp8(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x / scale`` rounded to the fp8 ``dtype``, saturating (e5m2 would round past its largest
    value to infinity)."""
    limit = torch.finfo(dtype).max
    if scale != 1.0:
        x = x.float() / scale
    return x.clamp(-limit, limit).to(dtype)


def fp8_scales(kv_cache: torch.Tensor, kv_scales: tuple[float, float]) -> tuple[float, float]:
    """The (key, value) scales a cache's reads and writes apply: an fp8 cache's, else none."""
    return kv_scales if is_fp8(kv_cache.dtype) else (1.0, 1.0)


class AttentionBackend(ABC):
    """Computes causal attention for a flattened batch of prefill chunks and decodes."""

    name: ClassVar[str]
    supports_cuda_graphs: ClassVar[bool] = False
    """Whether a forward depends on the metadata's device tensors alone (nothing planned on the
    host from per-step values), so a decode step can be captured once and replayed."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        """Store ``key``/``value`` at ``metadata.slot_mapping``, then attend; ``kv_scales``
        (key, value) apply to an fp8 cache alone.

        query ``[num_tokens, num_heads, head_size]``, key/value ``[num_tokens, num_kv_heads,
        head_size]`` -> ``[num_tokens, num_heads, head_size]``. Query token i of a request with
        query length q and sequence length s sits at absolute position ``s - q + i`` and sees keys
        ``[max(0, pos - sliding_window + 1), pos]`` (all of ``[0, pos]`` without a window).
        Query head h reads KV head ``h // (num_heads // num_kv_heads)`` (grouped-query attention).
        """
