"""Qwen2-VL: transformers' vision transformer, our Qwen2 decoder with M-RoPE.

Images and videos go through one vision tower: each item's patch rows are concatenated and its
``[t, h, w]`` patch grid tells the tower where one item ends, so all items of a call share one
forward. After the 2x2 patch merger an item yields ``t * h * w / 4`` embeddings, one per expanded
``<|image_pad|>`` / ``<|video_pad|>`` token.

M-RoPE positions are transformers' ``get_rope_index`` (5.x) rebuilt from the placeholder ranges:
text advances all three axes by one per token; a vision item spans a (t, h, w) grid starting at the
running position, after which the running position advances by ``max(h, w)`` (merged grid).

A video pruned by ``--video-pruning-rate`` (``omniserve.multimodal.pruning``) keeps the positions
of the tokens it keeps, which are known once it is encoded (the runner lays the prompt out with
stand-ins until then, and lays it out again with them); the tokens after it, and generated tokens
(``delta``), sit where they would after the whole video, so nothing but the video's own tokens
depends on which are kept (nor on whether its encoder output is still cached).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from model_zoo.multimodal import MultiModalDecoderBase, PrunesVideo
from model_zoo.qwen2 import Qwen2ForCausalLM
from model_zoo.towers import adopt_tower
from omniserve.multimodal.inputs import MultiModalFeatureSpec, host_data
from omniserve.multimodal.registry import MULTIMODAL_REGISTRY
from processors.qwen2_vl import (
    Qwen2VLDummyInputsBuilder,
    Qwen2VLMultiModalProcessor,
    Qwen2VLProcessingInfo,
)

# modality -> (patch rows key, patch grid key) in an item's data
_VISION_KEYS = {
    "image": ("pixel_values", "image_grid_thw"),
    "video": ("pixel_values_videos", "video_grid_thw"),
}
_PLACEHOLDERS = {
    "image": "<|vision_start|><|image_pad|><|vision_end|>",
    "video": "<|vision_start|><|video_pad|><|vision_end|>",
}


def _text_positions(num_tokens: int, start: int) -> torch.Tensor:
    return torch.arange(start, start + num_tokens, dtype=torch.int64).expand(3, -1)  # [3, n]


def vision_positions(
    grid_thw: tuple[int, int, int], merge_size: int, start: int, time_interval: Any
) -> torch.Tensor:
    """``[3, t * h * w]`` positions of one item's merged grid, as transformers'
    ``get_vision_position_ids``: temporal ``floor(i * time_interval)``, then all axes + start."""
    t, h, w = grid_thw[0], grid_thw[1] // merge_size, grid_thw[2] // merge_size
    temporal = (torch.arange(t) * time_interval).long() + start  # [t]
    height = torch.arange(h, dtype=torch.int64) + start  # [h]
    width = torch.arange(w, dtype=torch.int64) + start  # [w]
    grids = torch.meshgrid(temporal, height, width, indexing="ij")  # 3 x [t, h, w]
    return torch.stack(grids).reshape(3, -1)


@MULTIMODAL_REGISTRY.register_processor(
    Qwen2VLMultiModalProcessor,
    info=Qwen2VLProcessingInfo,
    dummy_inputs=Qwen2VLDummyInputsBuilder,
)
class Qwen2VLForConditionalGeneration(MultiModalDecoderBase, PrunesVideo):
    uses_mrope: ClassVar[bool] = True
    text_family = Qwen2ForCausalLM
    packed_attention_towers = ("visual",)
    tower_modalities = {"visual": ("image", "video")}
    vision_tower_cls: ClassVar[type[nn.Module]] = Qwen2VisionTransformerPretrainedModel
    # transformers' module names -> the hub names we use
    checkpoint_prefixes = (("model.language_model.", "model."), ("model.visual.", "visual."))

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.visual = adopt_tower(self.vision_tower_cls(config.vision_config))
        self.merge_size: int = config.vision_config.spatial_merge_size

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str:
        """What a chat-template renders for the i-th item of ``modality`` (one pad token)."""
        if modality not in _PLACEHOLDERS:
            raise ValueError(f"{cls.__name__} takes image and video inputs, not {modality!r}.")
        return _PLACEHOLDERS[modality]

    def get_multimodal_embeddings(
        self, modality: str, items: list[dict[str, torch.Tensor]]
    ) -> list[torch.Tensor]:
        if modality not in _VISION_KEYS:
            raise ValueError(f"{type(self).__name__} encodes image and video, not {modality!r}.")
        pixels_key, grid_key = _VISION_KEYS[modality]
        # [num_items, 3], on the host
        grid_thw = torch.cat([host_data(item)[grid_key].reshape(-1, 3) for item in items])
        if grid_thw.shape[0] != len(items):
            raise ValueError(f"Each {modality} item must carry exactly one {grid_key} row.")
        pixel_values = torch.cat([item[pixels_key] for item in items])  # [num_patches, patch_dim]
        embeds = self.vision_outputs(pixel_values.to(self.visual.dtype), grid_thw)
        sizes = (grid_thw.prod(-1) // self.merge_size**2).tolist()
        return list(embeds.split(sizes))

    def time_interval(self, feature: MultiModalFeatureSpec) -> Any:
        """Temporal position step between consecutive frame groups of an item."""
        return 1

    def get_mrope_input_positions(
        self,
        prompt_token_ids: list[int],
        mm_features: list[MultiModalFeatureSpec],
        kept: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, int]:
        """``([3, len(prompt)] int64 positions, delta)``; a token at p >= len(prompt) sits at
        ``p + delta`` on all three axes (transformers' ``rope_deltas``). ``kept``: pruned
        videos' kept rows, by identifier (see the module doc)."""
        num_tokens = len(prompt_token_ids)
        parts: list[torch.Tensor] = []
        next_position = cursor = 0
        extent = 0  # the largest position, pruned videos' tokens counted whole
        for feature in sorted(mm_features, key=lambda f: f.mm_position.offset):
            placeholder = feature.mm_position
            if placeholder.offset < cursor or placeholder.end > num_tokens:
                raise ValueError(f"Placeholder {placeholder} overlaps another or the prompt end.")
            parts.append(_text_positions(placeholder.offset - cursor, next_position))
            next_position += placeholder.offset - cursor
            grid = self.vision_grid(feature)
            item_positions = vision_positions(
                grid, self.merge_size, next_position, self.time_interval(feature)
            )
            extent = max(extent, int(item_positions.max()))
            if (rows := self.kept_rows_of(feature, kept or {})) is not None:
                item_positions = item_positions[:, rows]
            if item_positions.shape[1] != placeholder.length:
                raise ValueError(
                    f"A {feature.modality} with grid {grid} takes {item_positions.shape[1]} "
                    f"tokens, but its placeholder has {placeholder.length}."
                )
            parts.append(item_positions)
            # NOTE: transformers 5.x's rule, kept for fidelity: the temporal extent is ignored
            # (older releases and vLLM resume after the item's largest position instead).
            next_position += max(grid[1], grid[2]) // self.merge_size
            cursor = placeholder.end
        parts.append(_text_positions(num_tokens - cursor, next_position))
        positions = torch.cat(parts, dim=1)  # [3, num_tokens]
        delta = max(int(positions.max()), extent) + 1 - num_tokens if num_tokens else 0
        return positions, delta

    def vision_grid(self, feature: MultiModalFeatureSpec) -> tuple[int, int, int]:
        if feature.modality not in _VISION_KEYS or feature.data is None:
            raise ValueError(f"Cannot place a {feature.modality!r} item without its data.")
        t, h, w = torch.as_tensor(feature.data[_VISION_KEYS[feature.modality][1]]).reshape(3)
        return int(t), int(h), int(w)
