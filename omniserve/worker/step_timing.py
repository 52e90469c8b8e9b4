"""Where a model runner's steps spend their time, part by part, for benchmarks and profiling.

Off by default, when each part costs one no-op context. ``start`` zeroes the counters and turns
timing on; ``snapshot`` reads them. On CUDA each timed part is bracketed by synchronizes while
timing is on, so the figures are device time, at the price of the overlap they remove.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

PARTS = (
    "encoders",
    "prefill steps: forward + logits",
    "decode steps: forward + logits",
    "sampler",
    "drafts",
    "speech stage",
)
"""A step whose requests compute any prompt token is a prefill step; the rest decode."""


_OFF = contextlib.nullcontext()


class StepTimer:
    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self.enabled = False
        self._zero()

    def _zero(self) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.steps = {"prefill": 0, "decode": 0}

    def start(self) -> None:
        self._zero()
        self.enabled = True

    def snapshot(self) -> dict[str, dict[str, float]]:
        """``{"seconds": part -> seconds, "steps": phase -> count}`` since ``start``."""
        return {
            "seconds": dict(self.seconds),
            "steps": {k: float(v) for k, v in self.steps.items()},
        }

    def count_step(self, prefill: bool) -> None:
        if self.enabled:
            self.steps["prefill" if prefill else "decode"] += 1

    def part(self, name: str) -> contextlib.AbstractContextManager[None]:
        """A context that times ``name``; while timing is off, one shared no-op (no generator
        is made on the runner's hot path)."""
        return self._timed(name) if self.enabled else _OFF

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        self._synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._synchronize()
            self.seconds[name] += time.perf_counter() - start

    def _synchronize(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()
