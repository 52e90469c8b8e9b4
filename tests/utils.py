"""Factories and checkers for scheduler and cache tests: requests (text or with multimodal
items), schedulers, hand-made runner outputs, a fake worker and the scheduler's invariants."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from omniserve.config import CacheConfig, SchedulerConfig
from omniserve.core.request import Request, RequestStatus
from omniserve.core.sched_output import SchedulerOutput
from omniserve.core.scheduler import Scheduler
from omniserve.messages import LogprobsLists, ModelRunnerOutput
from omniserve.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from omniserve.sampling_params import SamplingParams

EOS_TOKEN_ID = 0
# Every placeholder position holds this id, as real prompts repeat one pad token per item.
MM_PLACEHOLDER_TOKEN_ID = 999

MMPositions = Sequence[tuple[int, int] | PlaceholderRange]


def make_scheduler(
    *,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    max_model_len: int = 1024,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    block_size: int = 16,
    num_blocks: int = 10_000,
    enable_prefix_caching: bool = True,
    max_num_encoder_input_tokens: int = 8192,
    encoder_cache_size: int = 8192,
    max_mm_item_embeds: int = 0,
    policy: str = "fcfs",
    max_loras: int = 0,
    disable_chunked_mm_input: bool = False,
    max_num_partial_prefills: int | None = None,
    max_long_partial_prefills: int | None = None,
    prefix_caching_hash_algo: str = "sha256",
) -> Scheduler:
    scheduler_config = SchedulerConfig(
        max_num_partial_prefills=max_num_partial_prefills,
        max_long_partial_prefills=max_long_partial_prefills,
        policy=policy,
        disable_chunked_mm_input=disable_chunked_mm_input,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
        max_num_encoder_input_tokens=max_num_encoder_input_tokens,
        encoder_cache_size=encoder_cache_size,
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                               prefix_caching_hash_algo=prefix_caching_hash_algo)  # fmt: skip
    return Scheduler(
        scheduler_config, cache_config, num_blocks, max_mm_item_embeds, max_loras=max_loras
    )


def make_mm_features(
    positions: MMPositions, identifiers: Sequence[str], modality: str = "image"
) -> list[MultiModalFeatureSpec]:
    """One feature per ``(offset, length)`` (or ``PlaceholderRange``), in the order given."""
    ranges = [p if isinstance(p, PlaceholderRange) else PlaceholderRange(*p) for p in positions]
    return [
        MultiModalFeatureSpec(modality, identifier, pos)
        for pos, identifier in zip(ranges, identifiers, strict=True)
    ]


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    *,
    max_tokens: int = 16,
    eos_token_id: int | None = EOS_TOKEN_ID,
    mm_positions: MMPositions = (),
    mm_hashes: Sequence[str] | None = None,
    **sampling: object,
) -> Request:
    """``mm_positions`` place multimodal items (their prompt positions become
    ``MM_PLACEHOLDER_TOKEN_ID``); ``mm_hashes`` are their identifiers (default: unique per
    request and item)."""
    params = SamplingParams(max_tokens=max_tokens, **sampling)  # type: ignore[arg-type]
    if mm_hashes is None:
        mm_hashes = [f"{request_id}-item{i}" for i in range(len(mm_positions))]
    mm_features = make_mm_features(mm_positions, mm_hashes)
    prompt = list(prompt_token_ids)
    for feature in mm_features:
        pos = feature.mm_position
        prompt[pos.offset : pos.end] = [MM_PLACEHOLDER_TOKEN_ID] * pos.length
    assert len(prompt) == len(prompt_token_ids), "placeholder range past the prompt"
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=params,
        eos_token_id=eos_token_id,
        max_tokens=max_tokens,
        mm_features=mm_features,
    )


def make_requests(
    num: int,
    num_tokens: int,
    *,
    same_prompt: bool = False,
    prefix: str = "req",
    mm_positions: Sequence[MMPositions] | None = None,
    mm_hashes: Sequence[Sequence[str]] | None = None,
    **kwargs: object,
) -> list[Request]:
    """``num`` requests of ``num_tokens`` prompt tokens each; distinct prompts unless asked.

    ``mm_positions[i]`` / ``mm_hashes[i]`` give request i's multimodal items (see
    ``make_request``). Prompt ids start at 1000 so they never collide with the eos id, test stop
    tokens or the placeholder id.
    """
    requests = []
    for i in range(num):
        start = 1000 if same_prompt else 1000 + i * num_tokens
        prompt = list(range(start, start + num_tokens))
        mm_kwargs = {
            "mm_positions": mm_positions[i] if mm_positions else (),
            "mm_hashes": mm_hashes[i] if mm_hashes else None,
        }
        requests.append(make_request(f"{prefix}-{i}", prompt, **mm_kwargs, **kwargs))  # type: ignore[arg-type]
    return requests


def make_runner_output(
    scheduler: Scheduler,
    scheduler_output: SchedulerOutput,
    next_token: Callable[[Request], int] | None = None,
    prompt_logprobs: bool = False,
) -> ModelRunnerOutput:
    """What a model runner would return: one token for each request whose step reaches the end
    of its known tokens, nothing for partial prefills. ``next_token`` picks the token
    (default: 1 + the request's number of output tokens, never the eos id)."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled: list[list[int]] = []
    runner_prompt_logprobs: dict[str, LogprobsLists] = {}
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        # schedule() already advanced num_computed_tokens by this step's tokens.
        if request.num_computed_tokens >= request.num_tokens:
            sampled.append([next_token(request) if next_token else request.num_output_tokens + 1])
        else:
            sampled.append([])
        if prompt_logprobs:
            num = scheduler_output.num_scheduled_tokens[req_id]
            runner_prompt_logprobs[req_id] = LogprobsLists([[7]] * num, [[-0.5]] * num, [1] * num)
    return ModelRunnerOutput(
        req_ids=req_ids, sampled_token_ids=sampled, prompt_logprobs=runner_prompt_logprobs
    )


def run_to_completion(
    scheduler: Scheduler,
    max_steps: int = 10_000,
    next_token: Callable[[Request], int] | None = None,
) -> dict[str, list[int]]:
    """Step until nothing is left; return every request's output tokens (req_id -> tokens)."""
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return tokens
        scheduler_output = scheduler.schedule()
        runner_output = make_runner_output(scheduler, scheduler_output, next_token)
        for output in scheduler.update_from_output(scheduler_output, runner_output).outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def _slot_content(request: Request, pos: int) -> tuple[int, str | None, int]:
    """What decides the KV at ``pos``: its token and, inside a placeholder, the item and the
    position's index within it (two images with the same pad tokens must differ here)."""
    for feature in request.mm_features:
        if feature.mm_position.offset <= pos < feature.mm_position.end:
            return request.all_token_ids[pos], feature.identifier, pos - feature.mm_position.offset
    return request.all_token_ids[pos], None, 0


class FakeWorker:
    """Mirrors a model runner from step outputs alone: block tables, what each KV slot holds and
    which encoder outputs it keeps. Every computed position must read its own request's content
    (prefix sharing, preemption and resumption included), every embedding a step consumes must
    be in its encoder cache, and that cache must match the scheduler's entries exactly."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.block_size = scheduler.block_size
        self.scheduler = scheduler
        self.block_tables: dict[str, list[int]] = {}
        self.slots: list[list[tuple | None]] = [
            [None] * self.block_size
            for _ in range(scheduler.kv_cache_manager.block_pool.num_blocks)
        ]
        # identifier -> num_embeds of the outputs held
        self.encoder_cache: dict[str, int] = {}
        # identifier -> how many times it was encoded
        self.num_encoded: Counter[str] = Counter()

    def execute(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.block_tables.pop(req_id, None)
        num_computed = {}
        for new in so.scheduled_new_reqs:
            self.block_tables[new.req_id] = list(new.block_ids)
            num_computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for req_id, block_ids, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            self.block_tables[req_id].extend(block_ids)
            num_computed[req_id] = computed
        for src, dst in so.kv_block_copies.values():
            self.slots[dst] = list(self.slots[src])
        self._run_encoder(so)
        bs = self.block_size
        for req_id, num_tokens in so.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            table = self.block_tables[req_id]
            assert table == self.scheduler.kv_cache_manager.get_block_ids(req_id)
            start = num_computed[req_id]
            for pos in range(start):
                assert self.slots[table[pos // bs]][pos % bs] == _slot_content(request, pos)
            for feature in request.mm_features:
                lo, hi = feature.mm_position.embeds_in(start, start + num_tokens)
                if lo < hi:
                    assert self.encoder_cache[feature.identifier] >= hi
            for pos in range(start, start + num_tokens):
                self.slots[table[pos // bs]][pos % bs] = _slot_content(request, pos)

    def _run_encoder(self, so: SchedulerOutput) -> None:
        for identifier in so.free_encoder_mm_hashes:
            del self.encoder_cache[identifier]  # KeyError: freed something never encoded
        for req_id, items in so.scheduled_encoder_inputs.items():
            for i in items:
                feature = self.scheduler.requests[req_id].mm_features[i]
                self.encoder_cache[feature.identifier] = feature.mm_position.num_embeds
                self.num_encoded[feature.identifier] += 1
        assert set(self.encoder_cache) == set(self.scheduler.encoder_cache_manager.entries)


def check_invariants(scheduler: Scheduler, so: SchedulerOutput) -> None:
    """Budgets, queue membership, block ownership and refcounts right after ``schedule()``."""
    config = scheduler.scheduler_config
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    assert so.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert all(n > 0 for n in so.num_scheduled_tokens.values())
    assert len(scheduler.running) <= config.max_num_seqs
    running_ids = [r.request_id for r in scheduler.running]
    waiting_ids = [r.request_id for r in scheduler.waiting]
    assert sorted(running_ids + waiting_ids) == sorted(scheduler.requests)
    assert set(kv.req_to_blocks) == set(running_ids)
    owners: Counter[int] = Counter()
    for req_id, blocks in kv.req_to_blocks.items():
        request = scheduler.requests[req_id]
        assert len(set(map(id, blocks))) == len(blocks)
        assert len(blocks) == -(-request.num_computed_tokens // scheduler.block_size)
        for i, block in enumerate(blocks):
            owners[block.block_id] += 1
            if block.block_hash is not None:
                assert block.block_hash == request.block_hashes[i]
    for block in pool.blocks:
        assert block.ref_cnt == owners[block.block_id]
        assert owners[block.block_id] <= 1 or block.block_hash is not None  # only cached sharing
    free_ids = pool.free_block_queue.block_ids()
    assert sorted(free_ids) == [b.block_id for b in pool.blocks if b.ref_cnt == 0]
    _check_encoder_invariants(scheduler, so, set(running_ids))


def _check_encoder_invariants(
    scheduler: Scheduler, so: SchedulerOutput, running_ids: set[str]
) -> None:
    cache = scheduler.encoder_cache_manager
    encoded = [
        scheduler.requests[req_id].mm_features[i]
        for req_id, items in so.scheduled_encoder_inputs.items()
        for i in items
    ]
    identifiers = [feature.identifier for feature in encoded]
    assert len(set(identifiers)) == len(identifiers)  # each output encoded once per step
    assert not set(identifiers) & set(so.free_encoder_mm_hashes)
    num_embeds = sum(feature.mm_position.num_embeds for feature in encoded)
    assert num_embeds <= scheduler.scheduler_config.max_num_encoder_input_tokens
    # Space accounting and references.
    sizes = {identifier: entry.num_embeds for identifier, entry in cache.entries.items()}
    unreferenced = {identifier for identifier, entry in cache.entries.items() if not entry.refs}
    assert set(cache.freeable) == unreferenced
    assert cache.num_free_slots == cache.cache_size - sum(sizes.values()) >= 0
    assert cache.num_freeable_slots == cache.num_free_slots + sum(cache.freeable.values())
    refs = {(req_id, i) for req_id, items in cache.req_to_items.items() for i in items}
    assert refs == {ref for entry in cache.entries.values() for ref in entry.refs}
    assert {req_id for req_id, _ in refs} <= running_ids  # only running requests pin outputs
    for req_id, i in refs:
        feature = scheduler.requests[req_id].mm_features[i]
        assert cache.entries[feature.identifier].num_embeds == feature.mm_position.num_embeds
    # Every embedding a scheduled window consumes is referenced by that request.
    for req_id, num_tokens in so.num_scheduled_tokens.items():
        request = scheduler.requests[req_id]
        start = request.num_computed_tokens - num_tokens
        for i, feature in enumerate(request.mm_features):
            lo, hi = feature.mm_position.embeds_in(start, start + num_tokens)
            if lo < hi:
                assert cache.has_ref(request, i)


def assert_all_free(scheduler: Scheduler) -> None:
    """Nothing unfinished, every KV block free, no encoder output referenced."""
    kv = scheduler.kv_cache_manager
    assert not scheduler.has_unfinished_requests()
    assert kv.block_pool.num_free_blocks == kv.block_pool.num_blocks
    assert kv.req_to_blocks == {} and kv.usage == 0.0
    cache = scheduler.encoder_cache_manager
    assert cache.req_to_items == {} and cache.usage == 0.0
    assert cache.num_freeable_slots == cache.cache_size


def run_stress(
    scheduler: Scheduler,
    rng: random.Random,
    new_request: Callable[[int], Request],
    steps: int = 400,
) -> FakeWorker:
    """Random arrivals (while steps remain), aborts (also mid-step) and eos, checking every
    step's invariants; ends by aborting what is left and asserting every resource is free."""
    worker = FakeWorker(scheduler)
    num_added = 0
    for step in range(steps):
        if step < steps * 3 // 4 and rng.random() < 0.4:
            scheduler.add_request(new_request(num_added))
            num_added += 1
        if scheduler.requests and rng.random() < 0.03:
            scheduler.finish_requests(
                rng.choice(list(scheduler.requests)), RequestStatus.FINISHED_ABORTED
            )
        if not scheduler.has_unfinished_requests():
            continue
        so = scheduler.schedule()
        check_invariants(scheduler, so)
        worker.execute(so)
        runner_output = make_runner_output(
            scheduler,
            so,
            next_token=lambda r: EOS_TOKEN_ID if rng.random() < 0.05 else rng.randrange(1, 50),
        )
        if so.num_scheduled_tokens and rng.random() < 0.03:  # abort while the step runs
            scheduler.finish_requests(
                rng.choice(list(so.num_scheduled_tokens)), RequestStatus.FINISHED_ABORTED
            )
        for output in scheduler.update_from_output(so, runner_output).outputs:
            assert output.request_id not in scheduler.requests or not output.finished
    stats = scheduler.make_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    scheduler.finish_requests(list(scheduler.requests), RequestStatus.FINISHED_ABORTED)
    scheduler.schedule()
    assert_all_free(scheduler)
    return worker


def steps_never_synchronizing(engine: Any, num_steps: int) -> None:
    """Run ``num_steps`` engine steps with CUDA's sync debug mode on "error" (any op that waits
    for the device raises, naming itself), then the rest of the engine's work as usual."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(num_steps):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    while engine.has_unfinished_requests():
        engine.step()
