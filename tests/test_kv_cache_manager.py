from __future__ import annotations

import os
import subprocess
import sys

import pytest

from omniserve.core.kv_cache_manager import (
    ROOT_BLOCK_HASH,
    KVCacheManager,
    block_extra_keys,
    hash_block_tokens,
    update_block_hashes,
)
from omniserve.core.request import Request
from tests.utils import MM_PLACEHOLDER_TOKEN_ID, make_request

BLOCK_SIZE = 4


def _request(
    req_id: str, prompt: list[int], cache_salt: str | None = None, **kwargs: object
) -> Request:
    request = make_request(req_id, prompt, **kwargs)  # type: ignore[arg-type]
    request.cache_salt = cache_salt
    update_block_hashes(request, BLOCK_SIZE)
    return request


def _admit(kv: KVCacheManager, request: Request) -> int:
    """Prefix lookup + allocation for the whole prompt, then mark it computed; return hit tokens."""
    hit_blocks, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit_blocks)
    request.num_computed_tokens = request.num_tokens
    return num_hit


def test_block_hash_is_process_independent() -> None:
    code = (
        "from omniserve.core.kv_cache_manager import hash_block_tokens as h; "
        "print(h(h(0, [1, 2, 3, 4], ()), [5, 6, 7, 8], (('img', 3),)))"
    )
    expected = hash_block_tokens(
        hash_block_tokens(0, [1, 2, 3, 4], ()), [5, 6, 7, 8], (("img", 3),)
    )
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            cwd=os.getcwd(),
        )
        assert int(result.stdout) == expected


def test_hashes_are_chained_and_extended_incrementally() -> None:
    assert hash_block_tokens(1, [1, 2], ()) != hash_block_tokens(2, [1, 2], ())
    assert hash_block_tokens(0, [1, 2], ()) != hash_block_tokens(0, [1, 2], ("x",))
    request = _request("a", list(range(10, 20)))  # 10 tokens: 2 full blocks
    assert len(request.block_hashes) == 2
    first = hash_block_tokens(ROOT_BLOCK_HASH, [10, 11, 12, 13], ())
    assert request.block_hashes[0] == first
    assert request.block_hashes[1] == hash_block_tokens(first, [14, 15, 16, 17], ())
    request.append_output_token_ids([20])
    update_block_hashes(request, BLOCK_SIZE)
    assert len(request.block_hashes) == 2  # third block still partial
    request.append_output_token_ids([21])
    update_block_hashes(request, BLOCK_SIZE)
    fresh = _request("b", list(range(10, 22)))
    assert request.block_hashes == fresh.block_hashes


def test_identical_prompt_reuses_full_blocks_and_counts_hits() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    a = _request("a", prompt)
    assert _admit(kv, a) == 0
    b = _request("b", prompt)
    assert _admit(kv, b) == 8
    ids_a, ids_b = kv.get_block_ids("a"), kv.get_block_ids("b")
    assert ids_a[:2] == ids_b[:2]
    assert ids_a[2] != ids_b[2]  # the partial last block is never shared
    assert len(set(ids_a + ids_b)) == 4
    assert kv.prefix_cache_queries == 20 and kv.prefix_cache_hits == 8
    assert kv.usage == pytest.approx(4 / 16)


def test_hit_is_capped_below_the_last_token() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    prompt = list(range(100, 108))  # exactly 2 blocks
    _admit(kv, _request("a", prompt))
    _, num_hit = kv.get_computed_blocks(_request("b", prompt))
    assert num_hit == 4  # 8 would leave nothing to compute and no logits


def test_partial_block_content_is_not_a_hit() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    _admit(kv, _request("a", list(range(100, 106))))  # 1 full block + 2 tokens
    _, num_hit = kv.get_computed_blocks(_request("b", list(range(100, 108)) + [1]))
    assert num_hit == 4


@pytest.mark.parametrize("caching, prompt_logprobs", [(False, None), (True, 1)])
def test_no_hits_without_caching_or_with_prompt_logprobs(
    caching: bool, prompt_logprobs: int | None
) -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, enable_caching=caching)
    prompt = list(range(100, 110))
    _admit(kv, _request("a", prompt))
    hit_blocks, num_hit = kv.get_computed_blocks(
        _request("b", prompt, prompt_logprobs=prompt_logprobs)
    )
    assert num_hit == 0 and hit_blocks.get_block_ids() == []


def test_allocate_returns_only_new_blocks_and_none_when_full() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)
    a = _request("a", list(range(100, 106)))
    new = kv.allocate_slots(a, 6)
    assert new is not None and new.get_block_ids() == [0, 1]
    a.num_computed_tokens = 6
    assert kv.allocate_slots(a, 2).get_block_ids() == []  # still fits in block 1
    a.num_computed_tokens = 8
    assert kv.allocate_slots(a, 1).get_block_ids() == [2]
    a.num_computed_tokens = 9
    b = _request("b", list(range(200, 204)))
    assert kv.allocate_slots(b, 4) is None
    assert kv.get_block_ids("b") == [] and kv.block_pool.num_free_blocks == 0
    with pytest.raises(ValueError):
        kv.allocate_slots(a, 0)


def test_revived_hits_count_against_free_blocks() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)
    prompt = list(range(100, 109))  # 2 full blocks + 1 token
    a = _request("a", prompt)
    _admit(kv, a)
    kv.free(a)
    assert kv.block_pool.num_free_blocks == 3
    hog = _request("hog", [1, 2, 3])
    # The evicted-first block is a's tail (freed first); a's two full blocks survive.
    assert kv.allocate_slots(hog, 3).get_block_ids() == [2]
    b = _request("b", prompt)
    hit_blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    # Reviving 2 blocks leaves 0 free: the third block b needs does not fit.
    assert kv.allocate_slots(b, 1, num_hit, hit_blocks) is None
    kv.free(hog)
    assert kv.allocate_slots(b, 1, num_hit, hit_blocks).get_block_ids() == [2]
    assert kv.get_block_ids("b") == [0, 1, 2]


def test_free_releases_everything_tail_first() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = _request("a", list(range(100, 112)))  # 3 full blocks, all cached
    _admit(kv, a)
    kv.free(a)
    kv.free(a)  # idempotent
    assert kv.block_pool.num_free_blocks == 8
    assert kv.get_block_ids("a") == []
    assert kv.block_pool.free_block_queue.block_ids()[-3:] == [2, 1, 0]


def test_blocks_cached_but_never_computed_are_uncached_on_free() -> None:
    """A request preempted in the step that allocated its blocks never wrote their KV."""
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = _request("a", list(range(100, 112)))
    kv.allocate_slots(a, 4)
    a.num_computed_tokens = 4  # step 1 ran: block 0 written
    kv.allocate_slots(a, 8)  # step 2 scheduled (blocks 1, 2 cached optimistically) ...
    kv.free(a)  # ... but preempted before it ran
    b = _request("b", list(range(100, 112)))
    _, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4


def test_a_freed_requests_partial_block_is_copied_by_a_request_continuing_it() -> None:
    """A beam search step or the next chat turn continues a finished request's tokens: the KV
    of its partial last block is copied into a block of the new request, not recomputed."""
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = _request("a", list(range(100, 110)))  # 2 full blocks + 2 tokens
    _admit(kv, a)
    a_blocks = kv.get_block_ids("a")
    kv.free(a)
    b = _request("b", list(range(100, 111)))  # a's tokens and one more
    hit_blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 10 and hit_blocks.get_block_ids() == a_blocks[:2]
    assert hit_blocks.tail is not None and hit_blocks.tail.block_id == a_blocks[2]
    new = kv.allocate_slots(b, 1, num_hit, hit_blocks)
    assert new is not None and len(new.blocks) == 1
    (dst,) = new.get_block_ids()
    assert kv.get_block_ids("b") == [*a_blocks[:2], dst] and dst != a_blocks[2]
    assert hit_blocks.tail.ref_cnt == 1  # held until the step that copies it is scheduled
    assert kv.take_block_copies() == {"b": (a_blocks[2], dst)}
    assert hit_blocks.tail.ref_cnt == 0 and kv.take_block_copies() == {}
    assert kv.prefix_cache_hits == 10
    # The tail stays cached for the next continuation (b's siblings in a beam search).
    assert kv.get_computed_blocks(_request("c", [*range(100, 110), 7, 8]))[1] == 10


def test_a_tail_hit_needs_its_exact_tokens_and_keys() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = _request("a", [1, 2, 3, 4, 5, 6, 7], cache_salt="s")  # 1 full block + 3 tokens
    _admit(kv, a)
    kv.free(a)
    longer = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert kv.get_computed_blocks(_request("b", longer, cache_salt="s"))[1] == 7
    # The same tokens under another salt, a diverging token in the tail, or the tail cut short
    # (the last token is always computed) find the full block at most.
    assert kv.get_computed_blocks(_request("c", longer, cache_salt="t"))[1] == 0
    assert kv.get_computed_blocks(_request("d", [1, 2, 3, 4, 5, 0, 7, 8], cache_salt="s"))[1] == 4
    assert kv.get_computed_blocks(_request("e", [1, 2, 3, 4, 5, 6, 7], cache_salt="s"))[1] == 4
    # A request with an item in the tail's range keys it by the item.
    kv2 = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    img = _request("img", [1, 2, 3, 4, 5, 6, 7], mm_positions=[(5, 2)], mm_hashes=["x"])
    _admit(kv2, img)
    kv2.free(img)
    for item, num_hit in (("x", 7), ("y", 4)):
        later = _request(item, [1, 2, 3, 4, 5, 6, 7, 8], mm_positions=[(5, 2)], mm_hashes=[item])
        assert kv2.get_computed_blocks(later)[1] == num_hit


def test_a_tail_covers_written_tokens_only() -> None:
    """A request preempted (or failed) before its step ran caches its tail over the tokens
    written before it, one freed with a step in flight over those written before that step;
    a resumed request finds its own tail."""
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = _request("a", list(range(100, 111)))
    kv.allocate_slots(a, 6)
    a.num_computed_tokens = 6  # step 1 ran
    kv.allocate_slots(a, 5)  # step 2 scheduled but never run
    kv.free(a)
    assert kv.get_computed_blocks(a)[1] == 6
    b = _request("b", list(range(200, 210)))
    _admit(kv, b)
    b.num_output_placeholders = 1  # a step in flight computes its last position
    kv.free(b)
    assert kv.get_computed_blocks(_request("c", list(range(200, 212))))[1] == 9
    no_caching = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_caching=False)
    _admit(no_caching, b := _request("b", [1, 2, 3]))
    no_caching.free(b)
    assert no_caching.get_computed_blocks(_request("c", [1, 2, 3, 4]))[1] == 0


def test_reset_prefix_cache_refuses_while_in_use() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    prompt = list(range(100, 110))
    a = _request("a", prompt)
    _admit(kv, a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.prefix_cache_queries == 0
    assert kv.get_computed_blocks(_request("b", prompt))[1] == 0


def test_block_extra_keys_name_every_overlapping_item_and_its_offset() -> None:
    request = make_request(
        "r", [1] * 20, mm_positions=[(2, 3), (6, 8)], mm_hashes=["img-a", "img-b"]
    )
    assert block_extra_keys(request, 0, 4) == (("img-a", 2),)
    assert block_extra_keys(request, 4, 8) == (("img-a", -2), ("img-b", 2))
    assert block_extra_keys(request, 8, 12) == (("img-b", -2),)
    assert block_extra_keys(request, 16, 20) == ()
    assert block_extra_keys(make_request("t", [1] * 8), 0, 4) == ()


def test_same_image_at_another_offset_hashes_differently() -> None:
    """Placeholder ids are identical, so only the item's offset tells these blocks apart."""
    prompt = [1, 2, 3, 4] + [MM_PLACEHOLDER_TOKEN_ID] * 8
    at_4 = _request("a", prompt, mm_positions=[(4, 8)], mm_hashes=["x"])
    at_5 = _request("b", prompt, mm_positions=[(5, 7)], mm_hashes=["x"])
    other = _request("c", prompt, mm_positions=[(4, 8)], mm_hashes=["y"])
    same = _request("d", prompt, mm_positions=[(4, 8)], mm_hashes=["x"])
    assert at_4.prompt_token_ids == at_5.prompt_token_ids == other.prompt_token_ids == prompt
    assert at_4.block_hashes[0] == at_5.block_hashes[0] == other.block_hashes[0]
    assert at_4.block_hashes[1] != at_5.block_hashes[1]
    assert at_4.block_hashes[1] != other.block_hashes[1]
    assert at_4.block_hashes == same.block_hashes


def test_kv_events_record_stored_removed_and_cleared_blocks() -> None:
    """vLLM's KV events: full blocks as they are registered (one event per run, chained to
    the block before), their removal when evicted or never written, and a reset; never the
    partial tails, and nothing unless asked."""
    from omniserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
    from omniserve.core.kv_events import external_hash as ext

    kv = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE, record_events=True)
    a = _request("a", list(range(100, 110)))  # 2 full blocks, a tail of 2
    _admit(kv, a)
    hashes = [ext(h) for h in a.block_hashes]
    assert kv.take_events() == [
        BlockStored(hashes, None, list(range(100, 108)), BLOCK_SIZE, None, "GPU")
    ]
    assert kv.take_events() == []
    b = _request("b", [*range(100, 108), *range(200, 206)])  # shares 2 blocks, adds 1
    _admit(kv, b)
    assert kv.take_events() == [
        BlockStored([ext(b.block_hashes[2])], hashes[1], list(range(200, 204)), BLOCK_SIZE,
                    None, "GPU"),
    ]  # fmt: skip
    kv.free(a)  # its tail is cached, not published
    kv.free(b)
    assert kv.take_events() == []
    c = _request("c", list(range(300, 324)))  # 6 blocks: evicts every cached one
    _admit(kv, c)
    events = kv.take_events()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted([*hashes, ext(b.block_hashes[2])])
    assert isinstance(events[-1], BlockStored) and len(events[-1].block_hashes) == 6
    kv.free(c)
    assert kv.reset_prefix_cache() and kv.take_events() == [AllBlocksCleared()]
    # Blocks cached for a step that never ran (preemption) are removed again.
    d = _request("d", list(range(400, 412)))
    kv.allocate_slots(d, 12)
    kv.free(d)
    stored, *gone = kv.take_events()
    assert isinstance(stored, BlockStored) and all(isinstance(e, BlockRemoved) for e in gone)
    assert sorted(h for e in gone for h in e.block_hashes) == sorted(stored.block_hashes)
    plain = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    _admit(plain, _request("a", list(range(100, 110))))
    assert plain.take_events() == [] and plain.block_pool.events is None
