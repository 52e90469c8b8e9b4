"""The prefix cache's changes as vLLM publishes them (``--kv-events-config``), for KV-aware
routers: a block's content stored, blocks removed, the whole cache cleared.

The structs are vLLM's wire format (msgpack arrays, ``[ts, events, data_parallel_rank]`` and
events ``[class name, fields...]``), so its subscribers decode them as they are. A block is named
by the low 64 bits of its chained hash (an unsigned int, as vLLM names blocks by default); only
full blocks are published, never the partial tails a request leaves cached.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM = "GPU"
"""The medium every event names: the engine's KV cache (vLLM's name for it, on any device)."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """A change to the prefix cache."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_hash(block_hash: int) -> int:
    """The name a block's hash is published under (its low 64 bits)."""
    return block_hash & 0xFFFF_FFFF_FFFF_FFFF
