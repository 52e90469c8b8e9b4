"""Attention: the one layer that touches the paged KV cache.

Models compute q/k/v (with rotary embedding applied) and call this layer; it reads the step's
metadata from the forward context, writes the new keys/values into its cache and attends through
the selected backend. Head counts here are per tensor-parallel rank.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn

from omniserve.attention.selector import get_attention_backend
from omniserve.attention.torch_backend import causal_attention
from omniserve.forward_context import get_forward_context

K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0
"""--calculate-kv-scales: an fp8 cache's scale is the largest magnitude over these (vLLM's)."""


class Attention(nn.Module):
    """Causal self-attention over the paged cache of one decoder layer."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})."
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.sliding_window = sliding_window
        self.backend = get_attention_backend()
        # Set by the model runner after profiling:
        # [2, num_blocks, block_size, num_kv_heads, head_size]; a plain attribute, not a buffer,
        # so it stays out of state_dict and weight loading.
        self.kv_cache: torch.Tensor | None = None
        self.kv_scales: tuple[float, float] = (1.0, 1.0)
        """(key, value) scales of an fp8 cache (a checkpoint's ``k_scale`` / ``v_scale``)."""
        self.calculate_kv_scales = False
        """vLLM's --calculate-kv-scales: take ``kv_scales`` from the next real step."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, H*D], k/v [N, KVH*D] -> [N, H*D]."""
        q = q.view(-1, self.num_heads, self.head_size)  # [num_tokens, num_heads, head_size]
        k = k.view(-1, self.num_kv_heads, self.head_size)  # [num_tokens, num_kv_heads, head_size]
        v = v.view(-1, self.num_kv_heads, self.head_size)
        metadata = get_forward_context().attn_metadata
        if metadata is None:
            out = causal_attention(q, k, v, scale=self.scale, sliding_window=self.sliding_window)
        elif self.kv_cache is None:
            raise RuntimeError(
                "Attention.kv_cache is not set; allocate the KV cache before "
                "running a forward with attention metadata."
            )
        else:
            if self.calculate_kv_scales:
                self._calculate_kv_scales(k, v, metadata.slot_mapping)
            out = self.backend.forward(
                q,
                k,
                v,
                self.kv_cache,
                metadata,
                scale=self.scale,
                sliding_window=self.sliding_window,
                kv_scales=self.kv_scales,
            )
        return out.reshape(-1, self.num_heads * self.head_size)

    def _calculate_kv_scales(
        self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """The scales from this step's keys and values (the rows that write a slot: a warm-up's
        padding rows write none), fixed from then on: the largest magnitudes over vLLM's
        ``K_SCALE_CONSTANT`` (200) and ``V_SCALE_CONSTANT`` (100), well inside e4m3's 448. One
        read of the device, once per layer."""
        rows = slot_mapping >= 0
        if not bool(rows.any()):
            return
        k_max, v_max = (float(x[rows].abs().max()) for x in (k, v))
        self.kv_scales = (k_max / K_SCALE_CONSTANT or 1.0, v_max / V_SCALE_CONSTANT or 1.0)
        self.calculate_kv_scales = False

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_size={self.head_size}, sliding_window={self.sliding_window}, "
            f"backend={self.backend.name}"
        )


def get_attention_layers(model: nn.Module) -> list[Attention]:
    """Every Attention layer of ``model`` in registration order (= layer order), leaving out
    sub-models with their own KV cache (``has_own_kv_cache``: a speech model's talker)."""
    own = [
        name
        for name, module in model.named_modules()
        if name and getattr(module, "has_own_kv_cache", False)
    ]
    return [
        module
        for name, module in model.named_modules()
        if isinstance(module, Attention)
        and not any(name.startswith(prefix + ".") for prefix in own)
    ]


def kv_cache_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one paged KV block takes across ``model``'s attention layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(
        2 * block_size * layer.num_kv_heads * layer.head_size * elem
        for layer in get_attention_layers(model)
    )


def allocate_kv_caches(
    model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One paged cache per attention layer of ``model``, handed to the layer.

    Each is ``[2 (k, v), num_blocks, block_size, num_kv_heads, head_size]``, left uninitialised:
    every slot is written before attention reads it, and on a CPU untouched pages cost nothing
    until a block is first used (zeroing 4 GiB took 5 s of page faults here).
    """
    caches = []
    for layer in get_attention_layers(model):
        cache = torch.empty(
            2,
            num_blocks,
            block_size,
            layer.num_kv_heads,
            layer.head_size,
            dtype=dtype,
            device=device,
        )
        layer.kv_cache = cache
        caches.append(cache)
    return caches


def release_kv_caches(model: nn.Module) -> None:
    """Take the paged caches back from ``model``'s attention layers (sleep mode)."""
    for layer in get_attention_layers(model):
        layer.kv_cache = None


def copy_kv_blocks(caches: list[torch.Tensor], pairs: Collection[tuple[int, int]]) -> None:
    """Copy each (source, destination) block's K and V in every cache: a request whose prefix
    hit ends in another's partial block continues it in its own block."""
    if not pairs or not caches:
        return
    src, dst = (torch.tensor(ids, device=caches[0].device) for ids in zip(*pairs, strict=True))
    for cache in caches:
        cache[:, dst] = cache[:, src]
