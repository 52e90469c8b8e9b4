"""Qwen2.5-Omni thinker: transformers' vision and audio encoders, our Qwen2 decoder with M-RoPE.

Items: images and videos go through the vision tower (Qwen2.5-VL's windowed ViT), audio clips
through the Whisper-style audio tower, which packs each clip's valid mel frames into
``2 * n_window``-frame chunks (padding is masked between its convolutions, so a clip's embeddings
do not depend on the other clips of the call). A video with its audio track
(``use_audio_in_video``) is ONE "video" item whose data carries both encoders' inputs; its
embeddings come back in token order, interleaved by the processor's own rule (2-second chunks:
video chunk 0, audio chunk 0, video chunk 1, ...).

M-RoPE positions are transformers' ``get_rope_index`` for the thinker: each piece starts one past
the largest position of the piece before it; text advances one per token; an image or video spans
its merged (t, h, w) grid, frame group i at temporal offset
``floor(i * second_per_grid * position_id_per_seconds)``; audio advances one per token. In an
audio-in-video item the two start markers share one position, the interleaved video and audio
both start right after them, and the two end markers share the position after the last chunk.

Full-model checkpoints (``Qwen2_5OmniForConditionalGeneration``: thinker, talker, token2wav) load
all three and speak (``model_zoo.qwen2_5_omni_speech``); with ``--disable-audio-output`` the
thinker alone loads and the speech sub-models' keys are skipped and logged.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniAudioEncoder,
    Qwen2_5OmniToken2WavModel,
    Qwen2_5OmniVisionEncoder,
    chunk_and_pad_features,
    get_audio_cu_seqlens,
    get_pool_indices,
    get_valid_indices,
)

from model_zoo.decoder import head_dim_of
from model_zoo.multimodal import (
    MultiModalDecoderBase,
    PrunesVideo,
    on_device,
)
from model_zoo.qwen2 import Qwen2ForCausalLM
from model_zoo.qwen2_5_omni_speech import (
    Qwen2_5OmniSpeechConfig,
    Qwen2_5OmniTalker,
    Token2WavOnce,
    load_voices,
)
from model_zoo.towers import adopt_tower
from omniserve.attention.encoder import segment_bounds
from omniserve.layers.rotary_embedding import MRotaryEmbedding, get_rope
from omniserve.layers.weight_utils import WeightRoute, default_dtype, load_weights_by_route
from omniserve.multimodal.inputs import MultiModalFeatureSpec, host_data
from omniserve.multimodal.registry import MULTIMODAL_REGISTRY
from processors.qwen2_5_omni_audio import get_feat_extract_output_lengths
from processors.qwen2_5_omni_thinker import (
    Qwen2_5OmniThinkerDummyInputsBuilder,
    Qwen2_5OmniThinkerMultiModalProcessor,
    Qwen2_5OmniThinkerProcessingInfo,
    get_audio_in_video_order,
)

logger = logging.getLogger(__name__)

# modality -> (patch rows key, patch grid key) in an item's data
VISION_KEYS = {
    "image": ("pixel_values", "image_grid_thw"),
    "video": ("pixel_values_videos", "video_grid_thw"),
}
_PLACEHOLDERS = {
    "image": "<|vision_bos|><|IMAGE|><|vision_eos|>",
    "video": "<|vision_bos|><|VIDEO|><|vision_eos|>",
    "audio": "<|audio_bos|><|AUDIO|><|audio_eos|>",
}


# ---- item data -----------------------------------------------------------------------------------
def item_data(feature: MultiModalFeatureSpec) -> dict[str, Any]:
    if feature.data is None:
        raise ValueError(f"Cannot place a {feature.modality!r} item without its data.")
    return feature.data


def is_audio_in_video(data: dict[str, Any]) -> bool:
    """Whether a video item carries its audio track (the composite audio-in-video item)."""
    return bool(torch.as_tensor(host_data(data).get("use_audio_in_video", False)).any())


def num_audio_frames(data: dict[str, Any]) -> int:
    """An item's number of valid log-mel frames, read from its host mask (which marks a prefix:
    the feature extractor pads at the end)."""
    mask = host_data(data)["feature_attention_mask"].reshape(-1)
    num_frames = int(mask.sum())
    if not bool(mask[:num_frames].all()):
        raise ValueError("An audio item's feature_attention_mask must mark a prefix of frames.")
    return num_frames


def audio_frames(data: dict[str, Any]) -> torch.Tensor:
    """An item's valid log-mel frames ``[num_mel_bins, num_frames]`` (padding dropped)."""
    features = data["input_features"]
    features = features.reshape(-1, *features.shape[-2:])[0]  # [num_mel_bins, padded_frames]
    return features[:, : num_audio_frames(data)]


def run_audio_tower(
    tower: nn.Module, features: torch.Tensor, num_frames: list[int]
) -> torch.Tensor:
    """Qwen2.5-Omni's audio tower over ``features`` ``[num_mel_bins, frames]`` (the items' valid
    frames side by side, ``num_frames`` each): their embeddings, one after another. What the
    tower derives from the lengths is derived on the host (see ``run_vision_tower``)."""
    features = features.to(tower.conv1.weight.dtype)
    feature_lens = torch.tensor(num_frames)
    padded, chunk_lengths = chunk_and_pad_features(features, feature_lens, tower.n_window)
    host, bounds = segment_bounds(tower, cu_seqlens=get_audio_cu_seqlens(chunk_lengths))
    hidden = tower(
        padded_feature=padded,
        **host,
        **on_device(
            features.device,
            chunk_lengths=chunk_lengths,
            valid_indices=get_valid_indices(chunk_lengths),
            pool_indices=get_pool_indices(feature_lens),
            **bounds,
        ),
    )
    return hidden.last_hidden_state


def seconds_per_grid(data: dict[str, Any]) -> torch.Tensor:
    """Seconds between a video's frame groups, float32 as the HF processor returns it."""
    return torch.as_tensor(data["video_second_per_grid"], dtype=torch.float32).reshape(())


def grid_thw(feature: MultiModalFeatureSpec) -> tuple[int, int, int]:
    t, h, w = torch.as_tensor(item_data(feature)[VISION_KEYS[feature.modality][1]]).reshape(3)
    return int(t), int(h), int(w)


def embed_span(feature: MultiModalFeatureSpec) -> tuple[int, int]:
    """Prompt positions ``[first, end)`` of an item's embedding tokens, which are contiguous
    (start/end markers inside a placeholder range, if any, are not among them)."""
    pos = feature.mm_position
    if pos.is_embed is None:
        return pos.offset, pos.end
    hits = [i for i, is_embed in enumerate(pos.is_embed) if is_embed]
    if not hits or hits[-1] - hits[0] + 1 != len(hits):
        raise ValueError(f"The embedding tokens of {pos} are empty or not contiguous.")
    return pos.offset + hits[0], pos.offset + hits[-1] + 1


# ---- M-RoPE --------------------------------------------------------------------------------------
def chunk_bounds(values: Sequence[float], tokens_per_chunk: int) -> list[tuple[int, int]]:
    """transformers' ``get_chunked_index``: cut non-decreasing temporal indices into runs
    ``[start, end)`` that end where a value first reaches the next multiple of
    ``tokens_per_chunk`` (one multiple per cut, as the reference counts)."""
    bounds, start, chunk = [], 0, 1
    for i, value in enumerate(values):
        if value >= chunk * tokens_per_chunk:
            bounds.append((start, i))
            start, chunk = i, chunk + 1
    bounds.append((start, len(values)))
    return bounds


def grid_positions(t_index: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """``[3, t * h * w]`` (temporal, height, width) offsets of a merged grid, frame-major as its
    tokens are laid out; the dtype is ``t_index``'s."""
    t = t_index.shape[0]
    temporal = t_index.view(-1, 1).expand(-1, h * w).flatten()
    height = torch.arange(h).view(1, -1, 1).expand(t, -1, w).flatten().to(t_index.dtype)
    width = torch.arange(w).view(1, 1, -1).expand(t, h, -1).flatten().to(t_index.dtype)
    return torch.stack([temporal, height, width])


class PositionPieces:
    """The reference's bookkeeping: ``[3, n]`` pieces in prompt order, each new piece starting
    one past the largest position of the LAST piece (not of all pieces). A pruned video's piece
    counts with the largest position it had whole (``add``'s ``whole``), so what follows it,
    and ``delta``, sit where they would after the whole video."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.pieces: list[torch.Tensor] = []
        self.tops: list[torch.Tensor] = []

    def start(self) -> torch.Tensor:
        if not self.tops:
            return torch.zeros((), dtype=self.dtype)
        return self.tops[-1] + 1

    def add(self, piece: torch.Tensor, whole: torch.Tensor | None = None) -> None:
        """``piece``; ``whole``: the piece it was before pruning (what counts for the next)."""
        whole = piece if whole is None else whole
        if piece.shape[1]:
            self.pieces.append(piece)
        if whole.shape[1]:
            self.tops.append(whole.max())

    def run(self, n: int, start: torch.Tensor | None = None) -> None:
        """``n`` tokens one position apart (text, markers, audio) from ``start`` (default: next)."""
        start = self.start() if start is None else start
        self.add(torch.arange(n, dtype=self.dtype).expand(3, -1) + start)

    def finish(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``([3, num_tokens] positions, delta)``: decode position p sits at ``p + delta``."""
        if not self.pieces:
            return torch.zeros(3, 0, dtype=self.dtype), torch.zeros((), dtype=self.dtype)
        positions = torch.cat(self.pieces, dim=1)
        if positions.shape[1] != num_tokens:
            raise ValueError(
                f"The items' grids and placeholders give {positions.shape[1]} positions for a "
                f"{num_tokens}-token prompt."
            )
        return positions, torch.stack(self.tops).max() + 1 - num_tokens


def thinker_rope(
    text_config: PretrainedConfig, default_section: list[int], cls: type[MRotaryEmbedding]
) -> MRotaryEmbedding:
    """The thinker's M-RoPE; transformers falls back to a default ``mrope_section``."""
    rope = get_rope(text_config, head_dim_of(text_config))
    section = text_config.rope_parameters.get("mrope_section", default_section)
    return cls(rope.head_size, rope.rotary_dim, rope.inv_freq, section, rope.attention_scaling)


# ---- full-model checkpoints ----------------------------------------------------------------------
def load_omni_weights(
    model: MultiModalDecoderBase,
    weights: Iterable[tuple[str, torch.Tensor]],
    speech_submodels: tuple[str, ...],
) -> set[str]:
    """Load a full omni checkpoint.

    The rule: ``thinker.<name>`` loads as the thinker checkpoint's ``<name>``. Keys of the speech
    sub-models (``speech_submodels``: the talker and the vocoder), when the model speaks: the
    talker's through its ``route_weight``, the vocoder's as they are; when it does not, they are
    skipped and counted in a log line. Any other key is reported as unexpected.
    """
    skipped: Counter[str] = Counter()
    speaks = getattr(model, "speaks", False)

    def route(name: str) -> WeightRoute | None:
        if name.startswith("thinker."):
            return model.route_weight(name.removeprefix("thinker."))
        submodel = name.split(".", 1)[0]
        if submodel not in speech_submodels:
            return "", ()  # no parameter is named "": load_weights_by_route reports the key
        if not speaks:
            skipped[submodel] += 1
            return None
        if submodel != "talker":
            return name, ()
        routed = model.talker.route_weight(name.removeprefix("talker."))
        return None if routed is None else (f"talker.{routed[0]}", routed[1])

    loaded = model.log_skipped_towers(load_weights_by_route(model, weights, route))
    if skipped:
        logger.info(
            "Loaded the thinker of %s; skipped the speech sub-models (%s) as only text is served.",
            type(model).__name__,
            ", ".join(f"{name}: {count} tensors" for name, count in sorted(skipped.items())),
        )
    return loaded


class OmniThinkerBase(MultiModalDecoderBase, PrunesVideo):
    """What both omni thinkers share: encoders under their hub names (transformers' modules),
    composite audio-in-video items and the placeholder strings."""

    uses_mrope: ClassVar[bool] = True
    packed_attention_towers = ("visual", "audio_tower")
    tower_modalities = {"visual": ("image", "video"), "audio_tower": ("audio",)}
    """(A video's own soundtrack, ``use_audio_in_video``, needs audio on as well.)"""
    placeholders: ClassVar[dict[str, str]]
    # transformers' module names -> the hub names we use
    checkpoint_prefixes = (
        ("model.language_model.", "model."),
        ("model.visual.", "visual."),
        ("model.audio_tower.", "audio_tower."),
    )

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.merge_size: int = config.vision_config.spatial_merge_size

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str:
        """What the HF chat template renders for the i-th item of ``modality``."""
        if modality not in cls.placeholders:
            raise ValueError(f"{cls.__name__} takes image, video and audio, not {modality!r}.")
        return cls.placeholders[modality]

    def vision_grid(self, feature: MultiModalFeatureSpec) -> tuple[int, int, int]:
        return grid_thw(feature)

    def pruned_video_rows(self, feature: MultiModalFeatureSpec) -> np.ndarray | None:
        """A video with its soundtrack: the rows of its interleaved output that are video."""
        data = item_data(feature)
        if not is_audio_in_video(data):
            return None
        return np.flatnonzero(self.audio_in_video_order(data).numpy())

    def get_multimodal_embeddings(
        self, modality: str, items: list[dict[str, torch.Tensor]]
    ) -> list[torch.Tensor]:
        if modality == "image":
            return self.encode_vision("image", items)
        if modality == "audio":
            return self.encode_audio(items)
        if modality != "video":
            raise ValueError(
                f"{type(self).__name__} encodes image, video and audio, not {modality!r}."
            )
        embeds = self.encode_vision("video", items)
        composite = [i for i, item in enumerate(items) if is_audio_in_video(item)]
        if composite:
            audio = self.encode_audio([items[i] for i in composite])
            for i, audio_embeds in zip(composite, audio, strict=True):
                embeds[i] = self.interleave_item(items[i], embeds[i], audio_embeds)
        return embeds

    @abstractmethod
    def audio_in_video_order(self, item: dict[str, Any]) -> torch.Tensor:
        """The processor's token order of a composite item: ``[num_embeds]`` bool, True where
        the token takes the next video embedding, False where it takes the next audio one."""

    def interleave_item(
        self, item: dict[str, Any], video: torch.Tensor, audio: torch.Tensor
    ) -> torch.Tensor:
        """A composite item's video and audio embeddings, in its token order."""
        is_video = self.audio_in_video_order(host_data(item)).numpy()  # on the host
        video_rows, audio_rows = np.flatnonzero(is_video), np.flatnonzero(~is_video)
        if len(video_rows) != video.shape[0] or len(audio_rows) != audio.shape[0]:
            raise ValueError(
                f"An audio-in-video item lays out {len(video_rows)} video and "
                f"{len(audio_rows)} audio tokens, but the encoders gave "
                f"{video.shape[0]} and {audio.shape[0]} embeddings."
            )
        rows = on_device(video.device, video=video_rows, audio=audio_rows)
        out = video.new_empty(len(is_video), video.shape[1])  # [num_embeds, width]
        return out.index_copy_(0, rows["video"], video).index_copy_(0, rows["audio"], audio)

    def encode_vision(self, modality: str, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        pixels_key, grid_key = VISION_KEYS[modality]
        grid = torch.cat([host_data(item)[grid_key].reshape(-1, 3) for item in items])  # host
        if grid.shape[0] != len(items):
            raise ValueError(f"Each {modality} item must carry exactly one {grid_key} row.")
        pixel_values = torch.cat([item[pixels_key] for item in items]).to(self.visual.dtype)
        rows = self.vision_outputs(pixel_values, grid)
        return list(rows.split((grid.prod(-1) // self.merge_size**2).tolist()))

    @abstractmethod
    def audio_output_lengths(self, num_frames: torch.Tensor) -> torch.Tensor:
        """Embeddings of clips of ``num_frames`` valid mel frames (the processor's counts)."""

    def audio_lengths(self, num_frames: list[int]) -> list[int]:
        return self.audio_output_lengths(torch.tensor(num_frames)).tolist()

    @abstractmethod
    def encode_audio(self, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        """One ``[num_embeds, hidden]`` tensor per audio item (or video's audio track)."""


@MULTIMODAL_REGISTRY.register_processor(
    Qwen2_5OmniThinkerMultiModalProcessor,
    info=Qwen2_5OmniThinkerProcessingInfo,
    dummy_inputs=Qwen2_5OmniThinkerDummyInputsBuilder,
)
class Qwen2_5OmniThinkerForConditionalGeneration(OmniThinkerBase):
    text_family = Qwen2ForCausalLM
    placeholders = _PLACEHOLDERS

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.visual = adopt_tower(Qwen2_5OmniVisionEncoder(config.vision_config))
        self.audio_tower = adopt_tower(Qwen2_5OmniAudioEncoder(config.audio_config))

    @classmethod
    def make_rotary(cls, text_config: PretrainedConfig) -> MRotaryEmbedding:
        return thinker_rope(text_config, [16, 24, 24], MRotaryEmbedding)

    def audio_output_lengths(self, num_frames: torch.Tensor) -> torch.Tensor:
        return get_feat_extract_output_lengths(num_frames)

    def audio_in_video_order(self, item: dict[str, Any]) -> torch.Tensor:
        return get_audio_in_video_order(item)

    def encode_audio(self, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        num_frames = [num_audio_frames(item) for item in items]
        features = torch.cat([audio_frames(item) for item in items], dim=1)  # [mel, frames]
        hidden = run_audio_tower(self.audio_tower, features, num_frames)
        return list(hidden.split(self.audio_lengths(num_frames)))

    def temporal_index(self, feature: MultiModalFeatureSpec, t: int) -> torch.Tensor:
        """Frame-group temporal offsets, floored as the reference does (images: step 1 s)."""
        step = 1 if feature.modality == "image" else seconds_per_grid(item_data(feature))
        return (torch.arange(t) * step * self.config.position_id_per_seconds).long()

    def get_mrope_input_positions(
        self,
        prompt_token_ids: list[int],
        mm_features: list[MultiModalFeatureSpec],
        kept: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, int]:
        """``([3, len(prompt)] int64 positions, delta)`` as transformers' ``get_rope_index``;
        ``kept``: pruned videos' kept tokens, by identifier (``PositionPieces``)."""
        pieces = PositionPieces(torch.int64)
        cursor = 0
        for feature in sorted(mm_features, key=lambda f: f.mm_position.offset):
            first, end = embed_span(feature)
            composite = feature.modality == "video" and is_audio_in_video(item_data(feature))
            markers = 2 if composite else 0  # audio-in-video: vision + audio start markers
            if first - markers < cursor or end + markers > len(prompt_token_ids):
                raise ValueError(f"Placeholder {feature.mm_position} overlaps another item.")
            pieces.run(first - markers - cursor)
            rows = self.kept_rows_of(feature, kept or {})
            if composite:
                pieces.add(pieces.start().expand(3, 2))  # both start markers at one position
                self._add_audio_in_video(pieces, feature, rows)
                pieces.add(pieces.start().expand(3, 2))  # both end markers at one position
            elif feature.modality == "audio":
                pieces.run(end - first)
            else:
                t, h, w = grid_thw(feature)
                offsets = grid_positions(
                    self.temporal_index(feature, t), h // self.merge_size, w // self.merge_size
                )
                whole = offsets + pieces.start()
                pieces.add(whole if rows is None else whole[:, rows], whole)
            cursor = end + markers
        pieces.run(len(prompt_token_ids) - cursor)
        positions, delta = pieces.finish(len(prompt_token_ids))
        return positions, int(delta)

    def _add_audio_in_video(
        self, pieces: PositionPieces, feature: MultiModalFeatureSpec, rows: torch.Tensor | None
    ) -> None:
        """Video and audio both from the next position, in 2-second chunks: video chunk j, then
        audio chunk j (the reference's ``get_chunked_index`` over temporal offsets); ``rows``:
        the video tokens a pruned video keeps (each chunk keeps its own)."""
        t, h, w = grid_thw(feature)
        t_index = self.temporal_index(feature, t)
        start = pieces.start()
        video = grid_positions(t_index, h // self.merge_size, w // self.merge_size) + start
        (num_audio,) = self.audio_lengths([num_audio_frames(item_data(feature))])
        audio = torch.arange(num_audio).expand(3, -1) + start
        tokens_per_chunk = int(self.config.position_id_per_seconds * self.config.seconds_per_chunk)
        video_chunks = chunk_bounds(video[0].sub(start).tolist(), tokens_per_chunk)
        audio_chunks = chunk_bounds(range(num_audio), tokens_per_chunk)
        for j in range(max(len(video_chunks), len(audio_chunks))):
            if j < len(video_chunks):
                a, b = video_chunks[j]
                mine = None if rows is None else rows[(rows >= a) & (rows < b)]
                pieces.add(video[:, a:b] if mine is None else video[:, mine], video[:, a:b])
            if j < len(audio_chunks):
                pieces.add(audio[:, audio_chunks[j][0] : audio_chunks[j][1]])


@MULTIMODAL_REGISTRY.register_processor(
    Qwen2_5OmniThinkerMultiModalProcessor,
    info=Qwen2_5OmniThinkerProcessingInfo,
    dummy_inputs=Qwen2_5OmniThinkerDummyInputsBuilder,
)
class Qwen2_5OmniForConditionalGeneration(Qwen2_5OmniThinkerForConditionalGeneration):
    """The full checkpoint: the thinker, and unless ``enable_audio_output`` is off (what
    ``--disable-audio-output`` sets) the talker and token2wav, which the talker runner drives."""

    speech_submodels: ClassVar[tuple[str, ...]] = ("talker", "token2wav")
    speech_family: ClassVar[str] = "qwen2_5_omni"

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config.thinker_config)
        self.speaks = bool(getattr(config, "enable_audio_output", True))
        if self.speaks:
            talker = config.talker_config
            self.speech_config = Qwen2_5OmniSpeechConfig(config, load_voices(config._name_or_path))
            self.talker = Qwen2_5OmniTalker(
                talker, thinker_rope(talker, [16, 24, 24], MRotaryEmbedding)
            )
            # token2wav runs in fp32 whatever the thinker's dtype (its filters are built here).
            with default_dtype(torch.float32):
                self.token2wav = Qwen2_5OmniToken2WavModel(config.token2wav_config)

    def vocoder_stream(self) -> Token2WavOnce:
        return Token2WavOnce(self.token2wav, self.speech_config.voices)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_omni_weights(self, weights, self.speech_submodels)
