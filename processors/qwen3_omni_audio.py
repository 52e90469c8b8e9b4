"""Qwen3-Omni's audio encoder geometry: how many embeddings a clip's mel frames become.

The single source of audio placeholder counts: the processor expands ``<|audio_pad|>`` with it
and the model sizes its audio embeddings with it. Works on ints, numpy arrays and torch tensors.
"""

from __future__ import annotations

from typing import TypeVar

_Lengths = TypeVar("_Lengths")

TOKENS_PER_FULL_WINDOW = 13
"""Embeddings of one full 100-frame window (three stride-2 convolutions: 100 -> 50 -> 25 -> 13);
fixed, as in the reference formula."""


def get_feat_extract_output_lengths(input_lengths: _Lengths, n_window: int = 50) -> _Lengths:
    """Audio embeddings for ``input_lengths`` valid mel frames.

    The encoder cuts the frames into windows of ``2 * n_window`` and runs three stride-2
    convolutions on each: a full window gives 13 embeddings, the remaining ``r`` frames
    ``ceil(r / 8)``. Unlike Qwen2.5-Omni there is no 30 s cap: long clips just add windows.
    """
    window = 2 * n_window
    remainder = input_lengths % window
    conv1 = (remainder - 1) // 2 + 1
    conv3 = ((conv1 - 1) // 2 + 1 - 1) // 2 + 1
    return conv3 + (input_lengths // window) * TOKENS_PER_FULL_WINDOW
