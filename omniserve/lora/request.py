"""Which adapter a request runs with (vLLM's ``LoRARequest``), and the one-step limit on them.

Pure Python: the scheduler and the front end use it, the workers receive it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Protocol

import msgspec

from omniserve.config.lora import LoRAConfig


class LoRARequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """An adapter by name, a positive id unique to it in this engine, and its PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    """The served model it adapts (listed as its parent by ``/v1/models``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}.")
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string.")


def default_mm_lora_requests(config: LoRAConfig | None) -> dict[str, LoRARequest]:
    """``--default-mm-loras`` (modality -> path) as adapters, as vLLM names them: after their
    modality, with ids 1 to n in the modalities' alphabetical order."""
    paths = config.default_mm_loras if config is not None else {}
    return {modality: LoRARequest(modality, i, paths[modality])
            for i, modality in enumerate(sorted(paths), 1)}  # fmt: skip


def with_default_mm_lora(
    lora: LoRARequest | None, modalities: Iterable[str], defaults: dict[str, LoRARequest]
) -> LoRARequest | None:
    """The adapter a request runs with: its own; else the default adapter of the one modality
    among its media that has one (none when several do: a request runs one adapter)."""
    if lora is not None or not defaults:
        return lora
    found = [defaults[m] for m in set(modalities) if m in defaults]
    return found[0] if len(found) == 1 else None


class HasLoRA(Protocol):
    lora_request: LoRARequest | None


def adapter_fits(request: HasLoRA, running: Iterable[HasLoRA], max_loras: int) -> bool:
    """Whether ``request`` may join ``running`` when one step holds at most ``max_loras``
    distinct adapters (the workers' slots)."""
    lora = request.lora_request
    if lora is None:
        return True
    ids = {r.lora_request.lora_int_id for r in running if r.lora_request is not None}
    return lora.lora_int_id in ids or len(ids) < max_loras


RUNNING_KEY, WAITING_KEY = "lora_running:", "lora_waiting:"
"""Scheduler-stat key prefixes: ``lora_running:NAME`` -> running requests with adapter NAME."""


def lora_stats(running: Iterable[HasLoRA], waiting: Iterable[HasLoRA]) -> dict[str, float]:
    """Requests per adapter, running and waiting (the ``lora_requests_info`` metric's labels)."""
    stats: dict[str, float] = {}
    for prefix, requests in ((RUNNING_KEY, running), (WAITING_KEY, waiting)):
        for request in requests:
            if request.lora_request is not None:
                key = prefix + request.lora_request.lora_name
                stats[key] = stats.get(key, 0.0) + 1.0
    return stats


class AddedAdapters:
    """The front end's record of the adapters its engine cores hold, by id: each is added once,
    and an id stays bound to one adapter (the workers and the prefix cache key on it)."""

    def __init__(self) -> None:
        self._by_id: dict[int, LoRARequest] = {}

    def is_new(self, lora: LoRARequest) -> bool:
        """Whether ``lora`` still has to be added; ValueError when its id names another."""
        if not isinstance(lora, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, not {type(lora).__name__}.")
        known = self._by_id.get(lora.lora_int_id)
        if known is not None and (known.lora_name, known.lora_path) != (
            lora.lora_name,
            lora.lora_path,
        ):
            raise ValueError(
                f"lora_int_id {lora.lora_int_id} is adapter {known.lora_name!r} "
                f"({known.lora_path}); give {lora.lora_name!r} another id."
            )
        return known is None

    @staticmethod
    def utility_args(lora: LoRARequest) -> tuple[str, int, str]:
        """The engine core's ``add_lora`` arguments (plain values: they cross processes)."""
        return lora.lora_name, lora.lora_int_id, lora.lora_path

    def added(self, lora: LoRARequest) -> None:
        self._by_id[lora.lora_int_id] = lora

    def removed(self, lora_int_id: int) -> bool:
        return self._by_id.pop(lora_int_id, None) is not None

    def ids(self) -> set[int]:
        return set(self._by_id)


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str, str | None]]:
    """``--lora-modules`` entries, ``name=path`` or JSON ``{"name", "path",
    "base_model_name"}``, as (name, path, base model name)."""
    modules = []
    for value in values or []:
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
                modules.append((spec["name"], spec["path"], spec.get("base_model_name")))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"--lora-modules {value!r}: a JSON entry needs name and path ({exc})."
                ) from exc
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value!r}: expected name=path.")
            modules.append((name, path, None))
    return modules
