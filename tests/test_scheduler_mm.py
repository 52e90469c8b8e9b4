"""Scheduling with multimodal items: encoder budget, encoder cache, progress, prefix caching."""

from __future__ import annotations

import random
import zlib

import pytest

from omniserve.core.request import Request, RequestStatus
from omniserve.core.sched_output import SchedulerOutput
from omniserve.core.scheduler import Scheduler
from omniserve.multimodal.inputs import PlaceholderRange
from tests.utils import (
    FakeWorker,
    assert_all_free,
    check_invariants,
    make_request,
    make_requests,
    make_runner_output,
    make_scheduler,
    run_stress,
)


def _step(scheduler: Scheduler, worker: FakeWorker) -> SchedulerOutput:
    so = scheduler.schedule()
    check_invariants(scheduler, so)
    worker.execute(so)
    scheduler.update_from_output(so, make_runner_output(scheduler, so))
    return so


def _run(scheduler: Scheduler, worker: FakeWorker, max_steps: int = 500) -> list[SchedulerOutput]:
    """Step to completion; every step must make progress (a livelock repeats empty steps)."""
    outputs = []
    while scheduler.has_unfinished_requests():
        assert len(outputs) < max_steps, "no completion: livelock?"
        so = _step(scheduler, worker)
        assert so.total_num_scheduled_tokens > 0, "a step scheduled nothing"
        outputs.append(so)
    return outputs


def _mm_request(
    req_id: str, num_tokens: int, items: dict[str, tuple[int, int]], **kwargs: object
) -> Request:
    """``items``: identifier -> (offset, length); prompt text ids are unique per request."""
    start = 1000 + 1000 * (zlib.crc32(req_id.encode()) % 1000)
    return make_request(
        req_id,
        list(range(start, start + num_tokens)),
        mm_positions=list(items.values()),
        mm_hashes=list(items),
        **kwargs,
    )


def test_item_is_encoded_once_whole_and_consumed_over_chunks() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16, block_size=4)
    worker = FakeWorker(scheduler)
    (request,) = make_requests(1, 80, mm_positions=[[(20, 40)]], max_tokens=2)
    scheduler.add_request(request)
    encoder_inputs, holds_ref = [], []
    for _ in range(4):
        so = _step(scheduler, worker)
        assert so.num_scheduled_tokens == {request.request_id: 16}
        encoder_inputs.append(so.scheduled_encoder_inputs)
        holds_ref.append(scheduler.encoder_cache_manager.has_ref(request, 0))
    # Windows [0,16) [16,32) [32,48) [48,64): encoded in the first window reaching offset 20, its
    # reference dropped once all 40 placeholder positions (up to 60) are in the KV cache.
    assert encoder_inputs == [{}, {request.request_id: [0]}, {}, {}]
    assert holds_ref == [False, True, True, False]
    _run(scheduler, worker)
    assert worker.num_encoded == {"req-0-item0": 1}
    assert scheduler.encoder_cache_manager.num_free_slots == 8192 - 40  # kept for later hits
    assert_all_free(scheduler)


def test_disable_chunked_mm_input_runs_each_item_in_one_step() -> None:
    """Windows of 16 over an item at [20, 34): [0,16), then [16,20) (cut before the item, where
    the window would end inside it), then [20,36) with the whole item; an item at [40, 80),
    larger than a window, is cut before too ([36,40)), then chunked from its start."""
    scheduler = make_scheduler(max_num_batched_tokens=16, block_size=4,
                               disable_chunked_mm_input=True)  # fmt: skip
    worker = FakeWorker(scheduler)
    (request,) = make_requests(1, 90, mm_positions=[[(20, 14), (40, 40)]], max_tokens=1)
    scheduler.add_request(request)
    windows = []
    while scheduler.has_unfinished_requests():
        so = _step(scheduler, worker)
        windows.append((so.num_scheduled_tokens[request.request_id],
                        so.scheduled_encoder_inputs.get(request.request_id, [])))  # fmt: skip
    assert windows == [(16, []), (4, []), (16, [0]), (4, []), (16, [1]), (16, []), (16, []),
                       (2, [])]  # fmt: skip
    assert_all_free(scheduler)
    # Chunked as it comes without the setting.
    scheduler = make_scheduler(max_num_batched_tokens=16, block_size=4)
    (request,) = make_requests(1, 90, mm_positions=[[(20, 14), (40, 40)]], max_tokens=1)
    scheduler.add_request(request)
    worker = FakeWorker(scheduler)
    assert _step(scheduler, worker).num_scheduled_tokens == {"req-0": 16}
    so = _step(scheduler, worker)
    assert so.num_scheduled_tokens == {"req-0": 16} and so.scheduled_encoder_inputs


def test_encoder_budget_is_shared_by_the_step_and_cuts_before_an_item() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=200, max_num_encoder_input_tokens=50)
    worker = FakeWorker(scheduler)
    r1 = _mm_request("r1", 100, {"a": (0, 40), "b": (40, 40)})
    r2 = _mm_request("r2", 30, {"c": (5, 10)})
    r3 = _mm_request("r3", 30, {"d": (0, 20)})
    for request in (r1, r2, r3):
        scheduler.add_request(request)
    first = _step(scheduler, worker)
    # r1 encodes a (40) and stops before b; r2's 10 still fit the budget; r3's 20 do not.
    assert first.scheduled_encoder_inputs == {"r1": [0], "r2": [0]}
    assert first.num_scheduled_tokens == {"r1": 40, "r2": 30}
    assert [r.request_id for r in scheduler.waiting] == ["r3"]
    second = _step(scheduler, worker)
    assert second.scheduled_encoder_inputs == {"r1": [1]}
    assert second.num_scheduled_tokens == {"r1": 60, "r2": 1}
    third = _step(scheduler, worker)
    assert third.scheduled_encoder_inputs == {"r3": [0]}
    _run(scheduler, worker)
    assert_all_free(scheduler)


def test_tiny_cache_evicts_and_reencodes_correctly() -> None:
    scheduler = make_scheduler(encoder_cache_size=40, max_num_encoder_input_tokens=40)
    worker = FakeWorker(scheduler)
    freed: list[list[str]] = []
    for req_id, identifier in (("a", "x"), ("b", "y"), ("c", "x")):
        scheduler.add_request(_mm_request(req_id, 50, {identifier: (5, 40)}, max_tokens=1))
        outputs = _run(scheduler, worker)
        freed.append([h for so in outputs for h in so.free_encoder_mm_hashes])
    assert freed == [[], ["x"], ["y"]]
    assert worker.num_encoded == {"x": 2, "y": 1}
    # Two items of one prompt that do not fit together: the second waits for the first's slots.
    scheduler.add_request(_mm_request("d", 70, {"p": (0, 30), "q": (30, 30)}, max_tokens=1))
    first, second, *_ = _run(scheduler, worker)
    assert first.scheduled_encoder_inputs == {"d": [0]} and first.num_scheduled_tokens == {"d": 30}
    assert first.free_encoder_mm_hashes == ["x"]
    assert second.scheduled_encoder_inputs == {"d": [1]} and second.free_encoder_mm_hashes == ["p"]
    assert_all_free(scheduler)


def test_same_image_is_encoded_once_across_and_within_requests() -> None:
    scheduler = make_scheduler()
    worker = FakeWorker(scheduler)
    r1 = _mm_request("r1", 40, {"x": (4, 16)})
    r2 = _mm_request("r2", 40, {"x": (8, 16)})
    r3 = make_request(
        "r3", list(range(1, 41)), mm_positions=[(0, 16), (20, 16)], mm_hashes=["z"] * 2
    )
    for request in (r1, r2, r3):
        scheduler.add_request(request)
    so = _step(scheduler, worker)
    assert so.scheduled_encoder_inputs == {"r1": [0], "r3": [0]}
    assert so.num_scheduled_tokens == {"r1": 40, "r2": 40, "r3": 40}
    stats = scheduler.make_stats()
    assert stats["encoder_cache_queries"] == 4 and stats["encoder_cache_hits"] == 2
    _run(scheduler, worker)
    assert worker.num_encoded == {"x": 1, "z": 1}
    assert_all_free(scheduler)


def test_freed_hash_is_reported_once_after_the_last_reference_and_eviction() -> None:
    scheduler = make_scheduler(
        max_num_batched_tokens=200,
        long_prefill_token_threshold=16,
        encoder_cache_size=60,
        max_num_encoder_input_tokens=60,
    )
    worker = FakeWorker(scheduler)
    r1 = _mm_request("r1", 44, {"x": (0, 40)}, max_tokens=1)
    r2 = _mm_request("r2", 56, {"x": (12, 40)}, max_tokens=1)  # consumes x one step later
    r3 = _mm_request("r3", 44, {"y": (0, 40)}, max_tokens=1)
    for request in (r1, r2, r3):
        scheduler.add_request(request)
    outputs = [_step(scheduler, worker) for _ in range(5)]
    assert [so.scheduled_encoder_inputs for so in outputs] == [
        {"r1": [0]},
        {},
        {},
        {},  # r1 is done with x, r2 still reads it: y cannot evict it
        {"r3": [0]},
    ]
    assert [so.free_encoder_mm_hashes for so in outputs] == [[], [], [], [], ["x"]]
    assert all("r3" not in so.num_scheduled_tokens for so in outputs[:4])
    rest = _run(scheduler, worker)
    assert all(not so.free_encoder_mm_hashes for so in rest)
    assert_all_free(scheduler)


def test_admission_rejects_items_that_can_never_be_encoded() -> None:
    scheduler = make_scheduler(encoder_cache_size=80, max_num_encoder_input_tokens=100)
    with pytest.raises(ValueError) as info:
        scheduler.add_request(_mm_request("big", 120, {"a": (0, 10), "b": (10, 90)}))
    message = str(info.value)
    for part in (
        "'big'",
        "image item 1",
        "90 encoder embeddings",
        "at most 80",
        "encoder_cache_size=80",
        "--encoder-cache-size",
    ):
        assert part in message
    assert not scheduler.has_unfinished_requests()
    scheduler = make_scheduler(encoder_cache_size=200, max_num_encoder_input_tokens=50)
    with pytest.raises(ValueError, match="--max-num-encoder-input-tokens"):
        scheduler.add_request(_mm_request("big", 80, {"a": (0, 60)}))
    scheduler.add_request(_mm_request("ok", 80, {"a": (0, 50)}))
    # Without chunked prefill all items of a prompt encode in the same step.
    scheduler = make_scheduler(
        enable_chunked_prefill=False, max_num_batched_tokens=1024, encoder_cache_size=50
    )
    with pytest.raises(ValueError, match="chunked prefill"):
        scheduler.add_request(_mm_request("two", 80, {"a": (0, 30), "b": (40, 30)}))
    scheduler.add_request(_mm_request("same", 80, {"a": (0, 30), "b": (40, 10)}))
    with pytest.raises(ValueError, match="largest multimodal item takes 81"):
        make_scheduler(encoder_cache_size=80, max_mm_item_embeds=81)


def test_livelock_scenario_with_several_large_items_completes() -> None:
    """vLLM #40707/#47738 shape: the cache holds one max-size item, each prompt has two of them
    behind a sub-block text gap, the token budget is small and not block aligned."""
    scheduler = make_scheduler(
        max_num_batched_tokens=24,
        block_size=16,
        encoder_cache_size=64,
        max_num_encoder_input_tokens=64,
        max_mm_item_embeds=64,
    )
    worker = FakeWorker(scheduler)
    layout = [(6, 64), (72, 64)]  # text 6, image, text 2, image, text 5
    hashes = [["a0", "a1"], ["b0", "b1"], ["b1", "c1"], ["a0", "a1"]]
    requests = make_requests(4, 141, mm_positions=[layout] * 4, mm_hashes=hashes, max_tokens=3)
    requests[3] = make_request(
        "repeat",
        requests[0].prompt_token_ids,
        max_tokens=3,
        mm_positions=layout,
        mm_hashes=hashes[0],
    )
    for request in requests:
        scheduler.add_request(request)
    _run(scheduler, worker, max_steps=200)
    assert all(r.num_output_tokens == 3 for r in requests)
    assert set(worker.num_encoded) == {"a0", "a1", "b0", "b1", "c1"}
    assert_all_free(scheduler)


def test_oldest_request_gets_its_item_while_small_items_keep_arriving() -> None:
    """Greedy younger requests could keep a slice of the cache pinned forever; once the oldest
    is refused for space the cache is closed to newcomers until it fits."""
    scheduler = make_scheduler(
        max_num_batched_tokens=100,
        long_prefill_token_threshold=8,
        encoder_cache_size=100,
        max_num_encoder_input_tokens=100,
    )
    worker = FakeWorker(scheduler)
    oldest = _mm_request("oldest", 112, {"big": (8, 100)}, max_tokens=1)
    scheduler.add_request(oldest)
    encoded_at = None
    for step in range(30):
        scheduler.add_request(_mm_request(f"young{step}", 20, {f"z{step}": (0, 16)}, max_tokens=1))
        so = _step(scheduler, worker)
        if so.scheduled_encoder_inputs.get("oldest") == [0]:
            encoded_at = step
    assert encoded_at is not None and encoded_at <= 3
    _run(scheduler, worker)
    assert_all_free(scheduler)


def _abort_after_two_chunks(scheduler: Scheduler, worker: FakeWorker) -> None:
    """Prefill [0, 32) of a prompt holding item x at [10, 42), then abort it: its blocks stay in
    the prefix cache and x stays in the encoder cache, unreferenced."""
    first = _mm_request("first", 48, {"x": (10, 32)}, max_tokens=1)
    scheduler.add_request(first)
    _step(scheduler, worker)
    _step(scheduler, worker)
    scheduler.finish_requests("first", RequestStatus.FINISHED_ABORTED)


def test_prefix_hit_inside_a_cached_item_reads_its_tail() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16, block_size=4)
    worker = FakeWorker(scheduler)
    _abort_after_two_chunks(scheduler, worker)
    again = _mm_request("first", 48, {"x": (10, 32)}, max_tokens=1)
    scheduler.add_request(again)
    so = _step(scheduler, worker)
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 32 and so.num_scheduled_tokens == {"first": 16}
    assert so.scheduled_encoder_inputs == {}
    _run(scheduler, worker)
    assert worker.num_encoded == {"x": 1}
    assert_all_free(scheduler)


def test_prefix_hit_inside_an_item_that_cannot_be_encoded_now_is_capped() -> None:
    scheduler = make_scheduler(
        max_num_batched_tokens=64,
        long_prefill_token_threshold=16,
        block_size=4,
        encoder_cache_size=40,
        max_num_encoder_input_tokens=40,
    )
    worker = FakeWorker(scheduler)
    _abort_after_two_chunks(scheduler, worker)
    holder = _mm_request("holder", 60, {"y": (0, 40)}, max_tokens=1)  # evicts x, holds y
    again = _mm_request("first", 48, {"x": (10, 32)}, max_tokens=1)
    scheduler.add_request(holder)
    scheduler.add_request(again)
    so = _step(scheduler, worker)
    assert so.scheduled_encoder_inputs == {"holder": [0]} and so.free_encoder_mm_hashes == ["x"]
    # 32 tokens were cached, but x cannot be re-encoded while y is held: the hit is cut back to
    # the block boundary before x, so the 2 text tokens ahead of it run now.
    assert so.num_scheduled_tokens == {"holder": 16, "first": 2}
    assert again.num_cached_tokens == 8
    _run(scheduler, worker)
    assert worker.num_encoded == {"x": 2, "y": 1}
    assert_all_free(scheduler)


def test_different_images_with_identical_tokens_never_share_blocks() -> None:
    scheduler = make_scheduler(block_size=4)
    worker = FakeWorker(scheduler)
    prompt = list(range(1000, 1040))
    cached, prompts = {}, []
    for req_id, identifier in (("a", "img-a"), ("b", "img-b"), ("a-again", "img-a")):
        request = make_request(req_id, prompt, mm_positions=[(8, 24)], mm_hashes=[identifier])
        prompts.append(request.prompt_token_ids)
        scheduler.add_request(request)
        _run(scheduler, worker)
        cached[req_id] = request.num_cached_tokens
    # b shares only the 2 text blocks ahead of the image; the same image and prompt share all
    # but the last block (the hit stops below the last token).
    assert cached == {"a": 0, "b": 8, "a-again": 36}
    assert prompts[0] == prompts[1] == prompts[2]  # identical placeholder tokens
    assert_all_free(scheduler)


def _random_mm_prompt(rng: random.Random, templates: list, pool: dict[str, PlaceholderRange]):
    """A prefix of a template (keeping its whole items) plus random text and maybe a new item."""
    tokens, items = rng.choice(templates)
    cut = rng.randrange(0, len(tokens) + 1)
    prompt = tokens[:cut]
    kept = [
        (offset, identifier)
        for offset, identifier in items
        if offset + pool[identifier].length <= cut
    ]
    prompt += [rng.randrange(1, 50) for _ in range(rng.randrange(1, 4))]
    if rng.random() < 0.3 and len(prompt) < 30:
        identifier = rng.choice(list(pool))
        kept.append((len(prompt), identifier))
        prompt += [0] * pool[identifier].length  # placeholder ids are filled in by make_request
    positions = [PlaceholderRange(o, pool[i].length, pool[i].is_embed) for o, i in kept]
    return prompt, positions, [identifier for _, identifier in kept]


def _make_templates(rng: random.Random, pool: dict[str, PlaceholderRange]) -> list:
    templates = []
    for _ in range(3):
        tokens, items = [], []
        for _ in range(2):
            tokens += [rng.randrange(1, 50) for _ in range(rng.randrange(1, 5))]
            identifier = rng.choice(list(pool))
            items.append((len(tokens), identifier))
            tokens += [0] * pool[identifier].length
        templates.append((tokens, items))
    return templates


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_randomized_stress_with_mm_items_keeps_invariants_and_frees_everything(seed: int) -> None:
    rng = random.Random(seed)
    scheduler = make_scheduler(
        block_size=4,
        num_blocks=14,
        max_model_len=48,
        max_num_batched_tokens=16,
        max_num_seqs=6,
        long_prefill_token_threshold=rng.choice([0, 6]),
        encoder_cache_size=14,
        max_num_encoder_input_tokens=rng.choice([12, 14]),
    )
    pool = {f"img{i}": PlaceholderRange(0, rng.randrange(4, 13)) for i in range(6)}
    pool["masked"] = PlaceholderRange(0, 8, [False, True, True, False, True, True, True, False])
    templates = _make_templates(rng, pool)
    encoder_hits = []

    def new_request(i: int) -> Request:
        prompt, positions, hashes = _random_mm_prompt(rng, templates, pool)
        encoder_hits.append(scheduler.make_stats()["encoder_cache_hits"])
        return make_request(
            f"r{i}",
            prompt,
            max_tokens=rng.randrange(1, 10),
            mm_positions=positions,
            mm_hashes=hashes,
            prompt_logprobs=1 if rng.random() < 0.1 else None,
        )

    worker = run_stress(scheduler, rng, new_request)
    assert encoder_hits[-1] > 0  # items were shared through the encoder cache
    assert sum(worker.num_encoded.values()) > len(worker.num_encoded)  # and re-encoded
