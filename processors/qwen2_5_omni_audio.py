"""Qwen2.5-Omni's audio encoder geometry: how many embeddings a clip's mel frames become.

The single source of audio placeholder counts: the processor expands ``<|AUDIO|>`` with it and
the model sizes its audio embeddings with it. Works on ints, numpy arrays and torch tensors alike.
"""

from __future__ import annotations

from typing import TypeVar

_Lengths = TypeVar("_Lengths")


def get_feat_extract_output_lengths(input_lengths: _Lengths) -> _Lengths:
    """Audio embeddings for ``input_lengths`` valid mel frames: a stride-2 convolution, then a
    stride-2 average pool (Whisper-style encoder). Fewer than 3 frames give no embedding."""
    conv_lengths = (input_lengths - 1) // 2 + 1
    return (conv_lengths - 2) // 2 + 1
