"""Qwen3-Omni-MoE thinker: the Qwen2.5-Omni processing with Qwen3-Omni's audio and timing.

Everything of ``processors.qwen2_5_omni_thinker`` holds (placeholders read from the HF processor:
``<|image_pad|>``/``<|video_pad|>`` inside ``<|vision_start|>..<|vision_end|>``, ``<|audio_pad|>``
inside ``<|audio_start|>..<|audio_end|>``; per-item field names; audio-in-video as one composite
"video" item), except:

- audio clips are not padded or truncated: ``input_features`` [1, num_mel_bins, num_frames] and
  ``feature_attention_mask`` [1, num_frames] cover exactly the clip's ``len // hop_length``
  frames (the clip featurized alone; HF pads a batch to its longest clip, which changes a
  shorter clip's last frame and can add one frame to its count, so multi-clip requests match
  HF exactly only when the clips are whole frames long), and the token count is the windowed
  formula of ``processors.qwen3_omni_audio``;
- ``video_second_per_grid`` defaults to ``temporal_patch_size / 1.0`` (HF's fps default);
- audio-in-video interleaves by timestamps: a video token at time ``t`` position ids comes
  before the audio tokens at ``>= t`` (audio token ``k`` sits at ``k``);
  ``get_audio_in_video_order`` reads ``seconds_per_grid``, ``position_id_per_seconds``,
  ``merge_size`` and ``n_window`` from the item's ``audio_in_video`` parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from processors.qwen2_5_omni_thinker import (
    Qwen2_5OmniThinkerDummyInputsBuilder,
    Qwen2_5OmniThinkerMultiModalProcessor,
    Qwen2_5OmniThinkerProcessingInfo,
    _video_times,
)
from processors.qwen3_omni_audio import TOKENS_PER_FULL_WINDOW, get_feat_extract_output_lengths
from processors.qwen3_vl import deepstack_embeds_width


def get_audio_in_video_order(data: Mapping[str, Any]) -> torch.Tensor:
    """The embeddings of an audio-in-video item in token order: [num_embeds] bool, True for a
    video embedding, False for an audio one. Tokens are merged by time; on a tie the video
    token goes first (Qwen3-Omni)."""
    params = data["audio_in_video"]
    num_frames = int(data["feature_attention_mask"].sum())
    num_audio = int(get_feat_extract_output_lengths(num_frames, params["n_window"]))
    video_times = _video_times(data)
    times = np.concatenate([video_times, np.arange(num_audio, dtype=np.float64)])
    is_video = np.concatenate([np.ones(len(video_times), bool), np.zeros(num_audio, bool)])
    # Both runs are sorted, so a stable sort by (time, audio-after-video) is the reference's
    # two-pointer merge.
    order = np.lexsort((~is_video, times))
    return torch.from_numpy(is_video[order])


class Qwen3OmniMoeThinkerProcessingInfo(Qwen2_5OmniThinkerProcessingInfo):
    """Audio without a length cap: a clip's bound is what the prompt has room for."""

    def get_audio_window_seconds(self) -> float | None:
        return None

    def get_n_window(self, mm_kwargs: Mapping[str, object] | None = None) -> int:
        return int(self.merge_hf_kwargs(mm_kwargs)["n_window"])

    def get_num_audio_tokens(
        self, num_mel_frames: int, mm_kwargs: Mapping[str, object] | None = None
    ) -> int:
        return int(get_feat_extract_output_lengths(num_mel_frames, self.get_n_window(mm_kwargs)))

    def get_max_audio_tokens(self, seq_len: int, mm_counts: Mapping[str, int]) -> int:
        """The prompt left after the images, shared evenly by the clips and the videos (clips
        are never truncated, so a longer one is possible and meets the budget check)."""
        room = seq_len - mm_counts.get("image", 0) * self.get_max_image_tokens()
        shares = mm_counts.get("audio", 0) + mm_counts.get("video", 0)
        return max(room // max(shares, 1), 1)

    def get_max_audio_samples(self, seq_len: int, mm_counts: Mapping[str, int]) -> int:
        # Per full window of 2 * n_window frames 13 tokens, then one token per 8 frames.
        num_tokens = self.get_max_audio_tokens(seq_len, mm_counts)
        full, rest = divmod(num_tokens, TOKENS_PER_FULL_WINDOW)
        num_frames = full * 2 * self.get_n_window() + 8 * rest
        return num_frames * int(self.get_feature_extractor().hop_length)


class Qwen3OmniMoeThinkerDummyInputsBuilder(Qwen2_5OmniThinkerDummyInputsBuilder):
    """The Qwen2.5-Omni dummies; clip lengths come from the Qwen3-Omni info."""

    info: Qwen3OmniMoeThinkerProcessingInfo


class Qwen3OmniMoeThinkerMultiModalProcessor(Qwen2_5OmniThinkerMultiModalProcessor):
    info: Qwen3OmniMoeThinkerProcessingInfo

    default_video_fps = 1.0
    forced_audio_kwargs: Mapping[str, object] = {}
    audio_in_video_order: Callable[[Mapping[str, Any]], torch.Tensor] = staticmethod(
        get_audio_in_video_order
    )

    def _embeds_width(self, modality: str) -> tuple[int, str]:
        return deepstack_embeds_width(self, modality)

    def _audio_in_video_params(
        self, metadata: Mapping[str, Any], merged: Mapping[str, Any]
    ) -> dict[str, float | int]:
        params = super()._audio_in_video_params(metadata, merged)
        del params["seconds_per_chunk"]
        params["n_window"] = int(merged["n_window"])
        return params
