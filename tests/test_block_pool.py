from __future__ import annotations

import pytest

from omniserve.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def test_free_queue_is_ordered_and_supports_removal_from_the_middle() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert queue.block_ids() == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[0])
    queue.appendleft(blocks[2])
    assert queue.block_ids() == [2, 1, 3, 4, 0]
    assert len(queue) == 5


def test_get_new_blocks_takes_from_the_front_and_refcounts() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)


def test_freed_cached_blocks_stay_findable_until_evicted() -> None:
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 111)
    pool.cache_block(b, 222)
    pool.free_blocks([b, a])  # tail first
    assert pool.num_free_blocks == 3
    assert pool.get_cached_block(111) is a and pool.get_cached_block(222) is b
    # The never-used block 2 is evicted first, then the freed tail (b), then a.
    assert pool.free_block_queue.block_ids() == [2, 1, 0]
    (first,) = pool.get_new_blocks(1)
    assert first.block_id == 2 and pool.get_cached_block(222) is b
    (second,) = pool.get_new_blocks(1)
    assert second is b
    assert pool.get_cached_block(222) is None and b.block_hash is None
    assert pool.get_cached_block(111) is a


def test_uncached_free_blocks_are_evicted_before_cached_ones() -> None:
    pool = BlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, 1)
    pool.free_blocks([a])
    pool.free_blocks([c, b])  # b, c hold no cached content
    assert pool.free_block_queue.block_ids()[-1] == a.block_id
    assert set(pool.free_block_queue.block_ids()[:2]) == {b.block_id, c.block_id}


def test_touch_revives_a_free_cached_block() -> None:
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, 7)
    pool.free_blocks([a])
    assert pool.num_free_blocks == 2
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.touch([a])
    assert a.ref_cnt == 2 and pool.num_free_blocks == 1
    (other,) = pool.get_new_blocks(1)
    assert other is not a and pool.get_cached_block(7) is a


def test_one_block_per_hash_and_caching_switch() -> None:
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 5)
    pool.cache_block(b, 5)
    assert pool.get_cached_block(5) is a and b.block_hash is None
    off = BlockPool(1, enable_caching=False)
    (c,) = off.get_new_blocks(1)
    off.cache_block(c, 5)
    assert off.get_cached_block(5) is None


def test_reset_prefix_cache_only_when_all_free() -> None:
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, 9)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(9) is a
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(9) is None and a.block_hash is None
