"""The processor cache: processed tensors of recent items, keyed by item hash.

A repeated image (the same picture in a multi-turn chat, a popular attachment) skips the Hugging
Face processor entirely. Bounded in bytes (``--mm-processor-cache-gb``), least recently used
first out. Lives in the front end next to the processor; thread-safe so a processor pool can share
one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

_GIB = 1 << 30


@dataclass(frozen=True)
class ProcessorCacheStats:
    hits: int
    misses: int
    num_items: int
    size_bytes: int
    capacity_bytes: int

    @property
    def hit_rate(self) -> float:
        queries = self.hits + self.misses
        return self.hits / queries if queries else 0.0


class ProcessorCache:
    """LRU of ``identifier -> {name: Tensor}``, evicting by total tensor bytes."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}.")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, tuple[dict[str, Any], int]] = OrderedDict()
        self._size_bytes = 0
        self._hits = 0
        self._misses = 0
        self._lock = threading.Lock()

    @classmethod
    def from_gb(cls, gb: float) -> ProcessorCache | None:
        """The cache for ``--mm-processor-cache-gb``; None when 0 (caching disabled)."""
        if gb < 0:
            raise ValueError(f"mm_processor_cache_gb must be >= 0, got {gb}.")
        return cls(int(gb * _GIB)) if gb > 0 else None

    def get(self, key: str, *, count: bool = True) -> dict[str, Any] | None:
        """The item's tensors (a fresh dict; do not modify the tensors), counting a hit or miss
        (not for ``count=False``: lookups of media kept by uuid, which are not processing)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._misses += count
                return None
            self._entries.move_to_end(key)
            self._hits += count
            return dict(entry[0])

    def put(self, key: str, data: Mapping[str, Any]) -> None:
        """Store an item, evicting the least recently used ones; an item larger than the whole
        cache is not stored."""
        size = item_nbytes(data)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._size_bytes -= old[1]
            if size > self.capacity_bytes:
                return
            while self._size_bytes + size > self.capacity_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._size_bytes -= evicted
            self._entries[key] = (dict(data), size)
            self._size_bytes += size

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        return self._size_bytes

    def stats(self) -> ProcessorCacheStats:
        with self._lock:
            return ProcessorCacheStats(
                self._hits, self._misses, len(self._entries), self._size_bytes, self.capacity_bytes
            )

    def reset(self) -> None:
        """Drop every entry (the counters keep counting)."""
        with self._lock:
            self._entries.clear()
            self._size_bytes = 0


def item_nbytes(data: Mapping[str, Any]) -> int:
    """Bytes an entry holds: processed tensors, or the media kept under a uuid (arrays, images,
    (waveform, rate) pairs, loaded videos); other values count as nothing."""
    return sum(_nbytes(value) for value in data.values())


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, Image.Image):
        return value.width * value.height * len(value.getbands())
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    frames = getattr(value, "frames", None)  # a loaded video (media.VideoItem)
    return _nbytes(frames) if frames is not None else 0
