"""ModelRegistry: architecture name -> model class, imported lazily on first use.

Entries are "module:Class" strings so that listing or validating architectures never imports
torch-heavy model code. Built-in models register through the same entry-point group as plugins.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelEntry:
    architecture: str
    target: str
    """"package.module:Class"."""
    source: str
    """Where the entry came from: "built-in", "entry point <name>", "user file", ..."""


class _ModelRegistry:
    def __init__(self) -> None:
        self._entries: dict[str, ModelEntry] = {}

    def register_model(
        self,
        architecture: str,
        target: str | type,
        *,
        source: str = "built-in",
        overwrite: bool = True,
    ) -> None:
        """Map ``architecture`` to a class or a lazy "module:Class" path."""
        if not isinstance(target, str):
            target = f"{target.__module__}:{target.__qualname__}"
        if ":" not in target:
            raise ValueError(f"Model target {target!r} must look like 'package.module:Class'.")
        if not overwrite and architecture in self._entries:
            raise ValueError(
                f"Architecture {architecture!r} is already registered "
                f"(by {self._entries[architecture].source})."
            )
        self._entries[architecture] = ModelEntry(architecture, target, source)

    def get_supported_archs(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[ModelEntry]:
        return [self._entries[a] for a in sorted(self._entries)]

    def is_supported(self, architecture: str) -> bool:
        return architecture in self._entries

    def resolve_model_cls(self, architecture: str) -> type:
        """Import and return the class for ``architecture``, or raise a precise error."""
        entry = self._entries.get(architecture)
        if entry is None:
            supported = ", ".join(self.get_supported_archs()) or "none"
            raise ValueError(
                f"Model architecture {architecture!r} is not supported. "
                f"Supported architectures: {supported}. Register a plugin with "
                "`omniserve register-model`."
            )
        module_name, _, class_name = entry.target.partition(":")
        try:
            module = importlib.import_module(module_name)
            return getattr(module, class_name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(
                f"Cannot import {entry.target!r} for architecture {architecture!r} "
                f"(from {entry.source}): {exc}"
            ) from exc


ModelRegistry = _ModelRegistry()
