"""AttentionMetadata: where each request's queries sit in the flat batch and its keys in the cache.

The model runner lays the new tokens of all scheduled requests end to end (no padding). A request
with query length 1 is decoding; a longer query is a prefill chunk, possibly preceded by tokens
already in the paged cache (an earlier chunk or a prefix-cache hit). Requests may come in any order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """One step's batch layout, built once by the runner and shared by all attention layers."""

    query_start_loc: torch.Tensor
    """[num_reqs + 1] int32: cumulative query (new-token) lengths; request i owns tokens
    ``query_start_loc[i]:query_start_loc[i + 1]`` of the flattened batch."""
    seq_lens: torch.Tensor
    """[num_reqs] int32: tokens in the KV cache after this step (computed + new)."""
    block_table: torch.Tensor
    """[num_reqs, max_blocks] int32: KV block ids of each request, rows padded with 0."""
    slot_mapping: torch.Tensor
    """[num_tokens] int64: cache slot (block_id * block_size + offset) of each new token."""
    query_lens_cpu: list[int]
    """Host copy of the query lengths, so backends split the batch without a device sync."""
    seq_lens_cpu: list[int]
    """Host copy of ``seq_lens``."""
    plans: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)
    """What a backend derives from this layout once and every layer reuses (the torch
    backend's gathers, the Triton backend's tiles), keyed by backend; it lives as long as the
    metadata, so a captured graph's stays valid."""

    def __post_init__(self) -> None:
        num_reqs = len(self.query_lens_cpu)
        if len(self.seq_lens_cpu) != num_reqs or self.block_table.shape[0] != num_reqs:
            raise ValueError(
                f"AttentionMetadata: {num_reqs} query lengths, {len(self.seq_lens_cpu)} seq lens "
                f"and {self.block_table.shape[0]} block-table rows must agree."
            )
        if sum(self.query_lens_cpu) != self.slot_mapping.shape[0]:
            raise ValueError(
                f"AttentionMetadata: query lengths sum to {sum(self.query_lens_cpu)} but "
                f"slot_mapping has {self.slot_mapping.shape[0]} entries."
            )

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]
