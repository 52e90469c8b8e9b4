"""Qwen2-VL and Qwen2.5-VL: images and videos as dynamic-resolution patch grids.

Each image or video item expands its single ``<|image_pad|>`` / ``<|video_pad|>`` into
``grid_t * grid_h * grid_w / merge_size**2`` tokens (a video pruned by ``--video-pruning-rate``
into the tokens it keeps, ``omniserve.multimodal.pruning``). The same classes serve Qwen2.5-VL,
whose HF processor adds ``second_per_grid_ts`` per video (kept on the item for M-RoPE).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from omniserve.multimodal.errors import MultiModalInputError
from omniserve.multimodal.parse import MultiModalDataItems
from omniserve.multimodal.processing import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    MultiModalFieldConfig,
    PromptReplacement,
    PromptUpdate,
    RequestKwarg,
)

_MAX_ASPECT_RATIO = 200  # smart_resize rejects anything more elongated
_MAX_PIXELS = 16384 * 28 * 28  # the published checkpoints' largest resize (their default)


@dataclass(frozen=True)
class VisionGeometry:
    """The resize and patch parameters of one modality's HF sub-processor."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def tokens_per_frame(self, width: int, height: int) -> int:
        resized_h, resized_w = smart_resize(
            height,
            width,
            factor=self.factor,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
        )
        return (resized_h // self.factor) * (resized_w // self.factor)

    def max_tokens_per_frame(self) -> int:
        """An upper bound on ``tokens_per_frame`` over every accepted size.

        smart_resize keeps the area within ``max_pixels`` except at its clamps: one side held
        at ``factor`` for very elongated inputs, or ceil-rounding when upscaling to
        ``min_pixels``; both are bounded at the 1:200 aspect limit.
        """
        f = self.factor
        by_area = self.max_pixels // (f * f)
        clamped_side = int(math.sqrt(_MAX_ASPECT_RATIO * self.max_pixels) // f)
        upscaled = int(
            (math.sqrt(self.min_pixels / _MAX_ASPECT_RATIO) / f + 1)
            * (math.sqrt(self.min_pixels * _MAX_ASPECT_RATIO) / f + 1)
        )
        return max(by_area, clamped_side, upscaled)

    def largest_frame_size(self) -> tuple[int, int]:
        """(width, height) of the frame with the most tokens: a square at ``max_pixels``, or,
        when the side clamp wins (small ``max_pixels``), a 200:1 strip."""
        side = max(self.factor, math.isqrt(self.max_pixels))
        short = max(math.isqrt(self.max_pixels // _MAX_ASPECT_RATIO), self.factor // 2) + 1
        candidates = [(side, side), (short * _MAX_ASPECT_RATIO, short)]
        return max(candidates, key=lambda size: self.tokens_per_frame(*size))


class Qwen2VLProcessingInfo(BaseProcessingInfo):
    request_kwargs = {
        "min_pixels": RequestKwarg(int, 1, _MAX_PIXELS),
        "max_pixels": RequestKwarg(int, 1, _MAX_PIXELS),
        "fps": RequestKwarg(float, 0.01, 240),
        "num_frames": RequestKwarg(int, 1, 1024),
    }
    model_bound_kwargs = frozenset({"patch_size", "merge_size", "temporal_patch_size"})
    video_pruning_layout = "whole"

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": None, "video": None}

    def get_geometry(self, modality: str) -> VisionGeometry:
        """The sub-processor's geometry after the ``--mm-processor-kwargs`` overrides."""
        hf_processor = self.get_hf_processor()
        sub = hf_processor.image_processor if modality == "image" else hf_processor.video_processor
        kwargs = self.ctx.mm_processor_kwargs
        size = dict(kwargs.get("size") or sub.size)
        return VisionGeometry(
            patch_size=int(sub.patch_size),  # model-bound: never overridden
            merge_size=int(sub.merge_size),
            temporal_patch_size=int(sub.temporal_patch_size),
            min_pixels=int(kwargs.get("min_pixels", size["shortest_edge"])),
            max_pixels=int(kwargs.get("max_pixels", size["longest_edge"])),
        )

    def get_max_image_tokens(self) -> int:
        return self.get_geometry("image").max_tokens_per_frame()

    def get_num_frames_with_most_features(self, seq_len: int, mm_counts: Mapping[str, int]) -> int:
        """Frames of the worst-case video: as many as the prompt leaves room for after the
        images, split between the videos, within the video processor's ``max_frames``."""
        geometry = self.get_geometry("video")
        num_videos = max(mm_counts.get("video", 0), 1)
        room = seq_len - mm_counts.get("image", 0) * self.get_max_image_tokens()
        per_frame = geometry.max_tokens_per_frame()
        grid_t = max(room // num_videos // per_frame, 1)
        max_frames = self.get_hf_processor().video_processor.max_frames
        grid_t = min(grid_t, max(max_frames // geometry.temporal_patch_size, 1))
        return grid_t * geometry.temporal_patch_size

    def get_mm_max_tokens_per_item(
        self, seq_len: int, mm_counts: Mapping[str, int]
    ) -> Mapping[str, int]:
        """Images: a true bound over every accepted size. Videos: the worst case that fits the
        prompt (frames given as an array are not capped by ``max_frames``, so a longer video
        is possible and is then caught by the budget check at admission)."""
        geometry = self.get_geometry("video")
        num_frames = self.get_num_frames_with_most_features(seq_len, mm_counts)
        grid_t = math.ceil(num_frames / geometry.temporal_patch_size)
        return {
            "image": self.get_max_image_tokens(),
            "video": grid_t * geometry.max_tokens_per_frame(),
        }


class Qwen2VLDummyInputsBuilder(BaseDummyInputsBuilder):
    info: Qwen2VLProcessingInfo

    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        hf_processor = self.info.get_hf_processor()
        image = f"<|vision_start|>{hf_processor.image_token}<|vision_end|>"
        video = f"<|vision_start|>{hf_processor.video_token}<|vision_end|>"
        return image * mm_counts.get("image", 0) + video * mm_counts.get("video", 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int]) -> dict[str, Any]:
        width, height = self.info.get_geometry("image").largest_frame_size()
        video_width, video_height = self.info.get_geometry("video").largest_frame_size()
        num_frames = self.info.get_num_frames_with_most_features(seq_len, mm_counts)
        return {
            "image": self._get_dummy_images(width, height, mm_counts.get("image", 0)),
            "video": self._get_dummy_videos(
                video_width, video_height, num_frames, mm_counts.get("video", 0)
            ),
        }


class Qwen2VLMultiModalProcessor(BaseMultiModalProcessor):
    info: Qwen2VLProcessingInfo

    def _get_mm_fields_config(
        self, hf_inputs: Mapping[str, Any], hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        fields: dict[str, MultiModalFieldConfig] = {}
        for modality, pixels, grid in (
            ("image", "pixel_values", "image_grid_thw"),
            ("video", "pixel_values_videos", "video_grid_thw"),
        ):
            if grid in hf_inputs:
                # pixel rows: one per patch, grid_t * grid_h * grid_w per item
                sizes = hf_inputs[grid].prod(-1)
                fields[pixels] = MultiModalFieldConfig.flat_from_sizes(modality, sizes)
                fields[grid] = MultiModalFieldConfig.batched(modality)
        fields["second_per_grid_ts"] = MultiModalFieldConfig.batched("video")  # Qwen2.5-VL
        return fields

    def _embeds_fields(self, modality: str, embeds: dict[str, Any]) -> dict[str, Any]:
        """Image embeddings (the vision tower's merged output) with their ``image_grid_thw``,
        which the placeholder count and M-RoPE positions need."""
        if modality != "image":
            return super()._embeds_fields(modality, embeds)
        grid = embeds.get("image_grid_thw")
        if not (
            isinstance(grid, torch.Tensor)
            and grid.numel() == 3
            and not grid.is_floating_point()
            and bool((grid > 0).all())
        ):
            raise MultiModalInputError(
                "image_embeds need image_grid_thw: 3 positive integers (t, h, w patches)",
                stage="process",
                modality="image",
            )
        grid = grid.reshape(1, 3).long()
        merge = self.info.get_hf_processor().image_processor.merge_size
        rows = embeds["image_embeds"].shape[0]
        if int(grid.prod()) // (merge * merge) != rows:
            raise MultiModalInputError(
                f"image_embeds has {rows} rows, but image_grid_thw {grid.tolist()[0]} makes "
                f"{int(grid.prod()) // (merge * merge)} merged patches",
                stage="process",
                modality="image",
            )
        return {"image_embeds": embeds["image_embeds"], "image_grid_thw": grid}

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_items: Mapping[str, list[dict[str, Any]]],
    ) -> Sequence[PromptUpdate]:
        hf_processor = self.info.get_hf_processor()
        updates = []
        for modality, token, token_id, grid_key, sub in (
            (
                "image",
                hf_processor.image_token,
                hf_processor.image_token_id,
                "image_grid_thw",
                hf_processor.image_processor,
            ),
            (
                "video",
                hf_processor.video_token,
                hf_processor.video_token_id,
                "video_grid_thw",
                hf_processor.video_processor,
            ),
        ):
            merge = sub.merge_size  # as HF's replace_*_token: the instance's, never a kwarg's

            def replacement(
                i: int,
                modality: str = modality,
                token_id: int = token_id,
                grid_key: str = grid_key,
                merge: int = merge,
            ) -> list[int]:
                t, h, w = (int(n) for n in out_items[modality][i][grid_key].reshape(3))
                if modality == "video" and (
                    pruning := self.info.video_pruning(t, h * w // merge**2)
                ):
                    return [token_id] * pruning.num_kept
                return [token_id] * (t * h * w // merge**2)

            updates.append(PromptReplacement(modality, token, replacement))
        return updates
