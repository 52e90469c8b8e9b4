"""Request and response bodies of ``POST /v1/completions`` (OpenAI's legacy completions API, with
vLLM's extra fields); the shared request rules are ``protocol.SamplingRequest``'s."""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, StrictBool, StrictInt, model_validator

from omniserve.entrypoints.openai.protocol import (
    SAMPLING_UNSUPPORTED,
    OpenAIBaseModel,
    PromptLogprob,
    SamplingRequest,
    UsageInfo,
)


class CompletionRequest(SamplingRequest):
    logprobs_field: ClassVar[str] = "logprobs"
    unsupported: ClassVar[dict[str, tuple[Any, str]]] = SAMPLING_UNSUPPORTED
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"prompt": "Once upon a time", "max_tokens": 8},
                {
                    "prompt": [[1, 2, 3], "two prompts"],
                    "max_tokens": 4,
                    "stream": True,
                    "echo": True,
                    "logprobs": 2,
                },
            ]
        }
    )

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]] | None = None
    """Text or token ids; may be omitted when ``prompt_embeds`` is given."""
    max_tokens: StrictInt | None = Field(16, ge=1)
    """16 when omitted, as in OpenAI's and vLLM's completions API (null: up to the context)."""
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0)
    suffix: str | None = None
    add_special_tokens: StrictBool = True
    """Whether text prompts get the tokenizer's special tokens (e.g. BOS), as in vLLM."""
    prompt_embeds: str | list[str] | None = None
    """vLLM's: prompts as embeddings, each a base64 ``torch.save`` of a ``[num_tokens,
    hidden_size]`` tensor (needs --enable-prompt-embeds); they come before ``prompt``'s."""

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty.")
        if self.prompt is None and not self.prompt_embeds:
            raise ValueError("Give prompt, prompt_embeds, or both.")
        if self.suffix:
            raise ValueError("suffix is not supported.")
        return self

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class CompletionLogprobs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    """This choice's prompt (on its first chunk when streaming; ``return_token_ids``)."""
    token_ids: list[int] | None = None
    """The answer's (this chunk's) token ids (``return_token_ids``)."""
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    """vLLM's, for ``prompt_logprobs``: per position of this choice's prompt, token id -> its
    logprob."""


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None
