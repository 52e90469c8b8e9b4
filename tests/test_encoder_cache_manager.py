from __future__ import annotations

import pytest

from omniserve.core.encoder_cache_manager import EncoderCacheManager
from omniserve.core.request import Request
from omniserve.multimodal.inputs import PlaceholderRange
from tests.utils import make_request


def _request(req_id: str, *items: tuple[str, int]) -> Request:
    """A request whose items (identifier, num_embeds) sit back to back from position 0."""
    positions, offset = [], 0
    for _, size in items:
        positions.append((offset, size))
        offset += size
    hashes = [identifier for identifier, _ in items]
    return make_request(req_id, [1] * (offset + 1), mm_positions=positions, mm_hashes=hashes)


def _add(cache: EncoderCacheManager, request: Request, i: int, budget: int = 1000) -> None:
    """Schedule item i the way the scheduler does: hit, or make room and allocate."""
    if not cache.check_and_update_cache(request, i):
        assert cache.can_allocate(request, i, budget, 0)
        cache.allocate(request, i)


def test_entries_are_shared_and_freed_only_when_evicted() -> None:
    cache = EncoderCacheManager(100)
    a, b = _request("a", ("x", 30)), _request("b", ("x", 30))
    assert not cache.check_and_update_cache(a, 0)
    assert cache.can_allocate(a, 0, compute_budget=30, num_embeds_already_scheduled=0)
    cache.allocate(a, 0)
    assert cache.num_free_slots == cache.num_freeable_slots == 70
    assert cache.check_and_update_cache(b, 0)  # hit: b references a's entry
    assert cache.num_free_slots == 70 and cache.usage == pytest.approx(0.3)
    cache.free(a)
    assert cache.num_freeable_slots == 70  # b still needs it
    cache.free_encoder_input(b, 0)
    assert cache.num_freeable_slots == 100 and cache.num_free_slots == 70
    assert cache.usage == 0.0 and cache.req_to_items == {}
    assert cache.get_freed_mm_hashes() == []  # freeable, not freed: a later request may hit it
    c = _request("c", ("x", 30))
    assert cache.check_and_update_cache(c, 0)
    assert cache.num_freeable_slots == 70 and list(cache.freeable) == []


def test_reset_drops_what_no_request_holds() -> None:
    """``reset_mm_cache``: unreferenced outputs go (the workers are told), held ones stay."""
    cache = EncoderCacheManager(100)
    a, b = _request("a", ("x", 30)), _request("b", ("y", 20))
    _add(cache, a, 0)
    _add(cache, b, 0)
    cache.free(a)
    cache.reset()
    assert set(cache.entries) == {"y"} and cache.get_freed_mm_hashes() == ["x"]
    assert cache.num_free_slots == cache.num_freeable_slots == 80
    assert not cache.check_and_update_cache(_request("c", ("x", 30)), 0)  # encoded anew


def test_can_allocate_checks_budget_then_evicts_least_recently_released() -> None:
    cache = EncoderCacheManager(100)
    owners = [_request(f"r{i}", (f"h{i}", 30)) for i in range(3)]
    for owner in owners:
        _add(cache, owner, 0)
    for i in (1, 0, 2):  # released in this order
        cache.free(owners[i])
    big = _request("big", ("y", 50))
    assert not cache.can_allocate(big, 0, compute_budget=49, num_embeds_already_scheduled=0)
    assert cache.get_freed_mm_hashes() == []  # refusing evicts nothing
    assert cache.can_allocate(big, 0, compute_budget=50, num_embeds_already_scheduled=0)
    assert cache.get_freed_mm_hashes() == ["h1", "h0"]  # 10 free + 2 * 30 >= 50
    assert cache.get_freed_mm_hashes() == []  # reported once
    assert cache.num_free_slots == 70 and list(cache.freeable) == ["h2"]
    cache.allocate(big, 0)
    assert cache.num_free_slots == 20 and cache.num_freeable_slots == 50


def test_can_allocate_counts_what_the_request_already_planned() -> None:
    cache = EncoderCacheManager(100)
    pinned = _request("p", ("pin", 40))
    _add(cache, pinned, 0)
    request = _request("r", ("a", 30), ("b", 30))
    assert cache.can_allocate(request, 1, compute_budget=100, num_embeds_already_scheduled=30)
    assert not cache.can_allocate(request, 1, compute_budget=100, num_embeds_already_scheduled=31)
    assert cache.get_freed_mm_hashes() == []


def test_references_are_per_item_so_a_repeated_image_stays_alive() -> None:
    cache = EncoderCacheManager(50)
    request = _request("r", ("x", 20), ("x", 20))
    _add(cache, request, 0)
    assert cache.check_and_update_cache(request, 1)
    assert cache.referenced_items(request) == [0, 1]
    cache.free_encoder_input(request, 0)
    assert cache.has_ref(request, 1) and not cache.has_ref(request, 0)
    assert cache.num_freeable_slots == 30  # still referenced by item 1
    cache.free_encoder_input(request, 0)  # not referenced any more: no-op
    cache.free(request)
    cache.free(request)
    assert cache.num_freeable_slots == 50 and cache.req_to_items == {}


def test_space_is_counted_in_embeddings_not_placeholder_tokens() -> None:
    cache = EncoderCacheManager(10)
    mask = [False] + [True] * 8 + [False]  # 10 placeholder tokens, 8 embeddings
    request = make_request(
        "r", [1] * 12, mm_positions=[PlaceholderRange(1, 10, mask)], mm_hashes=["x"]
    )
    assert cache.can_allocate(request, 0, compute_budget=8, num_embeds_already_scheduled=0)
    cache.allocate(request, 0)
    assert cache.num_free_slots == 2


def test_evicted_then_reallocated_in_the_same_step_is_not_reported() -> None:
    """Workers overwrite the output they hold, so they must not be told to drop it too."""
    cache = EncoderCacheManager(40)
    first, second, third = (
        _request("a", ("x", 40)),
        _request("b", ("y", 40)),
        _request("c", ("x", 40)),
    )
    _add(cache, first, 0)
    cache.free(first)
    _add(cache, second, 0)  # evicts x
    assert cache.freed == ["x"]
    cache.free(second)
    _add(cache, third, 0)  # evicts y, re-encodes x
    assert cache.get_freed_mm_hashes() == ["y"]
    assert set(cache.entries) == {"x"}


def test_allocate_refuses_misuse() -> None:
    cache = EncoderCacheManager(30)
    a, b = _request("a", ("x", 20)), _request("b", ("x", 20))
    cache.allocate(a, 0)
    with pytest.raises(ValueError, match="already cached"):
        cache.allocate(b, 0)
    with pytest.raises(ValueError, match="can_allocate"):
        cache.allocate(_request("c", ("y", 20)), 0)
    with pytest.raises(ValueError, match=">= 0"):
        EncoderCacheManager(-1)
