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

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from model_zoo.decoder import DecoderForCausalLM, LanguageModel
from omniserve.layers.weight_utils import WeightRoute, load_weights_by_route, route_stacked

_DECODER_PREFIXES = ("model.", "lm_head.")


class MultiModalDecoderBase(LanguageModel, ABC):
    """Base of the ``*ForConditionalGeneration`` classes: the text family's language model, plus
    the encoders and ``get_multimodal_embeddings`` subclasses add."""

    supports_multimodal: ClassVar[bool] = True
    uses_mrope: ClassVar[bool] = False
    text_family: ClassVar[type[DecoderForCausalLM]]
    """The text model whose decoder spec, MLPs and fused-weight mapping the decoder uses."""
    checkpoint_prefixes: ClassVar[tuple[tuple[str, str], ...]] = ()
    """(checkpoint prefix, our prefix) renames for other layouts of the same weights; first
    match wins, names matching none are already ours."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        # The composite config decides tying (transformers reads it there, not on text_config).
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        text_config = config.get_text_config()
        self.init_language_model(
            self.text_family,
            text_config,
            tie_word_embeddings=self.tie_word_embeddings,
            rotary=self.make_rotary(text_config),
        )

    @classmethod
    def make_rotary(cls, text_config: PretrainedConfig) -> nn.Module | None:
        """The decoder's rotary embedding; None: the one ``text_config`` describes."""
        return None

    @abstractmethod
    def get_multimodal_embeddings(
        self, modality: str, items: list[dict[str, torch.Tensor]]
    ) -> list[torch.Tensor]:
        """One ``[num_embeds_of_item, hidden_size]`` tensor per item, in order."""

    def get_input_embeddings(
        self,
        input_ids: torch.Tensor,
        mm_embeds: torch.Tensor | None = None,
        is_mm: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings ``[num_tokens, hidden_size]``, with the rows where ``is_mm``
        (``[num_tokens]`` bool) is set replaced, in order, by ``mm_embeds``."""
        embeds = self.model.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        if mm_embeds is None:
            return embeds
        if is_mm is None:
            raise ValueError("mm_embeds needs is_mm, the mask of the rows it replaces.")
        rows = is_mm.nonzero().squeeze(1)  # [num_mm_tokens]
        if rows.numel() != mm_embeds.shape[0]:
            raise ValueError(
                f"{mm_embeds.shape[0]} multimodal embeddings for {rows.numel()} masked positions."
            )
        return embeds.index_copy(0, rows, mm_embeds.to(embeds.dtype))

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
            return name, ()  # encoder parameters are whole, unfused tensors
        if self.tie_word_embeddings and name == "lm_head.weight":
            return None
        return route_stacked(name, self.text_family.stacked_params)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights_by_route(self, weights, self.route_weight)
