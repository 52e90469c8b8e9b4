"""Bodies of ``POST /v1/embeddings`` and vLLM's ``POST /pooling`` (the raw pooling result of
any task): OpenAI's form (``input``: text or token ids, one or many) and vLLM's chat form
(``messages``, whose media and text are pooled together)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    Tag,
    field_validator,
    model_validator,
)

from omniserve.entrypoints.openai.protocol import (
    OpenAIBaseModel,
    PromptOptions,
    UsageInfo,
)


class _EmbeddingFields(PromptOptions):
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    """base64: each embedding's bytes (``embed_dtype``, ``endianness``), base64-encoded."""
    embed_dtype: Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"] = "float32"
    """vLLM's: the number format of base64's bytes (float32 is what OpenAI's SDK decodes)."""
    endianness: Literal["native", "little", "big"] = "native"
    """vLLM's: the byte order of base64's bytes (native: the server's)."""
    dimensions: StrictInt | None = Field(None, ge=1)
    """Matryoshka models only: keep the first ``dimensions`` values."""
    user: str | None = None
    # vLLM's extra fields (and PromptOptions')
    normalize: StrictBool | None = None
    """L2-normalise the embedding (default: --pooler-config's, else yes)."""
    mm_processor_kwargs: dict[str, Any] | None = None


class EmbeddingCompletionRequest(_EmbeddingFields):
    model_config = ConfigDict(
        json_schema_extra={"examples": [{"input": ["a red square", "a blue circle"]}]}
    )
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    add_special_tokens: StrictBool = True

    @field_validator("input")
    @classmethod
    def _check_input(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("must not be an empty list (nothing to embed)")
        return value

    @model_validator(mode="after")
    def _check_media_options(self) -> EmbeddingCompletionRequest:
        if self.mm_processor_kwargs is not None:
            raise ValueError("mm_processor_kwargs needs media: send messages instead of input.")
        return self


class ChatPromptFields(PromptOptions):
    """A conversation rendered by the chat template (without a generation prompt, by default)
    and run whole, media included: the chat form of the pooling routes (vLLM's)."""

    other_prompt_form: ClassVar[str | None] = "input"
    messages: list[dict[str, Any]] = Field(min_length=1)
    add_generation_prompt: StrictBool = False
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    @property
    def template_kwargs(self) -> dict[str, Any] | None:
        return self.chat_template_kwargs


class EmbeddingChatRequest(ChatPromptFields, _EmbeddingFields):
    """The conversation's embedding."""


class _PoolingTask(OpenAIBaseModel):
    task: Literal["embed", "classify", "token_embed", "token_classify"] | None = None
    """vLLM's pooling tasks (``PoolingParams.task``); None: the model's (classify on a
    sequence classifier, else embed)."""
    use_activation: StrictBool | None = None
    """The classify tasks: probabilities unless false (the raw scores); the embed tasks:
    vLLM's newer name for ``normalize``."""


class PoolingCompletionRequest(_PoolingTask, EmbeddingCompletionRequest):
    """Each input's pooling result."""


class PoolingChatRequest(_PoolingTask, EmbeddingChatRequest):
    """The conversation's pooling result."""


def form_of(route: str) -> Callable[[Any], str]:
    """The discriminator of a route's two forms: a body with ``messages`` is the chat form, so
    its errors name its own fields and not the other form's (the tags are no identifiers, so an
    error's ``param`` skips them)."""

    def form(body: Any) -> str:
        has_messages = "messages" in body if isinstance(body, dict) else hasattr(body, "messages")
        return f"{route}-chat" if has_messages else f"{route}-input"

    return form


EmbeddingRequest = Annotated[
    Annotated[EmbeddingChatRequest, Tag("embedding-chat")]
    | Annotated[EmbeddingCompletionRequest, Tag("embedding-input")],
    Discriminator(form_of("embedding")),
]


PoolingRequest = Annotated[
    Annotated[PoolingChatRequest, Tag("pooling-chat")]
    | Annotated[PoolingCompletionRequest, Tag("pooling-input")],
    Discriminator(form_of("pooling")),
]


class PoolingData(OpenAIBaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[list[float]] | list[float] | str
    """A vector, a row per prompt position (the token tasks), or base64 of either's values."""


class PoolingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: UsageInfo


class EmbeddingData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo
