"""vLLM's ``--disable-sliding-window``: a model whose layers attend through a sliding window
runs them with full attention instead, its ``max_model_len`` capped at the window, where the
two agree (no position is farther back than the window)."""

from __future__ import annotations

from typing import Any


def sliding_window(config: Any) -> int | None:
    """The window of the text model's sliding-window layers (transformers' ``layer_types``),
    or None when it has none."""
    text = config.get_text_config()
    layer_types = getattr(text, "layer_types", None) or []
    return text.sliding_window if "sliding_attention" in layer_types else None


def use_full_attention(config: Any) -> None:
    """Make every layer of the text model a full-attention one (in place)."""
    text = config.get_text_config()
    if getattr(text, "layer_types", None):
        text.layer_types = ["full_attention"] * len(text.layer_types)
    text.sliding_window = None
