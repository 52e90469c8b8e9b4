"""``POST /v1/audio/transcriptions`` and ``/v1/audio/translations`` (OpenAI's, multipart forms):
the form's fields, and the transcript in OpenAI's shapes."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from omniserve.entrypoints.openai.protocol import OpenAIBaseModel, RequestModel

LANGUAGES = {
    "en": "English", "zh": "Chinese", "yue": "Cantonese", "ja": "Japanese", "ko": "Korean",
    "de": "German", "fr": "French", "es": "Spanish", "it": "Italian", "pt": "Portuguese",
    "ru": "Russian", "ar": "Arabic", "nl": "Dutch", "tr": "Turkish", "vi": "Vietnamese",
    "id": "Indonesian", "ms": "Malay", "ur": "Urdu", "th": "Thai", "hi": "Hindi", "pl": "Polish",
    "sv": "Swedish", "cs": "Czech", "el": "Greek", "he": "Hebrew", "fa": "Persian",
    "uk": "Ukrainian", "ro": "Romanian", "hu": "Hungarian", "da": "Danish", "fi": "Finnish",
    "no": "Norwegian",
}  # fmt: skip
"""ISO-639-1 codes ``language`` takes, and the name the instruction gives the model."""

SAMPLING_FIELDS = (
    "top_p", "top_k", "min_p", "seed", "repetition_penalty", "frequency_penalty",
    "presence_penalty", "max_completion_tokens",
)  # fmt: skip
"""vLLM's extra form fields, handed to the chat request that reads them."""
LIST_FIELDS = frozenset({"include", "timestamp_granularities"})
"""Form fields that are lists (sent as repeated fields)."""


class TranscriptionRequest(RequestModel):
    """The form's fields but ``file``; values arrive as text, so they are parsed leniently
    ("0.2" is 0.2, "true" is true)."""

    unsupported: ClassVar[dict[str, tuple[Any, str]]] = {
        "timestamp_granularities": ([], "there are no timestamps (json and text only)"),
        "chunking_strategy": (None, "the audio goes to the model whole"),
    }
    passed_on: ClassVar[frozenset[str]] = frozenset({"file", *SAMPLING_FIELDS})

    model: str | None = None
    language: str | None = None
    """The audio's language (ISO-639-1); the model is told it."""
    prompt: str | None = None
    """Text the audio follows on from (earlier speech, names it may contain): given to the
    model after the instruction."""
    response_format: Literal["json", "text"] = "json"
    temperature: float = Field(0.0, ge=0.0)
    include: list[Literal["logprobs"]] = Field(default_factory=list)
    stream: bool = False
    timestamp_granularities: list[str] = Field(default_factory=list)
    chunking_strategy: Any = None
    request_id: str | None = None
    priority: int = 0

    def instruction(self, task: Literal["transcribe", "translate"]) -> str:
        """What the model is asked, after the audio."""
        if self.language is not None and self.language not in LANGUAGES:
            raise ValueError(
                f"language {self.language!r} is not known here; give an ISO-639-1 code: "
                f"{', '.join(LANGUAGES)}."
            )
        spoken = f"{LANGUAGES[self.language]} audio" if self.language else "audio"
        ask = (
            f"Transcribe the {spoken} into text."
            if task == "transcribe"
            else f"Translate the {spoken} into English text."
        )
        return f"{ask}\nIt follows on from: {self.prompt}" if self.prompt else ask


class TranscriptionLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int]


class InputTokenDetails(OpenAIBaseModel):
    text_tokens: int
    audio_tokens: int


class TranscriptionUsage(OpenAIBaseModel):
    type: Literal["tokens"] = "tokens"
    input_tokens: int
    input_token_details: InputTokenDetails
    output_tokens: int
    total_tokens: int


class TranscriptionResponse(OpenAIBaseModel):
    """OpenAI's transcription (and translation) object: the text, its usage, and with
    ``include: ["logprobs"]`` each token's logprob."""

    text: str
    usage: TranscriptionUsage
    logprobs: list[TranscriptionLogprob] | None = None


def form_schema() -> dict[str, Any]:
    """The OpenAPI request body of the audio routes: the form's fields and its file."""
    schema = TranscriptionRequest.model_json_schema()
    schema["properties"]["file"] = {"type": "string", "format": "binary"}
    schema["required"] = ["file"]
    content = {"multipart/form-data": {"schema": schema}}
    return {"requestBody": {"required": True, "content": content}}
