"""``/v1/responses``: OpenAI's Responses API request, its response object, output items and
stream events, and the request's conversation as chat messages.

A request is served as the chat request it amounts to (``ResponsesRequest.chat_fields``), so
both APIs share one template, media, sampling, tool and reasoning path; this module only maps
shapes, and keeps where each chat message came from so errors name the Responses field.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, StrictBool, StrictFloat, StrictInt, model_validator

from omniserve.entrypoints.openai.chat_protocol import ChatLogprobsContent
from omniserve.entrypoints.openai.protocol import (
    SAMPLING_UNSUPPORTED,
    OpenAIBaseModel,
    RequestModel,
    RequestPart,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The one ``include`` value with a meaning here: logprobs on the answer's text."""

CHAT_EXTRAS = frozenset({
    "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
    "stop", "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias", "allowed_token_ids",
    "bad_words", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "guided_decoding_backend", "request_id", "priority",
    "cache_salt", "mm_processor_kwargs", "chat_template_kwargs", "chat_template", "documents",
    "add_special_tokens", "return_tokens_as_token_ids", "vllm_xargs", *SAMPLING_UNSUPPORTED,
})  # fmt: skip
"""vLLM's extra sampling fields a Responses request may carry: handed to the chat request as
they are, which checks them (and refuses the ones it cannot honour) with the same messages."""

_HOSTED_TOOLS = "only function tools (your code runs the calls): there are no hosted tools here"


class FunctionTool(RequestPart):
    """A Responses function tool: the chat tool's fields, flat."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class FunctionToolChoice(RequestPart):
    type: Literal["function"]
    name: str


class TextFormat(RequestPart):
    """``text.format``: free text, any JSON object, or JSON of a schema."""

    model_config = ConfigDict(serialize_by_alias=True)  # echoed as "schema"
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("text.format.schema is required with type json_schema.")
        return self


class TextConfig(RequestPart):
    format: TextFormat = Field(default_factory=lambda: TextFormat(type="text"))
    verbosity: Literal["medium"] | None = None
    """Only the default: the model's answers have no length setting here."""


class ReasoningConfig(RequestPart):
    effort: Literal["low", "medium", "high"] | None = None
    """Given to the chat template as ``reasoning_effort`` (as chat's field)."""
    summary: Literal["auto"] | None = None
    """No summaries are written: the reasoning item carries the thinking itself as content."""


class StreamOptions(RequestPart):
    include_obfuscation: StrictBool = True
    """Accepted; events carry no obfuscation padding (they are sent as they are made)."""


def _unsupported_types(items: Any, what: str, allowed: str) -> Any:
    """A clear 400 for a tool or tool choice of a kind OpenAI hosts (pydantic's union errors
    would list every branch instead)."""
    for i, item in enumerate(items if isinstance(items, list) else [items]):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind is not None and kind != "function":
            where = f"{what}[{i}]" if isinstance(items, list) else what
            raise ValueError(f"{where}.type {kind!r} is not available: {allowed}.")
    return items


class ResponsesRequest(RequestModel):
    """``POST /v1/responses``: OpenAI's fields, and vLLM's sampling extras (``CHAT_EXTRAS``)."""

    model_config = ConfigDict(extra="allow")
    passed_on: ClassVar[frozenset[str]] = CHAT_EXTRAS
    unsupported: ClassVar[dict[str, tuple[Any, str]]] = {
        "conversation": (None, "there is no Conversations API here: chain responses with "
                         "previous_response_id"),
        "prompt": (None, "there are no stored prompts here: send instructions and input"),
        "use_beam_search": (False, "beam search is on chat and completions"),
    }  # fmt: skip

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    """A system message before the input (not carried over by previous_response_id)."""
    previous_response_id: str | None = None
    store: StrictBool = True
    background: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat | None = Field(None, ge=0.0)
    top_p: StrictFloat | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    max_tool_calls: StrictInt | None = Field(None, ge=1)
    """Echoed: it bounds calls to hosted tools, of which there are none here."""
    text: TextConfig = Field(default_factory=TextConfig)
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    """"auto": drop the oldest turns until the conversation fits the context."""
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    """Echoed: prefix caching needs no key here (requests with a common prefix share it)."""
    service_tier: Literal["auto", "default"] | None = None
    conversation: Any = None
    prompt: Any = None
    use_beam_search: Any = False

    @model_validator(mode="before")
    @classmethod
    def _hosted_tools(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _unsupported_types(data.get("tools") or [], "tools", _HOSTED_TOOLS)
            choice = data.get("tool_choice")
            if isinstance(choice, dict):
                _unsupported_types(choice, "tool_choice", "name a function tool")
        return data

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        for name in self.include or []:
            if name != LOGPROBS_INCLUDE:
                raise ValueError(
                    f"include: {name!r} is not available here (only {LOGPROBS_INCLUDE!r})."
                )
        if self.background and not self.store:
            raise ValueError("background needs store=true (its result is fetched later).")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream=true.")
        if self.metadata is not None and (
            len(self.metadata) > 16
            or any(len(k) > 64 or len(v) > 512 for k, v in self.metadata.items())
        ):
            raise ValueError("metadata: at most 16 pairs, keys of 64 and values of 512 characters.")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or []) or bool(self.top_logprobs)

    def chat_fields(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat request this one amounts to, over the conversation's ``messages``."""
        extras = {k: v for k, v in (self.model_extra or {}).items() if k in CHAT_EXTRAS}
        fields: dict[str, Any] = {
            **extras,
            "model": self.model,
            "messages": messages,
            "stream": self.stream,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "logprobs": self.wants_logprobs,
            "top_logprobs": self.top_logprobs if self.wants_logprobs else None,
            "parallel_tool_calls": self.parallel_tool_calls,
            "user": self.user,
        }
        if self.tools:
            fields["tools"] = [
                {"type": "function", "function": tool.model_dump(exclude={"type"})}
                for tool in self.tools
            ]
        if isinstance(self.tool_choice, FunctionToolChoice):
            named = {"name": self.tool_choice.name}
            fields["tool_choice"] = {"type": "function", "function": named}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        text_format = self.text.format
        if text_format.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        elif text_format.type == "json_schema":
            fields["response_format"] = {
                "type": "json_schema",
                "json_schema": text_format.model_dump(by_alias=True, exclude={"type"}),
            }
        if self.reasoning is not None and self.reasoning.effort is not None:
            fields["reasoning_effort"] = self.reasoning.effort
        return fields


# ---- the conversation as chat messages ----


@dataclass
class Conversation:
    """Chat messages and, per message, where it came from in the request (``origins``: the
    Responses path that stands for ``messages[i]``, and for its content / tool calls)."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    origins: dict[str, str] = field(default_factory=dict)
    fixed: int = 0
    """Leading messages ``truncation: "auto"`` keeps (the instructions)."""
    input_start: int = 0
    """The first message of the request's own input (a call never joins an earlier turn)."""
    truncated: bool = False
    """``drop_oldest_turn`` dropped messages (``input_start`` no longer counts)."""

    def add(self, message: dict[str, Any], origin: str, content: str | None = None) -> None:
        i = len(self.messages)
        self.messages.append(message)
        self.origins[f"messages[{i}]"] = origin
        self.origins[f"messages[{i}].content"] = content or f"{origin}.content"

    def add_call(self, call: dict[str, Any], origin: str) -> None:
        """A function call joins the assistant message just before it (the calls of one turn),
        or starts one."""
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant" or len(self.messages) <= self.input_start:
            self.add({"role": "assistant", "content": None}, origin)
            last = self.messages[-1]
        calls = last.setdefault("tool_calls", [])
        self.origins[f"messages[{len(self.messages) - 1}].tool_calls[{len(calls)}]"] = origin
        calls.append(call)

    def drop_oldest_turn(self) -> bool:
        """Drop the oldest messages after the kept ones, up to the next user message (one
        turn); False when only the last turn is left."""
        rest = self.messages[self.fixed :]
        starts = [i for i, m in enumerate(rest) if m.get("role") == "user"]
        cut = next((i for i in starts if i > 0), None)
        if cut is None:
            return False
        self.messages[self.fixed :] = rest[cut:]
        self.truncated = True
        shifted: dict[str, str] = {}
        for key, origin in self.origins.items():
            index = int(key[9 : key.index("]")])
            if index < self.fixed:
                shifted[key] = origin
            elif index >= self.fixed + cut:
                shifted[key.replace(f"[{index}]", f"[{index - cut}]", 1)] = origin
        self.origins = shifted
        return True

    _CHAT_PATH = re.compile(r"messages\[\d+\](?:\.tool_calls\[\d+\]|\.content)?")
    _RENAMED = {
        "max_completion_tokens": "max_output_tokens",
        "max_tokens": "max_output_tokens",
        "response_format.json_schema.schema": "text.format.schema",
        "response_format": "text.format",
        "reasoning_effort": "reasoning.effort",
        ".function.parameters": ".parameters",
        ".function.arguments": ".arguments",
    }

    def relocate(self, text: str) -> str:
        """A chat-side error message or param, in the Responses request's terms."""

        def origin(match: re.Match[str]) -> str:
            path = match.group(0)
            if path in self.origins:
                return self.origins[path]
            base = path[: path.index("]") + 1]
            return self.origins.get(base, "input") + path[len(base) :]

        text = self._CHAT_PATH.sub(origin, text)
        for chat_name, name in self._RENAMED.items():
            text = text.replace(chat_name, name)
        return re.sub(r"\bmessages\b", "input", text)


_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def _image_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    if part.get("file_id") is not None:
        raise ValueError(f"{where}.file_id: there is no Files API here; send image_url.")
    url = {"url": part.get("image_url"), "detail": part.get("detail") or "auto"}
    uuid = {"uuid": part["uuid"]} if "uuid" in part else {}
    return {"type": "image_url", "image_url": url, **uuid}


def _content(content: Any, where: str) -> Any:
    """Responses content parts as chat parts: input_image becomes image_url; input_text,
    output_text, refusal, input_audio and chat's own parts (image_url, audio_url, video_url,
    ...) pass as they are, for the chat parser to check."""
    if not isinstance(content, list):
        return content
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            part = _image_part(part, f"{where}[{j}]")
        elif kind == "input_file":
            raise ValueError(
                f"{where}[{j}]: input_file is not supported; send images as input_image, audio "
                "as input_audio and video as video_url."
            )
        parts.append(part)
    return parts


def conversation_of(
    request: ResponsesRequest, history: list[dict[str, Any]] | None
) -> Conversation:
    """The chat messages of a request: its instructions, the stored conversation of
    ``previous_response_id`` (``history``), then its input items. Raises ValueError naming the
    item for what has no chat form."""
    conversation = Conversation()
    if request.instructions is not None:
        conversation.add({"role": "system", "content": request.instructions}, "instructions")
        conversation.fixed = 1
    for message in history or []:
        conversation.add(dict(message), "previous_response_id")
    conversation.input_start = len(conversation.messages)
    if isinstance(request.input, str):
        conversation.add({"role": "user", "content": request.input}, "input")
        return conversation
    reasoning: list[str] = []  # a reasoning item's text, for the assistant message after it
    for i, item in enumerate(request.input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where} must be an object.")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise ValueError(
                    f"{where}.role must be one of {', '.join(_ROLES)}, not {item.get('role')!r}."
                )
            message = {"role": role, "content": _content(item.get("content"), f"{where}.content")}
            if role == "assistant" and reasoning:
                message["reasoning_content"] = "".join(reasoning)
                reasoning = []
            conversation.add(message, where)
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            conversation.add_call(call, where)
            if reasoning:
                conversation.messages[-1]["reasoning_content"] = "".join(reasoning)
                reasoning = []
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ValueError(f"{where}.call_id must be the call's call_id.")
            output = _content(item.get("output"), f"{where}.output")
            message = {"role": "tool", "tool_call_id": item["call_id"], "content": output}
            conversation.add(message, where, f"{where}.output")
        elif kind == "reasoning":
            reasoning += [part.get("text", "") for part in item.get("content") or []
                          if isinstance(part, dict)]  # fmt: skip
        else:
            raise ValueError(
                f"{where}.type {kind!r} is not available here: send messages, function_call, "
                "function_call_output and reasoning items (earlier turns: previous_response_id)."
            )
    return conversation


_ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                     "reasoning": "rs"}  # fmt: skip


def input_items(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as OpenAI lists it back (``GET .../input_items``): each item typed,
    with an id, message text as content parts."""
    raw = (
        [{"role": "user", "content": request.input}]
        if isinstance(request.input, str)
        else request.input
    )
    items = []
    for item in raw:
        kind = item.get("type", "message")
        listed = {"type": kind, "id": f"{_ITEM_ID_PREFIXES.get(kind, 'item')}_{uuid.uuid4().hex}",
                  **item}  # fmt: skip
        if kind == "message" and isinstance(item.get("content"), str):
            text = "output_text" if item.get("role") == "assistant" else "input_text"
            listed["content"] = [{"type": text, "text": item["content"]}]
        items.append(listed)
    return items


class InputItemList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


# ---- the response ----


class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatLogprobsContent] | None = None


class OutputMessage(OpenAIBaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class ReasoningItem(OpenAIBaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"


class FunctionCallItem(OpenAIBaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str = ""
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"


OutputItem = Annotated[
    OutputMessage | ReasoningItem | FunctionCallItem, Field(discriminator="type")
]


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0
    image_tokens: int = 0
    audio_tokens: int = 0
    video_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(OpenAIBaseModel):
    code: str
    message: str


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens"]


Status = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]


class ResponseObject(OpenAIBaseModel):
    """OpenAI's response object: the output items, usage, and the request's settings."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    status: Status = "in_progress"
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = Field(default_factory=TextConfig)
    reasoning: ReasoningConfig | None = None
    truncation: str = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)
    store: bool = True
    background: bool = False
    service_tier: str = "default"
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    @classmethod
    def of(
        cls, request: ResponsesRequest, response_id: str, model: str, sampling: dict[str, Any]
    ) -> ResponseObject:
        """A new response echoing the request's settings (sampling: those in effect)."""
        echoed = {
            name: getattr(request, name)
            for name in ("instructions", "previous_response_id", "max_output_tokens",
                         "max_tool_calls", "top_logprobs", "parallel_tool_calls", "text",
                         "reasoning", "truncation", "store", "background", "user",
                         "safety_identifier", "prompt_cache_key")
        }  # fmt: skip
        return cls(
            id=response_id,
            model=model,
            tools=request.tools or [],
            tool_choice=request.tool_choice or ("auto" if request.tools else "none"),
            metadata=request.metadata or {},
            temperature=sampling["temperature"],
            top_p=sampling["top_p"],
            **echoed,
        )


class DeletedResponse(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


class ResponseStreamEvent(OpenAIBaseModel):
    """One event of a streamed response (``event: <type>``): the lifecycle ones carry the
    response, the others an item, a content part or a delta; all are numbered in order."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int
