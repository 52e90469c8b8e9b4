"""What a device backend reports after it placed kernels on a loaded model's layers."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class KernelPlacement:
    """How many layers of each kind run on which implementation."""

    backend: str
    """The device backend that placed them ("CPU", "CUDA")."""
    placements: Counter[str] = field(default_factory=Counter)
    """"<layer kind>: <implementation>" -> number of layers."""

    def summary(self) -> str:
        if not self.placements:
            return f"{self.backend} backend: off (every layer on torch)"
        parts = [f"{count} {what}" for what, count in sorted(self.placements.items())]
        return f"{self.backend} backend: " + ", ".join(parts)
