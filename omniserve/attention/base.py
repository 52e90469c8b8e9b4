"""The attention-backend contract: write one step's keys/values into the paged cache, then attend.

Paged KV layout (one tensor per attention layer, allocated by the model runner):
``kv_cache[2, num_blocks, block_size, num_kv_heads, head_size]``; index 0 holds keys, 1 values.
Token ``t`` of a request lives in slot ``block_table[req][t // block_size] * block_size +
t % block_size``; the runner precomputes the slots of the new tokens as ``slot_mapping``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from omniserve.attention.metadata import AttentionMetadata


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
    ) -> torch.Tensor:
        """Store ``key``/``value`` at ``metadata.slot_mapping``, then attend.

        query ``[num_tokens, num_heads, head_size]``, key/value ``[num_tokens, num_kv_heads,
        head_size]`` -> ``[num_tokens, num_heads, head_size]``. Query token i of a request with
        query length q and sequence length s sits at absolute position ``s - q + i`` and sees keys
        ``[max(0, pos - sliding_window + 1), pos]`` (all of ``[0, pos]`` without a window).
        Query head h reads KV head ``h // (num_heads // num_kv_heads)`` (grouped-query attention).
        """
