"""The prompt forms the engine accepts (vLLM's names)."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

EMBEDS_SLOT = -1
"""In ``prompt_token_ids`` given with a list of ``prompt_embeds`` tensors: where each tensor's rows
go, in order (the chat renderer writes one per ``prompt_embeds`` part)."""


class _PromptExtras(TypedDict, total=False):
    multi_modal_data: dict[str, Any]
    mm_processor_kwargs: dict[str, Any]
    multi_modal_uuids: dict[str, list[str | None]]
    """modality -> each item's uuid (None: hash its content), as ``multi_modal_data``."""
    cache_salt: str


class TextPrompt(_PromptExtras):
    prompt: str


class TokensPrompt(_PromptExtras):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    """The text the ids were tokenized from, returned with the outputs (as vLLM's: the ids are
    what the model reads; the text is not tokenized again)."""
    prompt_embeds: NotRequired[list[Any]]
    """Tensors (``[n, hidden_size]``) whose rows go where ``prompt_token_ids`` hold
    ``EMBEDS_SLOT``, one tensor per slot, in order (needs ``enable_prompt_embeds``): a chat's
    ``prompt_embeds`` parts."""


class EmbedsPrompt(TypedDict):
    prompt_embeds: Any
    """A ``[num_tokens, hidden_size]`` floating-point tensor the decoder reads in place of the
    prompt's token embeddings (needs ``enable_prompt_embeds``)."""
    cache_salt: NotRequired[str]


PromptType = str | TextPrompt | TokensPrompt | EmbedsPrompt

PROMPT_KEYS = frozenset(
    key for form in (TextPrompt, TokensPrompt, EmbedsPrompt) for key in form.__annotations__
)
"""Every key a prompt dict may hold: a dict with any other is refused (a typo such as
``multimodal_data`` would otherwise drop the media without a word)."""


def prompt_modalities(prompt: PromptType) -> list[str]:
    """The modalities of the media a prompt carries (its ``multi_modal_data`` keys)."""
    media = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
    return list(media) if isinstance(media, dict) else []
