"""Paged attention: metadata, the backend contract (base.py), backends, and the Attention layer."""

from __future__ import annotations

from omniserve.attention.base import AttentionBackend
from omniserve.attention.layer import Attention, get_attention_layers
from omniserve.attention.metadata import AttentionMetadata
from omniserve.attention.selector import get_attention_backend

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionMetadata",
    "get_attention_backend",
    "get_attention_layers",
]
