"""Picks the attention backend; one shared instance per process so per-step plans are reused."""

from __future__ import annotations

import functools

from omniserve.attention.base import AttentionBackend
from omniserve.attention.torch_backend import TorchAttentionBackend


@functools.cache
def get_attention_backend() -> AttentionBackend:
    """The process-wide backend. Only the torch backend exists so far (CPU and reference)."""
    return TorchAttentionBackend()
