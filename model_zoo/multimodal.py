"""What the multimodal families share: our paged text decoder beside Hugging Face encoders.

A model is ``model.*`` + ``lm_head`` (the shared decoder of a text family, so attention goes
through the paged cache) plus encoder modules built from transformers' own classes under their
hub names (``visual``, ``audio_tower``, ...), where reusing them is exact. Encoder outputs enter the
decoder by position (``get_input_embeddings`` scatters them by index), never by token id.

Checkpoints come in two layouts: the hub layout (what real checkpoints and transformers'
``save_pretrained`` write, e.g. ``visual.*`` / ``model.layers.*``) is our module layout; the
layout of transformers' in-memory modules (e.g. ``model.visual.*`` /
``model.language_model.layers.*``) is renamed by ``checkpoint_prefixes``.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Set
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.vision_utils import (
    get_vision_cu_seqlens,
    get_vision_interpolation_indices_and_weights,
    get_vision_position_ids,
    get_vision_window_index,
)

from model_zoo.decoder import DecoderForCausalLM, LanguageModel
from omniserve.attention.encoder import segment_bounds
from omniserve.layers.weight_utils import WeightRoute, load_weights_by_route, route_stacked
from omniserve.multimodal.inputs import MultiModalFeatureSpec
from omniserve.multimodal.pruning import VideoPruning
from omniserve.transfers import upload

logger = logging.getLogger(__name__)

_DECODER_PREFIXES = ("model.", "lm_head.")


def on_device(device: torch.device, **tensors: torch.Tensor) -> dict[str, torch.Tensor]:
    """Host tensors on ``device`` in one pinned copy, by name."""
    return dict(zip(tensors, upload(device, list(tensors.values())), strict=True))


def run_vision_tower(visual: nn.Module, pixel_values: torch.Tensor, grid: torch.Tensor) -> Any:
    """A transformers vision tower's output for ``pixel_values`` (on the device) of the items of
    ``grid`` (``grid_thw``, on the host).

    What the tower derives from the grid is derived here, on the host, and passed in (the
    towers' forwards take it precomputed): derived in the tower from a device grid, it reads the
    grid back, per item and in every attention layer, and each read waits for all the work
    queued on the device. The attention boundaries stay on the host where the tower's SDPA
    attention splits by them, and go up with their longest lengths where it attends packed
    (``omniserve.attention.encoder``)."""
    merge = visual.spatial_merge_size
    bounds = {"cu_seqlens": get_vision_cu_seqlens(grid)}
    device_side = {"position_ids": get_vision_position_ids(grid, merge)}
    if hasattr(visual, "window_size"):  # Qwen2.5's windowed attention
        device_side["window_index"], bounds["cu_window_seqlens"] = get_vision_window_index(
            grid, spatial_merge_size=merge, window_size=visual.window_size,
            patch_size=visual.patch_size,
        )  # fmt: skip
    if hasattr(visual, "num_grid_per_side"):  # Qwen3's interpolated position embeddings
        device_side["interp_indices"], device_side["interp_weights"] = (
            get_vision_interpolation_indices_and_weights(
                grid, num_grid_per_side=visual.num_grid_per_side,
                mode=visual.interpolation_mode, align_corners=visual.interpolation_align_corners,
                spatial_merge_size=visual.config.spatial_merge_size,
            )
        )  # fmt: skip
    host, uploaded = segment_bounds(visual, **bounds)
    kwargs = host | on_device(pixel_values.device, **device_side, **uploaded)
    return visual(pixel_values, grid_thw=grid, **kwargs)


def mm_rows(is_mm: torch.Tensor, mm_embeds: torch.Tensor) -> torch.Tensor:
    """``[len(mm_embeds)]`` indices of the rows ``is_mm`` sets. Sized by the embeddings, so the
    device is never read for the count (``nonzero`` would wait for all queued work)."""
    return torch.nonzero_static(is_mm, size=mm_embeds.shape[0]).squeeze(1)


class PrunesVideo(ABC):
    """The ``--video-pruning-rate`` hooks of a model with a vision tower whose processor prunes
    videos (``omniserve.multimodal.pruning``): the worker turns pruning on, the encoder runner
    asks how an item is pruned and which output rows are its video's, the model's M-RoPE
    positions ask which of its tokens are kept."""

    config: PretrainedConfig
    merge_size: int
    """Patches merged per side into one embedding."""
    video_pruning_rate: float = 0.0
    video_pruning_per_frame: bool = False

    def set_video_pruning(self, rate: float, per_frame: bool) -> None:
        """Prune each video's tokens (``--video-pruning-rate``), kept in the layout its processor
        gives the prompt (``BaseProcessingInfo.video_pruning_layout``)."""
        self.video_pruning_rate, self.video_pruning_per_frame = rate, per_frame

    @abstractmethod
    def vision_grid(self, feature: MultiModalFeatureSpec) -> tuple[int, int, int]:
        """An image's or video's ``(t, h, w)`` patch grid."""

    def video_pruning(self, feature: MultiModalFeatureSpec) -> VideoPruning | None:
        """How the item is pruned; None: it is not (not a video, or no pruning)."""
        if feature.modality != "video" or not self.video_pruning_rate:
            return None
        t, h, w = self.vision_grid(feature)
        return VideoPruning(t, h * w // self.merge_size**2, self.video_pruning_rate,
                            self.video_pruning_per_frame,
                            compared_width=self.config.get_text_config().hidden_size)  # fmt: skip

    def pruned_video_rows(self, feature: MultiModalFeatureSpec) -> np.ndarray | None:
        """The rows of a pruned item's encoder output that are its video's (None: all of them;
        a video with its soundtrack interleaves audio rows)."""
        return None

    def kept_rows_of(
        self, feature: MultiModalFeatureSpec, kept: Mapping[str, torch.Tensor]
    ) -> torch.Tensor | None:
        """The video tokens a pruned item keeps (``kept``: the encoder runner's, by identifier;
        stand-ins until it has run), or None where nothing is pruned."""
        pruning = self.video_pruning(feature)
        if pruning is None:
            return None
        rows = kept.get(feature.identifier)
        return pruning.provisional_rows() if rows is None else rows


class MultiModalDecoderBase(LanguageModel, ABC):
    """Base of the ``*ForConditionalGeneration`` classes: the text family's language model, plus
    the encoders and ``get_multimodal_embeddings`` subclasses add."""

    supports_multimodal: ClassVar[bool] = True
    uses_mrope: ClassVar[bool] = False
    text_family: ClassVar[type[DecoderForCausalLM]]
    """The text model whose decoder spec, MLPs and fused-weight mapping the decoder uses."""
    packed_attention_towers: ClassVar[tuple[str, ...]] = ()
    """The encoder towers that attend within ``cu_seqlens`` segments and take packed attention
    on CUDA (``omniserve.attention.encoder``); their callers pass bounds by ``segment_bounds``."""
    checkpoint_prefixes: ClassVar[tuple[tuple[str, str], ...]] = ()
    """(checkpoint prefix, our prefix) renames for other layouts of the same weights; first
    match wins, names matching none are already ours."""
    tower_modalities: ClassVar[dict[str, tuple[str, ...]]] = {}
    """Each encoder module (by attribute name) -> the modalities it encodes: ``drop_towers``
    leaves out those whose modalities are all turned off."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self._dropped_prefixes: tuple[str, ...] = ()  # drop_towers'
        self._skipped_tensors = 0
        # The composite config decides tying (transformers reads it there, not on text_config).
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        text_config = config.get_text_config()
        self.init_language_model(
            self.text_family,
            text_config,
            tie_word_embeddings=self.tie_word_embeddings,
            rotary=self.make_rotary(text_config),
        )

    def drop_towers(self, modalities_off: Set[str]) -> list[str]:
        """Remove the encoder modules whose every modality is off (vLLM's ``--limit-mm-per-prompt``
        0, ``--language-model-only``), before the weights are read: their parameters are never
        allocated for real, and their checkpoint tensors are skipped when loading. Returns the
        names removed."""
        dropped = [name for name, modalities in self.tower_modalities.items()
                   if set(modalities) <= modalities_off]  # fmt: skip
        for name in dropped:
            setattr(self, name, None)
        self._dropped_prefixes = tuple(f"{name}." for name in dropped)
        return dropped

    @classmethod
    def make_rotary(cls, text_config: PretrainedConfig) -> nn.Module | None:
        """The decoder's rotary embedding; None: the one ``text_config`` describes."""
        return None

    @abstractmethod
    def get_multimodal_embeddings(
        self, modality: str, items: list[dict[str, torch.Tensor]]
    ) -> list[torch.Tensor]:
        """One ``[num_embeds_of_item, hidden_size]`` tensor per item, in order."""

    def vision_outputs(self, pixel_values: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """``[num_merged_patches, width]`` rows the decoder takes for the patches of ``grid``,
        from the model's ``visual`` tower (models with one)."""
        return run_vision_tower(self.visual, pixel_values, grid).pooler_output

    def get_input_embeddings(
        self,
        input_ids: torch.Tensor,
        mm_embeds: torch.Tensor | None = None,
        is_mm: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings ``[num_tokens, hidden_size]``, with the rows where ``is_mm``
        (``[num_tokens]`` bool) is set replaced, in order, by ``mm_embeds``. The caller
        guarantees that ``is_mm`` sets exactly ``len(mm_embeds)`` rows (the runner checks it on
        the host: counting them here would read the device)."""
        embeds = self.model.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        if mm_embeds is None:
            return embeds
        if is_mm is None:
            raise ValueError("mm_embeds needs is_mm, the mask of the rows it replaces.")
        return embeds.index_copy(0, mm_rows(is_mm, mm_embeds), mm_embeds.to(embeds.dtype))

    def checkpoint_to_param_name(self, name: str) -> str:
        for prefix, ours in self.checkpoint_prefixes:
            if name.startswith(prefix):
                return ours + name[len(prefix) :]
        return name

    def route_weight(self, name: str) -> WeightRoute | None:
        """Checkpoint key -> (parameter, shard); None skips keys that carry no parameter."""
        name = self.checkpoint_to_param_name(name)
        if name.endswith(".inv_freq"):  # rotary buffers some checkpoints store
            return None
        if not name.startswith(_DECODER_PREFIXES):
            if name.startswith(self._dropped_prefixes):
                self._skipped_tensors += 1
                return None
            return name, ()  # encoder parameters are whole, unfused tensors
        if self.tie_word_embeddings and name == "lm_head.weight":
            return None
        return route_stacked(name, self.text_family.stacked_params)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return self.log_skipped_towers(load_weights_by_route(self, weights, self.route_weight))

    def log_skipped_towers(self, loaded: set[str]) -> set[str]:
        """``loaded``, after a log line of the tensors ``drop_towers`` skipped."""
        if self._skipped_tensors:
            logger.info(
                "Skipped %d checkpoint tensors of %s: their modalities are turned off.",
                self._skipped_tensors, ", ".join(p.rstrip(".") for p in self._dropped_prefixes),
            )  # fmt: skip
            self._skipped_tensors = 0
        return loaded
