"""Bodies of vLLM's ``/tokenize`` and ``/detokenize`` endpoints."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import StrictBool, StrictInt

from omniserve.entrypoints.openai.protocol import (
    ChatCompletionTool,
    OpenAIBaseModel,
    RequestModel,
)


class TokenizeCompletionRequest(RequestModel):
    other_prompt_form: ClassVar[str | None] = "prompt"
    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(RequestModel):
    other_prompt_form: ClassVar[str | None] = "prompt"
    model: str | None = None
    messages: list[dict[str, Any]]
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool = False
    chat_template: str | None = None
    tools: list[ChatCompletionTool] | None = None

    @property
    def template_kwargs(self) -> dict[str, Any] | None:
        return self.chat_template_kwargs


TokenizeRequest = TokenizeChatRequest | TokenizeCompletionRequest


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
