"""A prompt as the server validated it, and its form for the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from omniserve.inputs.data import EmbedsPrompt, TokensPrompt


@dataclass
class EnginePrompt:
    """A prompt as the server validated it: the text (if any) and its token ids (placeholders,
    one per row, for a prompt given as ``embeds``)."""

    text: str | None
    token_ids: list[int]
    mm_data: dict[str, list[Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    mm_locations: dict[str, list[str]] | None = None
    """modality -> the chat part of each item, to name it in the engine's errors."""
    cache_salt: str | None = None
    mm_uuids: dict[str, list[str | None]] | None = None
    embeds: torch.Tensor | list[torch.Tensor] | None = None
    """The prompt's rows when it was given as embeddings (``prompt_embeds``), or the tensors of
    a chat's ``prompt_embeds`` parts (``token_ids`` then hold ``EMBEDS_SLOT`` where each goes)."""

    @classmethod
    def from_rendered(cls, prompt: TokensPrompt, locations: dict[str, list[str]]) -> EnginePrompt:
        """A prompt ``ChatRenderer`` rendered, with the chat part of each media item."""
        return cls(
            prompt["prompt"],
            prompt["prompt_token_ids"],
            prompt.get("multi_modal_data"),
            prompt.get("mm_processor_kwargs"),
            locations,
            mm_uuids=prompt.get("multi_modal_uuids"),
            embeds=prompt.get("prompt_embeds"),
        )

    def to_engine_input(self) -> TokensPrompt | EmbedsPrompt:
        if isinstance(self.embeds, torch.Tensor):
            embeds = EmbedsPrompt(prompt_embeds=self.embeds)
            if self.cache_salt is not None:
                embeds["cache_salt"] = self.cache_salt
            return embeds
        prompt = TokensPrompt(prompt_token_ids=self.token_ids)
        if self.text is not None:
            prompt["prompt"] = self.text
        if self.cache_salt is not None:
            prompt["cache_salt"] = self.cache_salt
        if self.mm_data:
            prompt["multi_modal_data"] = self.mm_data
        if self.mm_uuids:
            prompt["multi_modal_uuids"] = self.mm_uuids
        if self.mm_processor_kwargs:
            prompt["mm_processor_kwargs"] = self.mm_processor_kwargs
        if self.embeds is not None:
            prompt["prompt_embeds"] = self.embeds
        return prompt
