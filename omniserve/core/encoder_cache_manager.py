"""EncoderCacheManager: which encoder outputs the workers keep, counted in embeddings.

Bookkeeping only: the tensors live in the workers, in a dict keyed by item identifier. An entry is
shared by every request whose prompt holds the same item, and each (request, item index) that
still needs it holds one reference. Unreferenced entries stay cached (a later request may hit
them) until space is needed; then the least recently released go first and their identifiers are
reported to the workers through ``get_freed_mm_hashes``. Pure Python (no torch).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from omniserve.core.request import Request


@dataclass(slots=True)
class _Entry:
    num_embeds: int
    refs: set[tuple[str, int]] = field(default_factory=set)
    """(req_id, item index) pairs that still need this output."""


class EncoderCacheManager:
    """A bounded, shared, lazily evicted cache of encoder outputs.

    Space accounting (in embeddings, ``PlaceholderRange.num_embeds``):
    ``num_free_slots`` is held by no entry; ``num_freeable_slots`` adds the space of unreferenced
    entries, which ``can_allocate`` may evict.

    References are per item, not per request: a prompt holding the same image twice keeps the
    entry alive until both placeholders are consumed.
    """

    def __init__(self, cache_size: int) -> None:
        if cache_size < 0:
            raise ValueError(f"encoder cache size must be >= 0, got {cache_size}.")
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        self.num_freeable_slots = cache_size
        # identifier -> entry (referenced or freeable)
        self.entries: dict[str, _Entry] = {}
        # identifier -> num_embeds of unreferenced entries, least recently released first
        self.freeable: OrderedDict[str, int] = OrderedDict()
        # req_id -> indices of the request's items holding a reference
        self.req_to_items: dict[str, set[int]] = {}
        # Evicted since the last get_freed_mm_hashes(): the workers may drop these outputs.
        self.freed: list[str] = []

    @property
    def usage(self) -> float:
        """Fraction of the cache held by referenced entries (freeable ones count as free)."""
        if self.cache_size == 0:
            return 0.0
        return 1.0 - self.num_freeable_slots / self.cache_size

    def has_ref(self, request: Request, i: int) -> bool:
        return i in self.req_to_items.get(request.request_id, ())

    def referenced_items(self, request: Request) -> list[int]:
        """Indices of the request's items that hold a reference, in prompt order."""
        return sorted(self.req_to_items.get(request.request_id, ()))

    def check_and_update_cache(self, request: Request, i: int) -> bool:
        """True if item ``i``'s output is cached; then the item takes a reference to it."""
        identifier = request.mm_features[i].identifier
        entry = self.entries.get(identifier)
        if entry is None:
            return False
        if not entry.refs:
            del self.freeable[identifier]
            self.num_freeable_slots -= entry.num_embeds
        entry.refs.add((request.request_id, i))
        self.req_to_items.setdefault(request.request_id, set()).add(i)
        return True

    def can_allocate(
        self,
        request: Request,
        i: int,
        compute_budget: int,
        num_embeds_already_scheduled: int,
    ) -> bool:
        """Whether item ``i`` fits the remaining compute budget and, together with the
        ``num_embeds_already_scheduled`` this request plans to allocate this step, the cache.

        Evicts unreferenced entries (least recently released first) only when that makes the
        item fit; evicted identifiers are recorded for the workers.
        """
        num_embeds = request.mm_features[i].mm_position.num_embeds
        if num_embeds > compute_budget:
            return False
        num_needed = num_embeds + num_embeds_already_scheduled
        if num_needed > self.num_freeable_slots:
            return False
        while self.num_free_slots < num_needed:
            identifier, size = self.freeable.popitem(last=False)
            del self.entries[identifier]
            self.num_free_slots += size
            self.freed.append(identifier)
        return True

    def allocate(self, request: Request, i: int) -> None:
        """Reserve space for item ``i``'s output (to be encoded this step), referenced by it."""
        feature = request.mm_features[i]
        identifier, num_embeds = feature.identifier, feature.mm_position.num_embeds
        if identifier in self.entries:
            raise ValueError(f"Item {identifier!r} is already cached; reference it instead.")
        if num_embeds > self.num_free_slots:
            raise ValueError(
                f"Item {identifier!r} needs {num_embeds} embeddings, {self.num_free_slots} free; "
                "call can_allocate first."
            )
        self.entries[identifier] = _Entry(num_embeds, {(request.request_id, i)})
        self.num_free_slots -= num_embeds
        self.num_freeable_slots -= num_embeds
        self.req_to_items.setdefault(request.request_id, set()).add(i)
        # NOTE: evicted and re-encoded in the same step: the workers overwrite their copy, so they
        # must not also be told to drop it (whatever order they apply frees and encodes in).
        if identifier in self.freed:
            self.freed.remove(identifier)

    def reset(self) -> None:
        """Drop every unreferenced output (those requests still hold stay until released);
        the workers learn of them as of evictions."""
        for identifier, size in self.freeable.items():
            del self.entries[identifier]
            self.num_free_slots += size
            self.freed.append(identifier)
        self.freeable.clear()

    def free_encoder_input(self, request: Request, i: int) -> None:
        """Drop item ``i``'s reference; the last one makes the entry freeable, not freed."""
        items = self.req_to_items.get(request.request_id)
        if items is None or i not in items:
            return
        items.remove(i)
        if not items:
            del self.req_to_items[request.request_id]
        identifier = request.mm_features[i].identifier
        entry = self.entries[identifier]
        entry.refs.remove((request.request_id, i))
        if not entry.refs:
            self.freeable[identifier] = entry.num_embeds
            self.num_freeable_slots += entry.num_embeds

    def free(self, request: Request) -> None:
        """Drop every reference the request holds (finished, aborted or preempted)."""
        for i in self.referenced_items(request):
            self.free_encoder_input(request, i)

    def discard(self, identifiers: Iterable[str]) -> None:
        """Evict these unreferenced entries now (their outputs may never have been computed)."""
        for identifier in identifiers:
            entry = self.entries.get(identifier)
            if entry is None or entry.refs:
                continue
            del self.entries[identifier]
            del self.freeable[identifier]
            self.num_free_slots += entry.num_embeds
            self.freed.append(identifier)

    def get_freed_mm_hashes(self) -> list[str]:
        """Identifiers evicted since the last call (each reported once)."""
        freed, self.freed = self.freed, []
        return freed
