"""Qwen3-VL: Qwen2-VL's dynamic-resolution images, and videos laid out frame group by frame group
with text timestamps.

An image expands its ``<|image_pad|>`` into ``grid_t * grid_h * grid_w / merge_size**2`` pads, as
in Qwen2-VL. A video's ``<|vision_start|><|video_pad|><|vision_end|>`` becomes, for each group of
``temporal_patch_size`` frames, ``<{t:.1f} seconds><|vision_start|>`` + ``grid_h * grid_w /
merge_size**2`` pads + ``<|vision_end|>``, where ``t`` is the mean time of the group's first and
last frame (frame index / fps, the last frame repeated to fill the last group). Only the pads take
embeddings (the range's ``is_embed``); under ``--video-pruning-rate`` each group has the pads
of the tokens it keeps (``omniserve.multimodal.pruning``). This is the layout of Qwen's own
processor and vLLM's; transformers 5.23-5.24's ``Qwen3VLProcessor`` replaced only the pad and
so nested each group inside the template's markers, a layout the model was not trained on (5.25
replaces the span; tests pin both).

Timestamps follow HF on the frames' metadata: frame index / fps. A decoded file's frames carry
the source's (their indices among its frames, its rate), so each group sits at its source frames'
time, as in transformers' own video loading and vLLM; bare arrays carry none and get HF's default
of 24 fps. HF's frame sampling (``do_sample_frames``, on in the published checkpoints) runs on
frames given whole, never again on a file's sample (``VideoProcessorItems.hf_call_kwargs``).
The video processor bounds the whole video's pixels (``size``: all frames together), so a
frame's tokens shrink as frames are added.

Precomputed image embeddings (``--enable-mm-embeds``) are the tower's output as it makes it, each
row the main embedding followed by its DeepStack levels (which feed early decoder layers), with
the image's ``image_grid_thw``; video embeddings are refused, as for Qwen2-VL.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from omniserve.multimodal.parse import MultiModalDataItems
from omniserve.multimodal.processing import (
    BaseMultiModalProcessor,
    MultiModalFieldConfig,
    PromptReplacement,
    PromptUpdate,
    PromptUpdateDetails,
    RequestKwarg,
)
from processors.qwen2_vl import (
    Qwen2VLDummyInputsBuilder,
    Qwen2VLMultiModalProcessor,
    Qwen2VLProcessingInfo,
    VisionGeometry,
)

_MAX_PIXELS = 16384 * 32 * 32  # the published checkpoints' largest image resize (their default)
_DEFAULT_FPS = 24.0  # what HF assumes for frames of unknown rate
_LONGEST_TIMESTAMP = "<99999.9 seconds>"
"""The longest timestamp a bound allows for (27 hours); Qwen's tokenizer splits digits."""


def frame_group_times(frames_indices: Sequence[int], fps: float, group: int) -> list[float]:
    """Seconds of each group of ``group`` frames: the mean of its first and last frame's time,
    the last frame repeated to fill the last group (HF's ``_calculate_timestamps``)."""
    indices = [int(i) for i in frames_indices]
    indices += indices[-1:] * (-len(indices) % group)
    times = [i / fps for i in indices]
    return [(times[i] + times[i + group - 1]) / 2 for i in range(0, len(times), group)]


class Qwen3VLProcessingInfo(Qwen2VLProcessingInfo):
    request_kwargs = {
        **Qwen2VLProcessingInfo.request_kwargs,
        "min_pixels": RequestKwarg(int, 1, _MAX_PIXELS),
        "max_pixels": RequestKwarg(int, 1, _MAX_PIXELS),
    }
    video_pruning_layout = "per_frame"

    def get_geometry(self, modality: str) -> VisionGeometry:
        """Images: Qwen2-VL's. Videos: one frame of the largest video, which is
        ``temporal_patch_size`` frames (the least the processor takes) sharing the whole-video
        pixel budget; longer videos spread the same budget over more frames."""
        geometry = super().get_geometry(modality)
        if modality != "video":
            return geometry
        frames = geometry.temporal_patch_size
        return VisionGeometry(
            patch_size=geometry.patch_size,
            merge_size=geometry.merge_size,
            temporal_patch_size=frames,
            min_pixels=max(geometry.min_pixels // frames, 1),
            max_pixels=geometry.max_pixels // frames,
        )

    def get_text_tokens_per_frame_group(self) -> int:
        """A bound on the tokens around one frame group's pads: its timestamp and two markers."""
        return len(self.get_tokenizer().encode(_LONGEST_TIMESTAMP, add_special_tokens=False)) + 2

    def get_mm_max_tokens_per_item(
        self, seq_len: int, mm_counts: Mapping[str, int]
    ) -> Mapping[str, int]:
        """Qwen2-VL's bounds, with each frame group's timestamp and markers added to a video's."""
        bounds = dict(super().get_mm_max_tokens_per_item(seq_len, mm_counts))
        geometry = self.get_geometry("video")
        num_frames = self.get_num_frames_with_most_features(seq_len, mm_counts)
        groups = math.ceil(num_frames / geometry.temporal_patch_size)
        bounds["video"] += groups * self.get_text_tokens_per_frame_group()
        return bounds


class Qwen3VLDummyInputsBuilder(Qwen2VLDummyInputsBuilder):
    info: Qwen3VLProcessingInfo


class Qwen3VLMultiModalProcessor(Qwen2VLMultiModalProcessor):
    info: Qwen3VLProcessingInfo

    def _call_hf_processor(
        self, mm_data: Mapping[str, Any], mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, Any]:
        """The HF processor on the media, asking for the videos' metadata after its frame
        sampling, whose frame indices and rate give each frame group's timestamp."""
        outputs = dict(
            self.info.get_hf_processor()(
                **{**mm_kwargs, **mm_data, "return_metadata": True, "return_tensors": "pt"}
            )
        )
        metadata = outputs.pop("video_metadata", None)
        if metadata is not None:
            group = self.info.get_hf_processor().video_processor.temporal_patch_size
            times = [
                frame_group_times(m.frames_indices, m.fps or _DEFAULT_FPS, group) for m in metadata
            ]
            outputs["video_timestamps"] = torch.tensor(
                [t for video in times for t in video], dtype=torch.float64
            )
        return outputs

    def _get_mm_fields_config(
        self, hf_inputs: Mapping[str, Any], hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        fields = dict(super()._get_mm_fields_config(hf_inputs, hf_processor_mm_kwargs))
        if "video_grid_thw" in hf_inputs:
            groups = hf_inputs["video_grid_thw"][:, 0]
            fields["video_timestamps"] = MultiModalFieldConfig.flat_from_sizes("video", groups)
        return fields

    def _embeds_width(self, modality: str) -> tuple[int, str]:
        return deepstack_embeds_width(self, modality)

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_items: Mapping[str, list[dict[str, Any]]],
    ) -> Sequence[PromptUpdate]:
        image, _ = super()._get_prompt_updates(mm_items, hf_processor_mm_kwargs, out_items)
        hf_processor = self.info.get_hf_processor()
        start, pad, end = (
            hf_processor.vision_start_token_id,
            hf_processor.video_token_id,
            hf_processor.vision_end_token_id,
        )
        merge = hf_processor.video_processor.merge_size
        encode = self.info.get_tokenizer().encode

        def video(i: int) -> PromptUpdateDetails:
            data = out_items["video"][i]
            t, h, w = (int(n) for n in data["video_grid_thw"].reshape(3))
            pruning = self.info.video_pruning(t, h * w // merge**2)
            pads = pruning.quotas() if pruning is not None else [h * w // merge**2] * t
            tokens: list[int] = []
            for seconds, count in zip(data["video_timestamps"].tolist(), pads, strict=True):
                tokens += encode(f"<{seconds:.1f} seconds>", add_special_tokens=False)
                tokens += [start, *[pad] * count, end]
            return PromptUpdateDetails.select_token_id(tokens, pad)

        span = (
            f"{hf_processor.vision_start_token}{hf_processor.video_token}"
            f"{hf_processor.vision_end_token}"
        )
        return [image, PromptReplacement("video", span, video)]


def deepstack_embeds_width(processor: BaseMultiModalProcessor, modality: str) -> tuple[int, str]:
    """An image's precomputed embeddings carry its DeepStack levels after the main rows, as the
    Qwen3 vision tower makes them (and as vLLM takes them): ``hidden * (1 + levels)`` wide."""
    hidden, what = BaseMultiModalProcessor._embeds_width(processor, modality)
    if modality != "image":
        return hidden, what
    config = processor.info.ctx.hf_config
    vision = getattr(config, "vision_config", None) or config.thinker_config.vision_config
    levels = len(vision.deepstack_visual_indexes)
    return hidden * (1 + levels), f"the hidden size x (1 + {levels} DeepStack levels)"
