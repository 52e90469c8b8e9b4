"""Qwen3-VL: transformers' vision tower with DeepStack, our Qwen3 decoder with interleaved M-RoPE;
Qwen3-VL-MoE: the same with the Qwen3-MoE decoder (its experts stored as one tensor per projection).

DeepStack (shared with Qwen3-Omni, whose vision tower is this one): the tower also returns one
merged feature map per ``deepstack_visual_indexes`` layer, and transformers adds level i to the
hidden states after decoder layer i at the visual token positions. Here an item's embeddings are
``[num_embeds, hidden * (1 + levels)]``, the main embedding followed by its DeepStack levels, so
both travel as one tensor through the encoder cache and the runner's gather, and a chunked
prefill gets exactly the rows of its own tokens (rows without levels, such as audio, carry zeros:
adding zero is exact). ``get_input_embeddings`` splits the rows, merges the main part and keeps
the DeepStack part with the row indices for the ``forward`` that follows, a one-step handoff: the
runner always calls ``get_input_embeddings`` right before ``forward``, which consumes it and
checks the token count.

Positions (transformers' ``get_rope_index`` for Qwen3-VL): text, timestamps and markers advance
one per token; an image spans its merged (t, h, w) grid from the running position; a video is cut
into its frame groups (one run of pads each, between a timestamp and markers), each spanning a
(1, h, w) grid. After each grid the running position advances by ``max(h, w)``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

from model_zoo.multimodal import MultiModalDecoderBase, mm_rows, run_vision_tower
from model_zoo.qwen2_vl import Qwen2VLForConditionalGeneration, vision_positions
from model_zoo.qwen3 import Qwen3ForCausalLM
from model_zoo.qwen3_moe import Qwen3MoeForCausalLM
from omniserve.layers.fused_moe import FusedMoE
from omniserve.layers.weight_utils import LoadedWeight, WeightRoute
from omniserve.multimodal.inputs import MultiModalFeatureSpec
from omniserve.multimodal.registry import MULTIMODAL_REGISTRY
from processors.qwen3_vl import (
    Qwen3VLDummyInputsBuilder,
    Qwen3VLMultiModalProcessor,
    Qwen3VLProcessingInfo,
)


@dataclass
class DeepstackInput:
    """DeepStack rows of one step, handed from ``get_input_embeddings`` to ``forward``."""

    rows: torch.Tensor  # [num_mm_tokens] flattened-token index of each multimodal row
    embeds: torch.Tensor  # [num_mm_tokens, num_levels, hidden_size]
    num_tokens: int


class DeepStackDecoder(MultiModalDecoderBase):
    """The DeepStack handoff (see the module doc) and the decoder's forward with it."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.hidden_size: int = config.get_text_config().hidden_size
        self.num_deepstack = len(config.vision_config.deepstack_visual_indexes)
        self._deepstack: DeepstackInput | None = None

    def vision_outputs(self, pixel_values: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        out = run_vision_tower(self.visual, pixel_values, grid)
        # [num_merged_patches, hidden * (1 + num_deepstack)]: main embedding, then each level
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)

    def get_input_embeddings(
        self,
        input_ids: torch.Tensor,
        mm_embeds: torch.Tensor | None = None,
        is_mm: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Merged token embeddings; the DeepStack part of ``mm_embeds`` is kept for ``forward``."""
        self._deepstack = None
        if mm_embeds is None:
            return super().get_input_embeddings(input_ids)
        width = self.hidden_size * (1 + self.num_deepstack)
        if mm_embeds.shape[-1] != width:
            raise ValueError(f"Multimodal rows are {mm_embeds.shape[-1]} wide, expected {width}.")
        main, levels = mm_embeds.split([self.hidden_size, width - self.hidden_size], dim=-1)
        embeds = super().get_input_embeddings(input_ids, main, is_mm)
        if self.num_deepstack:
            assert is_mm is not None  # checked by the merge above
            self._deepstack = DeepstackInput(
                rows=mm_rows(is_mm, mm_embeds),
                embeds=levels.reshape(-1, self.num_deepstack, self.hidden_size).to(embeds.dtype),
                num_tokens=input_ids.shape[0],
            )
        return embeds

    def take_deepstack(self, inputs_embeds: torch.Tensor) -> DeepstackInput | None:
        """This step's DeepStack rows (consumed), checked against the forward's tokens."""
        deepstack, self._deepstack = self._deepstack, None
        if deepstack is not None and deepstack.num_tokens != inputs_embeds.shape[0]:
            raise RuntimeError(
                f"DeepStack rows were prepared for {deepstack.num_tokens} tokens, but forward got "
                f"{inputs_embeds.shape[0]}: call get_input_embeddings right before forward."
            )
        return deepstack

    def add_deepstack(
        self, deepstack: DeepstackInput | None, layer: int, hidden_states: torch.Tensor
    ) -> torch.Tensor:
        """Layer ``layer``'s output with its DeepStack level added at the multimodal rows."""
        if deepstack is None or layer >= self.num_deepstack:
            return hidden_states
        return hidden_states.index_add(0, deepstack.rows, deepstack.embeds[:, layer])

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decoder, adding DeepStack level i after layer i at this step's multimodal rows."""
        inputs_embeds = self.model.embed(input_ids, inputs_embeds)
        deepstack = self.take_deepstack(inputs_embeds)
        if deepstack is None:
            return self.model(None, positions, inputs_embeds)
        return self.model(
            None, positions, inputs_embeds, lambda i, h: self.add_deepstack(deepstack, i, h)
        )


@MULTIMODAL_REGISTRY.register_processor(
    Qwen3VLMultiModalProcessor,
    info=Qwen3VLProcessingInfo,
    dummy_inputs=Qwen3VLDummyInputsBuilder,
)
class Qwen3VLForConditionalGeneration(DeepStackDecoder, Qwen2VLForConditionalGeneration):
    text_family = Qwen3ForCausalLM
    vision_tower_cls: ClassVar[type[nn.Module]] = Qwen3VLVisionModel

    def get_mrope_input_positions(
        self,
        prompt_token_ids: list[int],
        mm_features: list[MultiModalFeatureSpec],
        kept: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, int]:
        """``([3, len(prompt)] int64 positions, delta)``; a token at p >= len(prompt) sits at
        ``p + delta`` on all three axes. ``kept``: pruned videos' kept rows, by identifier (each
        frame group keeps the positions of its own kept tokens; see Qwen2-VL's module doc)."""
        num_tokens = len(prompt_token_ids)
        parts: list[torch.Tensor] = []
        position = cursor = extent = 0

        def text(n: int) -> None:
            nonlocal position
            parts.append(torch.arange(position, position + n, dtype=torch.int64).expand(3, -1))
            position += n

        def grid(
            t: int, h: int, w: int, length: int, where: str, rows: torch.Tensor | None = None
        ) -> None:
            nonlocal position, extent
            positions = vision_positions((t, h, w), self.merge_size, position, 1)
            extent = max(extent, int(positions.max()))
            if rows is not None:  # a pruned frame group's kept tokens
                positions = positions[:, rows]
            if positions.shape[1] != length:
                raise ValueError(
                    f"{where} with grid {(t, h, w)} takes {positions.shape[1]} tokens, but its "
                    f"placeholder has {length}."
                )
            parts.append(positions)
            position += max(h, w) // self.merge_size

        for feature in sorted(mm_features, key=lambda f: f.mm_position.offset):
            placeholder = feature.mm_position
            if placeholder.offset < cursor or placeholder.end > num_tokens:
                raise ValueError(f"Placeholder {placeholder} overlaps another or the prompt end.")
            text(placeholder.offset - cursor)
            t, h, w = self.vision_grid(feature)
            if feature.modality == "image":
                grid(t, h, w, placeholder.length, "An image")
            else:  # frame groups: runs of pads between timestamps and markers
                is_embed = placeholder.is_embed or [True] * placeholder.length
                runs = [(embed, len(list(run))) for embed, run in itertools.groupby(is_embed)]
                if sum(1 for embed, _ in runs if embed) != t:
                    raise ValueError(f"A video of {t} frame groups has placeholder {placeholder}.")
                rows = self.kept_rows_of(feature, kept or {})
                per_frame = h * w // self.merge_size**2
                group = 0
                for embed, length in runs:
                    if not embed:
                        text(length)
                        continue
                    mine = None
                    if rows is not None:
                        first = group * per_frame
                        mine = rows[(rows >= first) & (rows < first + per_frame)] - first
                    grid(1, h, w, length, "A video frame group", mine)
                    group += 1
            cursor = placeholder.end
        text(num_tokens - cursor)
        positions = torch.cat(parts, dim=1)  # [3, num_tokens]
        delta = max(int(positions.max()), extent) + 1 - num_tokens if num_tokens else 0
        return positions, delta


@MULTIMODAL_REGISTRY.register_processor(
    Qwen3VLMultiModalProcessor,
    info=Qwen3VLProcessingInfo,
    dummy_inputs=Qwen3VLDummyInputsBuilder,
)
class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    text_family = Qwen3MoeForCausalLM

    def route_weight(self, name: str) -> WeightRoute | None:
        return FusedMoE.route_expert_weight(self.checkpoint_to_param_name(name)) or (
            super().route_weight(name)
        )

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        text = self.config.text_config
        return super().load_weights(
            FusedMoE.split_fused_experts(weights, text.hidden_size, text.moe_intermediate_size)
        )
