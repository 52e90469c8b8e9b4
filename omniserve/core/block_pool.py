"""BlockPool: the fixed set of KV blocks, their reference counts, and the prefix-cache index.

Pure Python bookkeeping; the tensors live in the workers. ``KVCacheBlock`` objects never leave the
core: requests and step outputs carry block ids (ints) only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from omniserve.core.kv_events import (
    MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    KVCacheEvent,
    external_hash,
)


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    """One block of ``block_size`` token slots."""

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    """Set while the block is registered in the prefix cache (its content is reusable)."""
    published: bool = False
    """Its registration was published as stored (KV events): its removal is published too."""


class FreeBlockQueue:
    """Blocks with ref_cnt 0, in eviction order (front = evicted first). O(1) per operation.

    A cached block stays in the queue, still findable by hash, until it reaches the front and is
    reused; ``remove`` takes it out early when a prefix hit revives it.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        # block_id -> block; insertion order is eviction order.
        self._queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (block.block_id, block) for block in blocks
        )

    def __len__(self) -> int:
        return len(self._queue)

    def popleft(self) -> KVCacheBlock:
        return self._queue.popitem(last=False)[1]

    def append(self, block: KVCacheBlock) -> None:
        self._queue[block.block_id] = block

    def appendleft(self, block: KVCacheBlock) -> None:
        self._queue[block.block_id] = block
        self._queue.move_to_end(block.block_id, last=False)

    def remove(self, block: KVCacheBlock) -> None:
        del self._queue[block.block_id]

    def block_ids(self) -> list[int]:
        """Free block ids in eviction order (for tests and debugging)."""
        return list(self._queue)


class BlockPool:
    """Hands out blocks, takes them back, and indexes full blocks by their chained hash.

    One block per hash: a second block with the same content is simply left uncached, so lookups
    and eviction never have to choose between duplicates.
    """

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, record_events: bool = False
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.events: list[KVCacheEvent] | None = [] if record_events else None
        """The cache's changes since they were last taken (None: not recorded)."""
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        # block hash -> the one block registered under it (referenced or in the free queue)
        self.hash_to_block: dict[int, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references, including cached ones that may still be revived."""
        return len(self.free_block_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` from the front of the free queue, evicting their cached content."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"Asked for {num_blocks} blocks, only {self.num_free_blocks} free.")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self.uncache_block(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (prefix hits); revive those sitting in the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; unreferenced ones join the free queue.

        Blocks are queued in the order given, so callers pass a request's blocks tail first: the
        tail of a prefix is the least likely to be shared and is evicted first. A block holding no
        cached content is worthless once free and goes to the very front.
        """
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: int, publish: bool = False) -> bool:
        """Register a full block under its hash, unless that content is already cached;
        whether it was registered. ``publish``: the caller records it as stored (KV events),
        so its removal is recorded here."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.hash_to_block:
            return False
        self.hash_to_block[block_hash] = block
        block.block_hash = block_hash
        block.published = publish and self.events is not None
        return True

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Forget the block's content (it is about to be overwritten or was never written)."""
        if block.block_hash is not None:
            del self.hash_to_block[block.block_hash]
            if block.published and self.events is not None:
                self.events.append(BlockRemoved([external_hash(block.block_hash)], MEDIUM))
            block.block_hash, block.published = None, False

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; refused (False) while any block is still referenced."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash, block.published = None, False
        self.hash_to_block.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True
