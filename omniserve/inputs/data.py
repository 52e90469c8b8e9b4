"""The prompt forms the engine accepts (vLLM's names)."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str
    multi_modal_data: NotRequired[dict[str, Any]]
    mm_processor_kwargs: NotRequired[dict[str, Any]]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    multi_modal_data: NotRequired[dict[str, Any]]
    mm_processor_kwargs: NotRequired[dict[str, Any]]


PromptType = str | TextPrompt | TokensPrompt
