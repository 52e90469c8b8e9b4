"""ModelRegistry: architecture name -> model class, imported lazily on first use.

Entries are "module:Class" strings so that listing or validating architectures never imports
torch-heavy model code. Built-in models register through the same entry-point group as plugins.

Two layers: entries from code (the built-in zoo and entry-point plugins) and entries from the
user's registry file (``omniserve register-model``). The user layer wins a lookup, so a user can
deliberately override a built-in architecture (``register-model`` asks for ``--force`` first);
removing the user entry brings the built-in back.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

USER_FILE_SOURCE = "user file"


@dataclass(frozen=True)
class ModelEntry:
    architecture: str
    target: str
    """"package.module:Class"."""
    source: str
    """Where the entry came from: "built-in", "entry point <name>", "user file", ..."""
    processor: str | None = None
    """"package.module:Class" of a ``BaseMultiModalProcessor`` that declares ``info_cls`` and
    ``dummy_inputs_cls``; None: the processor attached to the model class (if any)."""
    modalities: tuple[str, ...] | None = None
    """Input modalities besides text, if declared at registration; None: unknown until the
    classes are imported."""


def import_target(target: str) -> type:
    """Import "package.module:Class"; ImportError/AttributeError propagate for the caller."""
    module_name, _, class_name = target.partition(":")
    obj: object = importlib.import_module(module_name)
    for part in class_name.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise TypeError(f"{target!r} is a {type(obj).__name__}, not a class")
    return obj


T = TypeVar("T")


def load_class(spec: object, where: str) -> type:
    """The class a setting names: itself, ``module:Class`` or ``module.Class``; ValueError
    naming ``where`` (the setting) when it does not import or is no class."""
    if not isinstance(spec, str):
        if not isinstance(spec, type):
            raise ValueError(f"{where}: {spec!r} is not a class.")
        return spec
    module, sep, name = spec.partition(":")
    if not sep:
        module, _, name = spec.rpartition(".")
    if not module or not name:
        raise ValueError(f"{where}: {spec!r} is not module:Class (or module.Class).")
    try:
        return import_target(f"{module}:{name}")
    except ImportError as exc:
        raise ValueError(f"{where}: cannot import {module!r} for {spec!r}: {exc}") from exc
    except AttributeError:
        raise ValueError(f"{where}: module {module!r} has no {name!r} ({spec!r}).") from None
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}.") from None


def load_subclass(spec: str, base: type[T], where: str) -> type[T]:
    """``load_class``'s class, which must be ``base`` or a subclass of it (vLLM's settings that
    name a scheduler or a worker class)."""
    cls = load_class(spec, where)
    if not issubclass(cls, base):
        raise ValueError(f"{where} {spec}: {cls.__qualname__} is not a subclass of "
                         f"{base.__module__}.{base.__qualname__}.")  # fmt: skip
    return cls


class _ModelRegistry:
    def __init__(self) -> None:
        self._entries: dict[str, ModelEntry] = {}
        self._user_entries: dict[str, ModelEntry] = {}
        self._default_source = "built-in"

    @contextlib.contextmanager
    def registering_as(self, source: str) -> Iterator[None]:
        """Label the entries registered inside the block (load_plugins: "entry point <name>")."""
        previous, self._default_source = self._default_source, source
        try:
            yield
        finally:
            self._default_source = previous

    def register_model(
        self,
        architecture: str,
        target: str | type,
        *,
        processor: str | type | None = None,
        modalities: Iterable[str] | None = None,
        source: str | None = None,
        overwrite: bool = True,
    ) -> None:
        """Map ``architecture`` to a class or a lazy "module:Class" path (and optionally its
        multimodal processor, which then replaces the one attached to the model class)."""
        target = _as_target(target, "Model")
        processor = None if processor is None else _as_target(processor, "Processor")
        if not overwrite and architecture in self._entries:
            raise ValueError(
                f"Architecture {architecture!r} is already registered "
                f"(by {self._entries[architecture].source})."
            )
        declared = None if modalities is None else tuple(modalities)
        entry = ModelEntry(
            architecture, target, source or self._default_source, processor, declared
        )
        self._entries[architecture] = entry

    def set_user_entries(self, entries: Iterable[ModelEntry]) -> None:
        """Replace the user-file layer (``load_plugins`` calls this when the file changes)."""
        self._user_entries = {entry.architecture: entry for entry in entries}

    def get_supported_archs(self) -> list[str]:
        return sorted(self._entries.keys() | self._user_entries.keys())

    def get_entry(self, architecture: str) -> ModelEntry | None:
        """The entry a lookup of ``architecture`` uses (the user file's first)."""
        return self._user_entries.get(architecture) or self._entries.get(architecture)

    def get_code_entry(self, architecture: str) -> ModelEntry | None:
        """The built-in or entry-point entry, ignoring any user-file override."""
        return self._entries.get(architecture)

    def entries(self) -> list[ModelEntry]:
        found = (self.get_entry(a) for a in self.get_supported_archs())
        return [entry for entry in found if entry is not None]

    def is_supported(self, architecture: str) -> bool:
        return self.get_entry(architecture) is not None

    def resolve_model_cls(self, architecture: str) -> type:
        """Import and return the class for ``architecture``, or raise a precise error."""
        entry = self.get_entry(architecture)
        if entry is None:
            supported = ", ".join(self.get_supported_archs()) or "none"
            raise ValueError(
                f"Model architecture {architecture!r} is not supported. "
                f"Supported architectures: {supported}. Register a plugin with "
                "`omniserve register-model`."
            )
        return _import_for(entry, entry.target)

    def resolve_processor_cls(self, architecture: str) -> type | None:
        """The processor class registered for ``architecture``, or None when the model class
        carries its own (``MULTIMODAL_REGISTRY.register_processor``) or is text-only."""
        entry = self.get_entry(architecture)
        if entry is None or entry.processor is None:
            return None
        return _import_for(entry, entry.processor)


def _as_target(target: str | type, what: str) -> str:
    if not isinstance(target, str):
        target = f"{target.__module__}:{target.__qualname__}"
    module_name, _, class_name = target.partition(":")
    if not module_name or not class_name:
        raise ValueError(f"{what} target {target!r} must look like 'package.module:Class'.")
    return target


def _import_for(entry: ModelEntry, target: str) -> type:
    try:
        return import_target(target)
    except Exception as exc:  # a plugin's module may fail in any way while importing
        raise ValueError(
            f"Cannot import {target!r} for architecture {entry.architecture!r} "
            f"(from {entry.source}): {type(exc).__name__}: {exc}"
        ) from exc


ModelRegistry = _ModelRegistry()
