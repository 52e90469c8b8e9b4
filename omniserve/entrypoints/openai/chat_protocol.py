"""``POST /v1/chat/completions``: its request (OpenAI's fields and vLLM's extras) and its
response bodies in OpenAI's shapes (a whole reply, or the chunks of a streamed one), with
vLLM's ``stop_reason`` on choices."""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, StrictBool, StrictInt, model_validator

from omniserve.entrypoints.openai.audio_encoding import AUDIO_FORMATS, STREAM_FORMAT
from omniserve.entrypoints.openai.protocol import (
    ChatCompletionAudioParam,
    ChatCompletionTool,
    FunctionDefinition,
    NamedToolChoice,
    OpenAIBaseModel,
    PromptLogprob,
    SamplingRequest,
    SpeechOptions,
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


class ChatCompletionRequest(SamplingRequest):
    logprobs_field: ClassVar[str] = "top_logprobs"
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8},
                {
                    "messages": [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                    ],
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "max_tokens": 4,
                    "logprobs": True,
                    "top_logprobs": 2,
                    "n": 2,
                    "temperature": 0.7,
                    "seed": 1,
                },
            ]
        }
    )

    messages: list[dict[str, Any]]
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0)
    # vLLM's extra body fields
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    """Per-request HF processor kwargs, e.g. {"max_pixels": 200704, "num_frames": 8}."""
    documents: list[dict[str, str]] | None = None
    """Given to the chat template (RAG templates read them), as vLLM does."""
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    """Given to the chat template as ``reasoning_effort``, as vLLM does."""
    include_reasoning: StrictBool = True
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """None: "auto" with tools, else "none" (OpenAI's defaults)."""
    parallel_tool_calls: StrictBool = True
    """False: at most one call per answer."""
    modalities: list[Literal["text", "audio"]] | None = None
    """OpenAI's output modalities: ["text"] (the default), ["text", "audio"] or ["audio"]
    (the text then comes as the audio's transcript). Audio needs a model that speaks."""
    audio: ChatCompletionAudioParam | None = None
    """The voice and format of audio output (required with "audio" in modalities)."""
    speech: SpeechOptions | None = None
    """omniserve's extra: the talker's sampling, over the model's defaults."""
    chat_template: str | None = None
    """This request's own template (the server must run with --trust-request-chat-template)."""
    echo: StrictBool = False
    """Start the answer with the last message's content when it is the assistant's (with
    continue_final_message: the text the model continues)."""
    add_special_tokens: StrictBool = False
    """Also add the tokenizer's special tokens (e.g. BOS) to the templated prompt."""

    @property
    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs with the fields vLLM also hands the template."""
        extra = {
            name: getattr(self, name)
            for name in ("documents", "reasoning_effort")
            if getattr(self, name) is not None
        }
        return {**(self.chat_template_kwargs or {}), **extra} or None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true.")
        return self

    @property
    def wants_audio(self) -> bool:
        return "audio" in (self.modalities or [])

    @model_validator(mode="after")
    def _audio_output(self) -> ChatCompletionRequest:
        if self.modalities is not None and not self.modalities:
            raise ValueError("modalities must name at least one of text, audio.")
        if self.modalities is not None and len(set(self.modalities)) != len(self.modalities):
            raise ValueError(f"modalities names one twice: {self.modalities}.")
        if self.wants_audio and self.audio is None:
            raise ValueError('audio (voice and format) is required with "audio" in modalities.')
        if not self.wants_audio and (self.audio is not None or self.speech is not None):
            raise ValueError('audio and speech apply only with "audio" in modalities.')
        if self.audio is not None:
            if self.audio.format not in AUDIO_FORMATS:
                raise ValueError(
                    f"audio.format {self.audio.format!r} has no encoder here; use "
                    f"one of {', '.join(AUDIO_FORMATS)}."
                )
            if self.stream and self.audio.format != STREAM_FORMAT:
                raise ValueError(
                    f"audio.format must be {STREAM_FORMAT} when streaming (audio "
                    "streams as raw PCM16 chunks, as OpenAI's API)."
                )
        return self

    @model_validator(mode="before")
    @classmethod
    def _default_tool_choice(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("tool_choice") is None:
            return {**data, "tool_choice": "auto" if data.get("tools") else "none"}
        return data

    def _check_tools(self) -> None:
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) < len(names):
            raise ValueError("tools: each function needs its own name.")
        if self.tool_choice != "none" and not names:
            raise ValueError("tool_choice is only allowed when tools are given.")
        if (
            isinstance(self.tool_choice, NamedToolChoice)
            and self.tool_choice.function.name not in names
        ):
            raise ValueError(
                f"tool_choice names the function {self.tool_choice.function.name!r},"
                " which is not among the tools."
            )

    def forced_output(self) -> dict[str, tuple[dict[str, Any], str]]:
        """``tool_choice`` "required" or a named function: the grammar engine makes the answer
        the calls' JSON (vLLM's forms): a list of {"name", "parameters"} objects, or the named
        function's arguments. Checks the tool fields first (SamplingRequest's validator asks
        for the constraint, so this runs on every request)."""
        self._check_tools()
        if isinstance(self.tool_choice, NamedToolChoice):
            index = next(i for i, tool in enumerate(self.tools or [])
                         if tool.function is self.named_tool)  # fmt: skip
            where = f"tools[{index}].function.parameters"
            return {"tool_choice": ({"json": self.named_tool.arguments_schema}, where)}
        if self.tool_choice != "required":
            return {}
        calls: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "parameters"],
                        "properties": {
                            "name": {"enum": [tool.function.name]},
                            "parameters": tool.function.arguments_schema,
                        },
                    }
                    for tool in self.tools or []
                ]
            },
        }
        if not self.parallel_tool_calls:
            calls["maxItems"] = 1
        return {"tool_choice": ({"json": calls}, "tools[*].function.parameters")}

    @property
    def named_tool(self) -> FunctionDefinition:
        """The function a named tool_choice forces."""
        assert isinstance(self.tool_choice, NamedToolChoice)
        return next(
            tool.function
            for tool in self.tools or []
            if tool.function.name == self.tool_choice.function.name
        )

    def template_tools(self, exclude_when_none: bool) -> list[dict[str, Any]] | None:
        """The tools as the chat template lists them (not with tool_choice "none" when the
        server excludes them then)."""
        if not self.tools or (exclude_when_none and self.tool_choice == "none"):
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    @property
    def output_limit(self) -> int | None:
        """max_completion_tokens supersedes the deprecated max_tokens, as in OpenAI's API."""
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
