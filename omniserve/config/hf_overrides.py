"""vLLM's ``hf_overrides``: config.json keys set over a checkpoint's, given as a dict (or its
JSON text) or as a function of the transformers config."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any


def merged_overrides(values: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``values`` with ``overrides`` set over them; a nested config (``*_config``) is merged key
    by key."""
    merged = dict(values)
    for key, value in overrides.items():
        current = merged.get(key)
        nested = key.endswith("_config") and isinstance(value, dict) and isinstance(current, dict)
        merged[key] = merged_overrides(current, value) if nested else value  # type: ignore[arg-type]
    return merged


def overrides_of(model: str, transform: Callable[[Any], Any]) -> dict[str, Any]:
    """vLLM's callable ``hf_overrides`` as the config.json keys it changes: ``transform`` takes
    the checkpoint's transformers config and returns it changed (keys it deletes stay)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model, local_files_only=True)
    before = config.to_dict()
    try:
        after = transform(copy.deepcopy(config))
    except Exception as exc:
        raise ValueError(f"hf_overrides: the function raised {exc!r}") from exc
    if not hasattr(after, "to_dict"):
        raise ValueError(f"hf_overrides: the function must return the transformers config it "
                         f"was given (changed), not {type(after).__name__}.")  # fmt: skip
    return _changes(before, after.to_dict())


def _changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``after`` whose values differ from ``before``'s; nested configs key by key."""
    changes: dict[str, Any] = {}
    for key, value in after.items():
        old = before.get(key, _ABSENT)
        if key.endswith("_config") and isinstance(value, dict) and isinstance(old, dict):
            if nested := _changes(old, value):
                changes[key] = nested
        elif value != old:
            changes[key] = value
    return changes


_ABSENT = object()


def set_overrides(config: Any, overrides: dict[str, Any]) -> None:
    """``merged_overrides`` on a transformers config (its nested configs are config objects)."""
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and hasattr(current, "to_dict"):
            set_overrides(current, value)
        elif key == "id2label":  # transformers keys labels by int; JSON keys are strings
            config.id2label = {int(k): v for k, v in value.items()}
        else:
            setattr(config, key, value)
