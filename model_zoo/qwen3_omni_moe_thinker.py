"""Qwen3-Omni-MoE thinker: transformers' encoders, our Qwen3-MoE decoder with interleaved M-RoPE
and DeepStack.

DeepStack is Qwen3-VL's (``model_zoo.qwen3_vl.DeepStackDecoder``); audio rows carry zeros in
the DeepStack part.

Audio: the tower cuts each clip into ``2 * n_window``-frame chunks padded to the widest chunk of
the call, and its convolutions see that padding (transformers does not mask it). So a clip is
encoded as transformers encodes it alone: clips are batched only with clips of the same padded
chunk width (all clips of at least ``2 * n_window`` frames share one call).

Positions (transformers' ``get_rope_index`` for this thinker): text and the start/end markers
advance one per token; images and videos span their merged grid with the unfloored temporal index
``i * second_per_grid * position_id_per_seconds`` (float32, as the reference); an audio-in-video
item merges video and audio positions by timestamp, video first on ties. Positions are int64
whenever they are all integral (every fps the processor defaults to) and float32 otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeAudioEncoder,
    Qwen3OmniMoeCode2Wav,
    Qwen3OmniMoeVisionEncoder,
    chunk_and_pad_features,
    get_audio_cu_seqlens,
    get_valid_indices,
)

from model_zoo.multimodal import on_device
from model_zoo.qwen2_5_omni_thinker import (
    OmniThinkerBase,
    PositionPieces,
    audio_frames,
    embed_span,
    grid_positions,
    grid_thw,
    is_audio_in_video,
    item_data,
    load_omni_weights,
    num_audio_frames,
    seconds_per_grid,
    thinker_rope,
)
from model_zoo.qwen3_moe import Qwen3MoeForCausalLM
from model_zoo.qwen3_omni_moe_speech import (
    Code2WavStream,
    Qwen3OmniMoeSpeechConfig,
    Qwen3OmniMoeTalker,
)
from model_zoo.qwen3_vl import DeepStackDecoder
from model_zoo.towers import adopt_tower
from omniserve.attention.encoder import segment_bounds
from omniserve.layers.fused_moe import FusedMoE
from omniserve.layers.rotary_embedding import InterleavedMRotaryEmbedding
from omniserve.layers.weight_utils import WeightRoute
from omniserve.multimodal.inputs import MultiModalFeatureSpec
from omniserve.multimodal.registry import MULTIMODAL_REGISTRY
from processors.qwen3_omni_audio import get_feat_extract_output_lengths
from processors.qwen3_omni_moe_thinker import (
    Qwen3OmniMoeThinkerDummyInputsBuilder,
    Qwen3OmniMoeThinkerMultiModalProcessor,
    Qwen3OmniMoeThinkerProcessingInfo,
    get_audio_in_video_order,
)

_PLACEHOLDERS = {
    "image": "<|vision_start|><|image_pad|><|vision_end|>",
    "video": "<|vision_start|><|video_pad|><|vision_end|>",
    "audio": "<|audio_start|><|audio_pad|><|audio_end|>",
}


def qwen3_omni_rope(text_config: PretrainedConfig) -> InterleavedMRotaryEmbedding:
    """The thinker's and the talker's M-RoPE (transformers' default section 24/20/20)."""
    return thinker_rope(text_config, [24, 20, 20], InterleavedMRotaryEmbedding)


@MULTIMODAL_REGISTRY.register_processor(
    Qwen3OmniMoeThinkerMultiModalProcessor,
    info=Qwen3OmniMoeThinkerProcessingInfo,
    dummy_inputs=Qwen3OmniMoeThinkerDummyInputsBuilder,
)
class Qwen3OmniMoeThinkerForConditionalGeneration(DeepStackDecoder, OmniThinkerBase):
    text_family = Qwen3MoeForCausalLM
    placeholders = _PLACEHOLDERS

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.visual = adopt_tower(Qwen3OmniMoeVisionEncoder(config.vision_config))
        self.audio_tower = adopt_tower(Qwen3OmniMoeAudioEncoder(config.audio_config))
        self.tap_layer: int | None = None
        """Keep ``hidden_states[tap_layer]`` of each forward (transformers' numbering: 0 the
        embeddings, i the output of layer i) in ``tapped``: the talker reads it."""
        self.tapped: torch.Tensor | None = None

    @classmethod
    def make_rotary(cls, text_config: PretrainedConfig) -> InterleavedMRotaryEmbedding:
        return qwen3_omni_rope(text_config)

    # ---- encoders --------------------------------------------------------------------------------
    def audio_output_lengths(self, num_frames: torch.Tensor) -> torch.Tensor:
        return get_feat_extract_output_lengths(num_frames, self.config.audio_config.n_window)

    def audio_in_video_order(self, item: dict[str, Any]) -> torch.Tensor:
        return get_audio_in_video_order(item)

    def encode_audio(self, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        num_frames = [num_audio_frames(item) for item in items]
        sizes = self.audio_lengths(num_frames)
        tower = self.audio_tower
        groups: dict[int, list[int]] = {}  # padded chunk width -> items
        for i, n in enumerate(num_frames):
            groups.setdefault(min(n, 2 * tower.n_window), []).append(i)
        out: list[torch.Tensor] = [torch.empty(0)] * len(items)
        for members in groups.values():
            features = torch.cat([audio_frames(items[i]) for i in members], dim=1)  # [mel, frames]
            features = features.to(tower.conv2d1.weight.dtype)
            # What the tower derives from the lengths, derived on the host (see run_vision_tower).
            feature_lens = torch.tensor([num_frames[i] for i in members])
            padded, chunk_lengths = chunk_and_pad_features(features, feature_lens, tower.n_window)
            host, bounds = segment_bounds(tower, cu_seqlens=get_audio_cu_seqlens(
                chunk_lengths, feature_lens, tower.n_window_infer, tower.n_window
            ))  # fmt: skip
            hidden = tower(
                padded_feature=padded,
                chunk_lengths=chunk_lengths,
                **host,
                **on_device(
                    features.device,
                    valid_indices=get_valid_indices(chunk_lengths, tower.n_window),
                    **bounds,
                ),
            )
            rows = hidden.last_hidden_state.split([sizes[i] for i in members])
            for i, item_rows in zip(members, rows, strict=True):
                out[i] = F.pad(item_rows, (0, self.hidden_size * self.num_deepstack))  # no levels
        return out

    # ---- decoder with DeepStack ------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decoder, adding DeepStack level i after layer i at this step's multimodal rows."""
        inputs_embeds = self.model.embed(input_ids, inputs_embeds)
        deepstack = self.take_deepstack(inputs_embeds)
        num_layers = len(self.model.layers)
        if self.tap_layer == 0:
            self.tapped = inputs_embeds

        def after_layer(i: int, hidden_states: torch.Tensor) -> torch.Tensor:
            if self.tap_layer == i + 1 < num_layers:
                self.tapped = hidden_states  # transformers taps a layer before DeepStack
            return self.add_deepstack(deepstack, i, hidden_states)

        hidden_states = self.model(None, positions, inputs_embeds, after_layer)
        if self.tap_layer == num_layers:
            self.tapped = hidden_states  # its last "hidden state" is the normed output
        return hidden_states

    def route_weight(self, name: str) -> WeightRoute | None:
        return FusedMoE.route_expert_weight(self.checkpoint_to_param_name(name)) or (
            super().route_weight(name)
        )

    # ---- M-RoPE ----------------------------------------------------------------------------------
    def temporal_index(self, feature: MultiModalFeatureSpec, t: int) -> torch.Tensor:
        step = 1 if feature.modality == "image" else seconds_per_grid(item_data(feature))
        return (torch.arange(t) * step * self.config.position_id_per_seconds).float()

    def get_mrope_input_positions(
        self,
        prompt_token_ids: list[int],
        mm_features: list[MultiModalFeatureSpec],
        kept: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, int | float]:
        """``([3, len(prompt)] positions, delta)`` as transformers' ``get_rope_index``; int64
        and an int delta when integral, else float32 and a float delta (non-default fps).
        ``kept``: pruned videos' kept tokens, by identifier (``PositionPieces``)."""
        num_tokens = len(prompt_token_ids)
        pieces = PositionPieces(torch.float32)
        cursor = 0
        for feature in sorted(mm_features, key=lambda f: f.mm_position.offset):
            first, end = embed_span(feature)
            composite = feature.modality == "video" and is_audio_in_video(item_data(feature))
            markers = 2 if composite else 1  # start/end markers around the item's tokens
            if first - markers < cursor or end + markers > num_tokens:
                raise ValueError(
                    f"Placeholder {feature.mm_position} needs {markers} marker token(s) on each "
                    "side, not shared with another item."
                )
            # The reference's running start: text, then the start markers, then the item.
            start = pieces.start()
            pieces.run(first - markers - cursor, start)
            start = start + (first - markers - cursor)
            pieces.run(markers, start)
            start = start + markers
            rows = self.kept_rows_of(feature, kept or {})
            if feature.modality == "audio":
                pieces.run(end - first, start)
            elif composite:
                self._add_audio_in_video(pieces, feature, start, rows)
            else:
                t, h, w = grid_thw(feature)
                offsets = grid_positions(
                    self.temporal_index(feature, t), h // self.merge_size, w // self.merge_size
                )
                whole = offsets + start
                pieces.add(whole if rows is None else whole[:, rows], whole)
            pieces.run(markers)  # end markers, one past the last piece
            cursor = end + markers
        pieces.run(num_tokens - cursor)
        positions, delta = pieces.finish(num_tokens)
        if torch.equal(positions, positions.round()):
            return positions.long(), int(delta)
        return positions, float(delta)

    def _add_audio_in_video(
        self,
        pieces: PositionPieces,
        feature: MultiModalFeatureSpec,
        start: torch.Tensor,
        rows: torch.Tensor | None = None,
    ) -> None:
        """Video and audio positions from ``start``, merged by temporal position (video first on
        ties); the reference's last piece is the run left after the other modality ran out.
        ``rows``: the video tokens a pruned video keeps (the others' columns dropped)."""
        t, h, w = grid_thw(feature)
        video = grid_positions(
            self.temporal_index(feature, t), h // self.merge_size, w // self.merge_size
        )
        video = video + start  # [3, num_video]
        (num_audio,) = self.audio_lengths([num_audio_frames(item_data(feature))])
        audio = torch.arange(num_audio, dtype=torch.float32).expand(3, -1) + start
        merged = torch.cat([video, audio], dim=1)  # [3, num_video + num_audio]
        order = torch.sort(merged[0], stable=True).indices  # both inputs are non-decreasing
        is_video = order < video.shape[1]
        switches = (is_video != is_video[-1]).nonzero()
        tail = int(switches[-1]) + 1 if switches.numel() else 0
        keep = torch.ones(merged.shape[1], dtype=torch.bool)
        if rows is not None:
            keep[: video.shape[1]] = False
            keep[rows] = True
        for run in (order[:tail], order[tail:]):
            pieces.add(merged[:, run[keep[run]]], merged[:, run])


@MULTIMODAL_REGISTRY.register_processor(
    Qwen3OmniMoeThinkerMultiModalProcessor,
    info=Qwen3OmniMoeThinkerProcessingInfo,
    dummy_inputs=Qwen3OmniMoeThinkerDummyInputsBuilder,
)
class Qwen3OmniMoeForConditionalGeneration(Qwen3OmniMoeThinkerForConditionalGeneration):
    """The full checkpoint: the thinker, and unless ``enable_audio_output`` is off (what
    ``--disable-audio-output`` sets) the talker and code2wav, which the talker runner drives."""

    speech_submodels: ClassVar[tuple[str, ...]] = ("talker", "code2wav")
    speech_family: ClassVar[str] = "qwen3_omni"

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config.thinker_config)
        self.speaks = bool(getattr(config, "enable_audio_output", True))
        if self.speaks:
            self.speech_config = Qwen3OmniMoeSpeechConfig(config)
            self.talker = Qwen3OmniMoeTalker(
                config.talker_config, qwen3_omni_rope(config.talker_config.text_config)
            )
            self.code2wav = Qwen3OmniMoeCode2Wav(config.code2wav_config)
            self.tap_layer = self.speech_config.accept_hidden_layer

    def vocoder_stream(self) -> Code2WavStream:
        """code2wav, streamed exactly (incremental transformer, convolutions with context)."""
        return Code2WavStream(self.code2wav)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_omni_weights(self, weights, self.speech_submodels)
