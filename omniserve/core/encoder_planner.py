"""Which multimodal items a request encodes this step, and how far its token window may reach.

The scheduler's rules for encoder inputs (vLLM V1 semantics), kept apart from ``scheduler.py``:

- An item's encoder run is never split (encoders attend bidirectionally): it is encoded whole, in
  the step whose token window first needs its embeddings. The decoder may then consume those
  embeddings over several chunks, reading them from the encoder cache.
- An item that does not fit this step's encoder compute budget (``max_num_encoder_input_tokens``)
  or the encoder cache cuts the window just before its placeholder (precisely: before the first
  position that would need one of its embeddings; 0 tokens if the window starts past that).
- With ``disable_chunked_mm_input``, a window that starts before an item and would end inside
  its placeholder ends before it (vLLM's rule); a window starting at or inside it is not cut, so
  an item larger than a step's budget still runs.
- Progress: once an item is refused for lack of cache space, the cache is closed for the rest of
  the step: later requests take no new references (no new entries, no hits), so they only drain
  what they already hold. The first request refused (the oldest, in scheduling order) thus gets
  its item once the running requests holding entries have consumed them (or were preempted);
  greedy younger requests cannot keep the cache pinned (vLLM's multi-image livelock).

Limits (checked at admission and start-up): an item must fit both the budget and the cache, so the
largest item allowed is ``min(encoder_cache_size, max_num_encoder_input_tokens)``. The two need
not be ordered: a cache smaller than the budget simply caps what one step can encode. Sizes are
explicit config values, never grown silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omniserve.config import SchedulerConfig
from omniserve.core.encoder_cache_manager import EncoderCacheManager
from omniserve.core.request import Request
from omniserve.multimodal.inputs import PlaceholderRange

_FLAGS = {
    "encoder_cache_size": "--encoder-cache-size",
    "max_num_encoder_input_tokens": "--max-num-encoder-input-tokens",
}


@dataclass(slots=True)
class EncoderPlan:
    """One request's encoder decisions for this step, committed only if it gets its KV slots."""

    num_new_tokens: int
    """The token window after cutting before the first item that could not be scheduled."""
    encode: list[int] = field(default_factory=list)
    """Items to encode this step (whole), in prompt order."""
    share: list[int] = field(default_factory=list)
    """Items repeating the identifier of one in ``encode``: they reference its output."""
    num_hits: int = 0
    """Items that newly referenced an output already in the cache."""
    num_embeds: int = 0
    """Encoder budget spent by ``encode``."""
    blocked_item: int | None = None
    """The item the window was cut before (None: not cut)."""
    blocked_by_cache: bool = False
    """The cut was for cache space (or a closed cache), not the compute budget."""


def plan_encoder_inputs(
    request: Request,
    num_computed_tokens: int,
    num_new_tokens: int,
    encoder_budget: int,
    cache: EncoderCacheManager,
    cache_open: bool = True,
    whole_items: bool = False,
) -> EncoderPlan:
    """Walk the items overlapping ``[num_computed, num_computed + num_new)`` in prompt order.

    Hits take their cache reference right away, so evicting for a later item of the same window
    cannot drop them; entries to encode are only reserved by ``commit_encoder_plan``.
    """
    plan = EncoderPlan(num_new_tokens)
    window_end = num_computed_tokens + num_new_tokens
    planned: set[str] = set()  # identifiers of the items in ``plan.encode``
    for i, feature in enumerate(request.mm_features):
        pos = feature.mm_position
        if pos.offset >= window_end:
            break
        if pos.end <= num_computed_tokens or cache.has_ref(request, i):
            continue  # already in the KV cache, or its output is already held for this request
        if whole_items and num_computed_tokens < pos.offset and window_end < pos.end:
            plan.num_new_tokens = pos.offset - num_computed_tokens
            break
        lo, hi = pos.embeds_in(num_computed_tokens, window_end)
        if lo == hi:
            continue  # this window's part of the placeholder takes no embeddings
        budget_left = encoder_budget - plan.num_embeds
        if cache_open:
            if feature.identifier in planned:
                plan.share.append(i)
                continue
            if cache.check_and_update_cache(request, i):
                plan.num_hits += 1
                continue
            if cache.can_allocate(request, i, budget_left, plan.num_embeds):
                plan.encode.append(i)
                plan.num_embeds += pos.num_embeds
                planned.add(feature.identifier)
                continue
        first_embed = _first_embed_position(feature.mm_position, num_computed_tokens)
        plan.num_new_tokens = first_embed - num_computed_tokens
        plan.blocked_item = i
        plan.blocked_by_cache = not cache_open or pos.num_embeds <= budget_left
        break
    return plan


def _first_embed_position(pos: PlaceholderRange, start: int) -> int:
    """The first prompt position at or after ``start`` that takes one of the item's embeddings
    (the window is cut just before it; positions before it keep their token embeddings)."""
    first = max(start, pos.offset)
    if pos.is_embed is not None:
        first += pos.is_embed[first - pos.offset :].index(True)
    return first


def hit_limit_for_blocked_plan(request: Request, plan: EncoderPlan, block_size: int) -> int:
    """Where a prefix hit should end when the plan got no tokens: the last block boundary before
    the blocking item's first embedding, so the text ahead of it can run meanwhile (a prefix hit
    inside an item that cannot be encoded now would leave nothing to run). Returns
    ``num_tokens`` (no limit) when nothing blocked."""
    if plan.num_new_tokens > 0 or plan.blocked_item is None:
        return request.num_tokens
    position = _first_embed_position(request.mm_features[plan.blocked_item].mm_position, 0)
    return position // block_size * block_size


def commit_encoder_plan(request: Request, plan: EncoderPlan, cache: EncoderCacheManager) -> None:
    """Reserve the planned entries (the request got its KV slots and runs this step)."""
    for i in plan.encode:
        cache.allocate(request, i)
    for i in plan.share:
        cache.check_and_update_cache(request, i)


def free_consumed_encoder_inputs(request: Request, cache: EncoderCacheManager) -> None:
    """Drop the references of items whose placeholders are all in the KV cache now."""
    for i in cache.referenced_items(request):
        if request.mm_features[i].mm_position.end <= request.num_computed_tokens:
            cache.free_encoder_input(request, i)


def _item_limit(config: SchedulerConfig) -> tuple[int, str]:
    """The largest item any step can encode, and the config field that sets it."""
    if config.encoder_cache_size <= config.max_num_encoder_input_tokens:
        return config.encoder_cache_size, "encoder_cache_size"
    return config.max_num_encoder_input_tokens, "max_num_encoder_input_tokens"


def _limits_text(config: SchedulerConfig, limiting: str) -> str:
    return (
        f"encoder_cache_size={config.encoder_cache_size}, "
        f"max_num_encoder_input_tokens={config.max_num_encoder_input_tokens} "
        f"(raise {limiting}, flag {_FLAGS[limiting]})"
    )


def check_encoder_limits(config: SchedulerConfig, max_item_embeds: int) -> None:
    """Start-up check: the model's largest item (in embeddings) must be schedulable."""
    limit, limiting = _item_limit(config)
    if max_item_embeds > limit:
        raise ValueError(
            f"The model's largest multimodal item takes {max_item_embeds} encoder embeddings, "
            f"but at most {limit} fit one step: {_limits_text(config, limiting)}, or cap the "
            "item size (e.g. mm_processor_kwargs max_pixels / num_frames)."
        )


def check_request_items(request: Request, config: SchedulerConfig) -> None:
    """Admission check: reject a request holding an item no step could ever encode."""
    limit, limiting = _item_limit(config)
    for i, feature in enumerate(request.mm_features):
        num_embeds = feature.mm_position.num_embeds
        if num_embeds > limit:
            raise ValueError(
                f"Request {request.request_id!r}: {feature.modality} item {i} needs "
                f"{num_embeds} encoder embeddings, but at most {limit} fit one step: "
                f"{_limits_text(config, limiting)}, or send a smaller {feature.modality}."
            )
    if config.enable_chunked_prefill:
        return
    # Without chunked prefill the whole prompt runs in one step, so all its items encode at once.
    sizes = {f.identifier: f.mm_position.num_embeds for f in request.mm_features}
    if sum(sizes.values()) > limit:
        raise ValueError(
            f"Request {request.request_id!r}: without chunked prefill its {len(sizes)} distinct "
            f"multimodal items ({sum(sizes.values())} encoder embeddings) must encode in one "
            f"step, but at most {limit} fit: {_limits_text(config, limiting)}, or enable "
            "chunked prefill."
        )
