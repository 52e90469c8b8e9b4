"""The per-step context that attention layers read during one model forward.

Models take only tokens and positions; the attention metadata of the step reaches every
``Attention`` layer through this context, so model code never threads it through each layer.
The context refuses nesting: a forward inside a forward would silently attend with the wrong
metadata, so it is an error rather than a stack.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omniserve.attention.metadata import AttentionMetadata
    from omniserve.layers.lora import LoRAMapping


@dataclass(frozen=True)
class ForwardContext:
    """What layers may read during one forward pass."""

    attn_metadata: AttentionMetadata | None
    """Paged-attention metadata of the step; None for a dummy (profile) forward without a cache."""
    lora_mapping: LoRAMapping | None = None
    """Which tokens run with which LoRA adapter slot; None: no token has an adapter."""


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata | None, lora_mapping: LoRAMapping | None = None
) -> Iterator[None]:
    """Make the step's metadata visible to the layers for the duration of the block."""
    global _current
    if _current is not None:
        raise RuntimeError("set_forward_context is already active; forward passes cannot nest.")
    _current = ForwardContext(attn_metadata, lora_mapping)
    try:
        yield
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    """The active context; raises if the model is called outside ``set_forward_context``."""
    if _current is None:
        raise RuntimeError("No forward context: run the model inside set_forward_context(...).")
    return _current


def current_forward_context() -> ForwardContext | None:
    """The active context, or None outside a forward (for layers that also run outside one)."""
    return _current
