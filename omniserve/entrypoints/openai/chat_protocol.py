"""Response bodies of ``POST /v1/chat/completions`` in OpenAI's shapes (a whole reply, or the
chunks of a streamed one), with vLLM's ``stop_reason`` on choices; the request is
``protocol.ChatCompletionRequest``."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from omniserve.entrypoints.openai.protocol import (
    OpenAIBaseModel,
    PromptLogprob,
    ToolCall,
    UsageInfo,
)


class ChatLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobsContent(ChatLogprob):
    top_logprobs: list[ChatLogprob] = Field(default_factory=list)


class ChatCompletionLogprobs(OpenAIBaseModel):
    content: list[ChatLogprobsContent] | None = None


class ChatCompletionAudio(OpenAIBaseModel):
    """OpenAI's ``message.audio``: the spoken answer, base64 in the requested format."""

    id: str
    data: str
    expires_at: int
    transcript: str


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    reasoning_content: str | None = None
    """The thinking, split off by ``--reasoning-parser`` (vLLM's field)."""
    tool_calls: list[ToolCall] | None = None
    audio: ChatCompletionAudio | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    """The answer's token ids (``return_token_ids``)."""


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None
    """The prompt's token ids, media placeholders expanded (``return_token_ids``)."""
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    """vLLM's, for ``prompt_logprobs``: per prompt position, token id -> its logprob."""


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: dict[str, Any]
    """Only the keys that changed: {"role": ...} first, then {"content": ...}, with a reasoning
    parser {"reasoning_content": ...}, and with tools {"tool_calls": [{"index", "id", "type",
    "function": {"name", "arguments"}}]} (later chunks of a call: index and more arguments)."""
    logprobs: ChatCompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    """This chunk's new token ids (``return_token_ids``)."""


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    """On the first chunk (``return_token_ids``)."""
