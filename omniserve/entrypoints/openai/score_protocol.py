"""Bodies of vLLM's scoring and classification routes: ``POST /score`` pairs queries with
documents and answers each pair's score; ``POST /rerank`` (also ``/v1/rerank`` and
``/v2/rerank``, Jina's and Cohere's shape) orders documents by their relevance to one query
(each input text, or vLLM's ``{"content": [parts]}`` holding media, embedded as one prompt
without a chat template); ``POST /classify`` answers a sequence classifier's label
probabilities."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    Discriminator,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    StrictStr,
    Tag,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from omniserve.entrypoints.openai.embedding_protocol import ChatPromptFields, form_of
from omniserve.entrypoints.openai.protocol import OpenAIBaseModel, PromptOptions, UsageInfo

FIRST_NAMES = ("queries", "data_1", "text_1")
SECOND_NAMES = ("documents", "items", "data_2", "text_2")
"""vLLM's spellings of /score's two inputs (queries and documents or items, data_1 and data_2,
text_1 and text_2)."""


class ScoreContent(OpenAIBaseModel):
    """vLLM's ``ScoreMultiModalParam``: content parts (text, image, audio, video) that make one
    prompt."""

    content: list[Any] = Field(min_length=1)


ScoreInput = StrictStr | ScoreContent


class _ScoreFields(PromptOptions):
    model: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None


class ScoreRequest(_ScoreFields):
    queries: ScoreInput | list[ScoreInput] = Field(validation_alias=AliasChoices(*FIRST_NAMES))
    documents: ScoreInput | list[ScoreInput] = Field(validation_alias=AliasChoices(*SECOND_NAMES))
    _names: tuple[str, str] = PrivateAttr(("queries", "documents"))

    @model_validator(mode="wrap")
    @classmethod
    def _keep_spelling(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> ScoreRequest:
        """Errors name the fields as the client spelled them."""
        request = handler(data)
        if isinstance(data, dict):
            first = next((name for name in FIRST_NAMES if name in data), "queries")
            second = next((name for name in SECOND_NAMES if name in data), "documents")
            request._names = (first, second)
        return request

    @property
    def names(self) -> tuple[str, str]:
        """The two inputs' field names as the request gave them."""
        return self._names


class RerankRequest(_ScoreFields):
    query: ScoreInput
    documents: ScoreInput | list[ScoreInput]
    top_n: StrictInt = Field(0, ge=0)
    """Answer the best ``top_n`` documents (0: all of them)."""
    return_documents: StrictBool = True
    """Echo each document in its result (Jina's and Cohere's field)."""

    @field_validator("documents")
    @classmethod
    def _some(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("must not be an empty list (nothing to rank)")
        return value


class ScoreResponseData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreResponseData]
    usage: UsageInfo


class RerankDocument(OpenAIBaseModel):
    text: str | None = None
    multi_modal: list[Any] | None = None


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class _ClassificationFields(PromptOptions):
    model: str | None = None
    user: str | None = None
    use_activation: StrictBool | None = None
    """Probabilities (softmax; sigmoid for one label) unless false: the raw scores."""


class ClassificationCompletionRequest(_ClassificationFields):
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    """A text, texts, token ids or lists of them (as ``/v1/embeddings``' input)."""
    add_special_tokens: StrictBool = True

    @field_validator("input")
    @classmethod
    def _some(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("must not be an empty list (nothing to classify)")
        return value


class ClassificationChatRequest(ChatPromptFields, _ClassificationFields):
    """The conversation's classification."""


ClassificationRequest = Annotated[
    Annotated[ClassificationChatRequest, Tag("classify-chat")]
    | Annotated[ClassificationCompletionRequest, Tag("classify-input")],
    Discriminator(form_of("classify")),
]


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str | None
    """The most probable label's name (the config's ``id2label``)."""
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: UsageInfo
