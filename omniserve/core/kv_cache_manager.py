"""KVCacheManager: which KV blocks each request owns, and prefix caching by chained block hashes.

The scheduler speaks tokens (how many to compute, how many were found cached); this module turns
them into blocks and hides the ``BlockPool`` behind ``KVCacheBlocks``.

Full blocks are shared. A request's last, partial block (its *tail*) is cached too when the
request is freed, under the hash of the tokens written in it: a later request continuing those
tokens (a beam search step, the next turn of a chat, a preempted request resuming) copies the
tail into a block of its own instead of recomputing up to ``block_size - 1`` tokens.

With ``record_events`` (``--kv-events-config``) the full blocks' registrations, removals and a
reset are kept as vLLM's KV events (``core/kv_events.py``) for the engine to publish.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from omniserve.config import blocks_for
from omniserve.core.block_hash import ROOT_BLOCK_HASH, BlockHasher, hash_block_tokens
from omniserve.core.block_pool import BlockPool, KVCacheBlock
from omniserve.core.kv_events import MEDIUM, BlockStored, KVCacheEvent, external_hash
from omniserve.core.request import Request


class BlockOwner(Protocol):
    """What allocation and freeing read of a sequence: a thinker ``Request`` or a talker's."""

    @property
    def request_id(self) -> str: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def block_hashes(self) -> list[int]: ...


def block_extra_keys(request: Request, start: int, end: int) -> tuple[object, ...]:
    """What besides token ids decides the KV of tokens [start, end), in vLLM's order.

    The request's LoRA adapter (its name); multimodal placeholders share one token id per
    modality, so a block covering part of an item also mixes in ``(identifier, offset -
    start)`` of every item overlapping it: two images with identical placeholder tokens never
    share blocks, nor does one image placed at another offset; the first block the request's
    cache salt; runs of the prompt given as embeddings (their ids are placeholders) as items.
    Identifiers are content hashes, so these keys are process-independent.
    """
    keys: list[object] = []
    if request.lora_request is not None:
        keys.append(request.lora_request.lora_name)
    for feature in request.mm_features:  # in prompt order
        pos = feature.mm_position
        if pos.offset >= end:
            break
        if pos.end > start:
            keys.append((feature.identifier, pos.offset - start))
    if start == 0 and request.cache_salt:
        keys.append(request.cache_salt)
    for run in request.prompt_embeds:
        if run.offset < end and run.offset + len(run.embeds) > start:
            keys.append((run.identifier, run.offset - start))
    return tuple(keys)


def update_block_hashes(
    request: Request, block_size: int, hasher: BlockHasher = hash_block_tokens
) -> None:
    """Extend ``request.block_hashes`` over every block that became full since the last call."""
    token_ids = request.all_token_ids
    num_full_blocks = len(token_ids) // block_size
    hashes = request.block_hashes
    parent = hashes[-1] if hashes else ROOT_BLOCK_HASH
    for i in range(len(hashes), num_full_blocks):
        start, end = i * block_size, (i + 1) * block_size
        extra_keys = block_extra_keys(request, start, end)
        parent = hasher(parent, token_ids[start:end], extra_keys)
        hashes.append(parent)


@dataclass
class KVCacheBlocks:
    """Blocks handed between the manager and the scheduler; the scheduler only reads their ids."""

    blocks: list[KVCacheBlock] = field(default_factory=list)
    tail: KVCacheBlock | None = None
    """A prefix hit's cached partial block after ``blocks``, copied into the request's own."""

    def get_block_ids(self) -> list[int]:
        return [block.block_id for block in self.blocks]


class KVCacheManager:
    """Allocates blocks per request and shares full blocks between requests with equal prefixes.

    Counters ``prefix_cache_queries`` / ``prefix_cache_hits`` are cumulative prompt tokens looked
    up / found, counted once per request when it is first admitted (a resumed request finding its
    own blocks again would inflate the hit rate).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        record_events: bool = False,
        hash_algo: str = "sha256",
    ) -> None:
        """``record_events``: keep the prefix cache's changes for ``take_events`` (KV events);
        ``hash_algo``: the block keys' (``core/block_hash.py``)."""
        self.block_size = block_size
        self.hasher = BlockHasher(hash_algo)
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, record_events)
        # req_id -> the request's blocks, in token order
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # req_id -> how many leading blocks of the request were offered to the prefix cache
        self.req_to_num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # req_id -> (cached tail, the request's block it is copied into) for the next step
        self.pending_copies: dict[str, tuple[KVCacheBlock, KVCacheBlock]] = {}
        self.newly_cached: list[int] = []  # block ids, for the step being scheduled

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return self.block_pool.usage

    def update_block_hashes(self, request: Request) -> None:
        """Hash the request's newly full blocks (nothing to do when caching is off)."""
        if self.enable_caching:
            update_block_hashes(request, self.block_size, self.hasher)

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of a request with no blocks yet: (blocks, number of tokens).

        Full blocks first, then the longest cached tail continuing them. Capped at
        ``num_tokens - 1`` so the last token is always computed and yields logits. Requests
        that read every prompt position's state (prompt logprobs, MEAN or CLS pooling) never
        hit.
        """
        if not self.enable_caching or request.sampling_params.reads_prompt_states:
            return KVCacheBlocks(), 0
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        hit_blocks = []
        for block_hash in request.block_hashes[:max_num_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hit_blocks.append(block)
        index = len(hit_blocks)
        start = index * self.block_size
        for end in range(min(start + self.block_size, request.num_tokens) - 1, start, -1):
            tail = self.block_pool.get_cached_block(self._tail_hash(request, index, start, end))
            if tail is not None:
                return KVCacheBlocks(hit_blocks, tail), end
        return KVCacheBlocks(hit_blocks), start

    def allocate_slots(
        self,
        request: BlockOwner,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
    ) -> KVCacheBlocks | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        ``new_computed_blocks`` / ``num_new_computed_tokens`` are a prefix hit from
        ``get_computed_blocks`` (only for a request with no blocks yet). Returns the newly
        allocated blocks, or None, changing nothing, when the pool cannot supply them.
        Full blocks are offered to the prefix cache right away, before the step runs, so a
        request admitted later in the same step can already share them.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}.")
        hit_blocks = new_computed_blocks.blocks if new_computed_blocks is not None else []
        tail = new_computed_blocks.tail if new_computed_blocks is not None else None
        req_id = request.request_id
        req_blocks = self.req_to_blocks.get(req_id, [])
        num_tokens_after = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_blocks_needed = blocks_for(num_tokens_after, self.block_size)
        num_new_blocks = max(num_blocks_needed - len(req_blocks) - len(hit_blocks), 0)
        # Hits sitting in the free queue stop being free when revived.
        num_revived = sum(1 for block in [*hit_blocks, tail] if block and block.ref_cnt == 0)
        if num_new_blocks + num_revived > self.block_pool.num_free_blocks:
            return None

        if req_id not in self.req_to_blocks:
            self.req_to_blocks[req_id] = req_blocks
            self.req_to_num_cached_blocks[req_id] = len(hit_blocks)
            if self.enable_caching and request.num_preemptions == 0:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_new_computed_tokens
        self.block_pool.touch(hit_blocks)
        req_blocks.extend(hit_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        if tail is not None:  # held until the step that copies it is scheduled
            assert len(req_blocks) == len(hit_blocks), "a tail comes with a first allocation"
            self.block_pool.touch([tail])
            self.pending_copies[req_id] = (tail, new_blocks[0])
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, req_blocks, num_tokens_after)
        return KVCacheBlocks(new_blocks)

    def _cache_full_blocks(
        self, request: BlockOwner, req_blocks: list[KVCacheBlock], num_tokens: int
    ) -> None:
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        num_cached = self.req_to_num_cached_blocks[request.request_id]
        stored = []
        for i in range(num_cached, num_full):
            if self.block_pool.cache_block(req_blocks[i], request.block_hashes[i], publish=True):
                self.newly_cached.append(req_blocks[i].block_id)
                stored.append(i)
        self.req_to_num_cached_blocks[request.request_id] = max(num_cached, num_full)
        if stored and self.block_pool.events is not None:
            assert isinstance(request, Request), "only a thinker's requests cache blocks"
            self._record_stored(request, stored)

    def _record_stored(self, request: Request, indices: list[int]) -> None:
        """One ``BlockStored`` per run of consecutive newly registered blocks of ``request``."""
        assert self.block_pool.events is not None
        size, hashes = self.block_size, request.block_hashes
        lora_id = request.lora_request.lora_int_id if request.lora_request else None
        runs: list[list[int]] = []
        for i in indices:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, end = run[0], run[-1] + 1
            self.block_pool.events.append(BlockStored(
                [external_hash(hashes[i]) for i in run],
                external_hash(hashes[first - 1]) if first else None,
                request.all_token_ids[first * size : end * size], size, lora_id, MEDIUM,
            ))  # fmt: skip

    def take_events(self) -> list[KVCacheEvent]:
        """The prefix cache's changes since the last call, oldest first (none unless recorded)."""
        events = self.block_pool.events
        if not events:
            return []
        self.block_pool.events = []
        return events

    def take_newly_cached(self) -> list[int]:
        """Blocks offered to the prefix cache since the last call (the step being scheduled
        completes them)."""
        block_ids, self.newly_cached = self.newly_cached, []
        return block_ids

    def uncache(self, block_ids: list[int]) -> None:
        """Forget these blocks' content: the step that was to write it failed. (A request
        freed while that step was in flight left them cached.)"""
        for block_id in block_ids:
            self.block_pool.uncache_block(self.block_pool.blocks[block_id])

    def take_block_copies(self) -> dict[str, tuple[int, int]]:
        """The step's tail copies (req_id -> (source, destination) block id), releasing the
        sources: the workers run steps in order and copy before the step writes, so a source
        reused by a later step is still intact when it is copied."""
        copies = {req_id: (src.block_id, dst.block_id)
                  for req_id, (src, dst) in self.pending_copies.items()}  # fmt: skip
        self.block_pool.free_blocks(src for src, _ in self.pending_copies.values())
        self.pending_copies.clear()
        return copies

    def free(self, request: BlockOwner) -> None:
        """Release the request's blocks, tail first so its tail is evicted first.

        ``request.num_computed_tokens`` must still count the tokens whose KV was written: a
        request preempted in the step that allocated its blocks never computed them, so blocks
        cached optimistically past that point are uncached before they could serve a hit, and
        the partial block is cached as a tail over the written tokens only.
        """
        req_blocks = self.req_to_blocks.pop(request.request_id, None)
        num_cached = self.req_to_num_cached_blocks.pop(request.request_id, 0)
        if req_blocks is None:
            return
        num_written = request.num_computed_tokens // self.block_size
        for block in req_blocks[num_written:num_cached]:
            self.block_pool.uncache_block(block)
        if self.enable_caching and isinstance(request, Request):
            self._cache_tail(request, req_blocks)
        self.block_pool.free_blocks(reversed(req_blocks))

    def _cache_tail(self, request: Request, req_blocks: list[KVCacheBlock]) -> None:
        # Positions of steps still in flight (async scheduling) are left out: such a step may
        # yet fail, and their tokens may not be known here.
        written = request.num_computed_tokens - request.num_output_placeholders
        end = min(written, request.num_tokens)
        index, start = end // self.block_size, end // self.block_size * self.block_size
        if end > start and index < len(req_blocks):
            update_block_hashes(request, self.block_size, self.hasher)
            tail_hash = self._tail_hash(request, index, start, end)
            self.block_pool.cache_block(req_blocks[index], tail_hash)

    def _tail_hash(self, request: Request, index: int, start: int, end: int) -> int:
        """The key of block ``index`` (starting at token ``start``) holding tokens [start, end)
        only. It never equals a full block's: the hashed token lists differ in length."""
        parent = request.block_hashes[index - 1] if index else ROOT_BLOCK_HASH
        return self.hasher(parent, request.all_token_ids[start:end],
                           block_extra_keys(request, start, end))  # fmt: skip

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Forget all cached content and zero the hit counters; False while blocks are in use."""
        if not self.block_pool.reset_prefix_cache():
            return False
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        return True
