"""Tool calls in chat answers: what the model wrote, read back as OpenAI ``tool_calls``.

Three ways a request asks for calls (``tool_choice``):

- ``"auto"``: the model decides, in the format its chat template taught it. ``--tool-call-parser
  hermes`` reads the Qwen family's: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, any number, text around them being the message content. A block that is not valid JSON
  naming one of the request's tools stays in the content, as the model wrote it.
  ``qwen3_coder`` reads Qwen3-Coder's blocks of the same tags, whose body is
  ``<function=NAME><parameter=KEY>value</parameter>...</function>``: each value is text, taken
  as the type the tool's JSON schema gives its parameter (vLLM's reading).
- ``"required"``: the grammar engine made the answer a JSON list of ``{"name", "parameters"}``
  objects (``ChatCompletionRequest.forced_output``); each becomes a call.
- a named function: the answer is that function's arguments (JSON, by the grammar).

Each reader is fed the content as it grows and returns the new content and the new call deltas,
so a streamed answer and a whole one are read by the same code and agree. Other formats come from
a ``--tool-parser-plugin`` file (vLLM's flag): its ``ToolCallReader`` subclasses decorated with
``register_tool_call_parser(name)`` become ``--tool-call-parser`` names.
"""

from __future__ import annotations

import abc
import ast
import json
import re
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

from omniserve.entrypoints.openai.chat_protocol import ChatCompletionRequest
from omniserve.entrypoints.openai.protocol import NamedToolChoice


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def call_delta(index: int, name: str | None, arguments: str) -> dict[str, Any]:
    """One entry of ``delta.tool_calls``: the first of a call carries its id, type and name."""
    function: dict[str, str] = {"arguments": arguments}
    if name is None:
        return {"index": index, "function": function}
    return {
        "index": index,
        "id": new_tool_call_id(),
        "type": "function",
        "function": {"name": name, **function},
    }


class ToolCallReader(abc.ABC):
    """Feed an answer's content as it grows; get the content left and the call deltas."""

    def __init__(self) -> None:
        self.num_calls = 0

    @abc.abstractmethod
    def feed(self, piece: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """The new content and call deltas; ``final`` flushes what was held back."""

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return engine_reason


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class HermesToolCalls(ToolCallReader):
    """``tool_choice="auto"`` with the hermes format. Whitespace between content and a call, or
    before the first content after calls, is not content (the model separates blocks with
    newlines); other text is, as written."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, tools: Mapping[str, Any] | list[str], parallel: bool) -> None:
        """``tools``: the request's tools' names (a mapping: to their parameters' schemas)."""
        super().__init__()
        self.tool_names = set(tools)
        self.parallel = parallel
        self.pending = ""  # not yet decided: a possible tag start, or an open call's body
        self.in_call = False
        self.held_space = ""  # whitespace that is content only if more content follows
        self.space_before = ""  # the held whitespace before an open call's tag
        self.strip_next = False  # calls came first: the content's leading whitespace goes
        self.any_content = False

    def feed(self, piece: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        self.pending += piece
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            if self.in_call:
                end = self.pending.find(self.END)
                if end < 0 and not final:
                    break
                body = self.pending if end < 0 else self.pending[:end]
                self.pending = "" if end < 0 else self.pending[end + len(self.END) :]
                self.in_call = False
                call = self._call(body)
                if call is None:  # not a call after all: the model's text, as written
                    closing = self.END if end >= 0 else ""
                    content.append(self._content(self.space_before + self.START + body + closing))
                else:  # without parallel calls, the first one only
                    if self.parallel or self.num_calls == 0:
                        calls.append(call_delta(self.num_calls, *call))
                        self.num_calls += 1
                    self.held_space, self.strip_next = "", not self.any_content
                continue
            start = self.pending.find(self.START)
            if start >= 0:
                content.append(self._content(self.pending[:start]))
                self.pending = self.pending[start + len(self.START) :]
                self.space_before, self.held_space, self.in_call = self.held_space, "", True
                continue
            keep = 0 if final else partial_tag(self.pending, self.START)
            content.append(self._content(self.pending[: len(self.pending) - keep]))
            self.pending = self.pending[len(self.pending) - keep :]
            break
        if final and self.num_calls == 0:
            content.append(self.held_space)
            self.held_space = ""
        return "".join(content), calls

    def _content(self, text: str) -> str:
        """Text outside calls: whitespace is held back until more text follows."""
        if self.strip_next:
            text = text.lstrip()
            if not text:
                return ""
            self.strip_next = False
        body = text.rstrip()
        if not body:
            self.held_space += text
            return ""
        shown, self.held_space = self.held_space + body, text[len(body) :]
        self.any_content = True
        return shown

    def _call(self, body: str) -> tuple[str, str] | None:
        """(name, arguments JSON) of a block, or None if it is not a call of a given tool."""
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or call.get("name") not in self.tool_names:
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        return call["name"], json.dumps(arguments, ensure_ascii=False)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return "tool_calls" if self.num_calls and engine_reason is not None else engine_reason


class Qwen3CoderToolCalls(HermesToolCalls):
    """``tool_choice="auto"`` with Qwen3-Coder's format: hermes' blocks and whitespace rules,
    each block ``<function=NAME>`` and its ``<parameter=KEY>`` values up to ``</function>`` (a
    block cut off before it is text: its last value may be cut too)."""

    FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
    PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)",
                           re.DOTALL)  # fmt: skip

    def __init__(self, tools: Mapping[str, Any] | list[str], parallel: bool) -> None:
        super().__init__(tools, parallel)
        self.schemas = dict(tools) if isinstance(tools, Mapping) else {}

    def _call(self, body: str) -> tuple[str, str] | None:
        function = self.FUNCTION.search(body)
        if function is None or function.group(1).strip() not in self.tool_names:
            return None
        name = function.group(1).strip()
        properties = (self.schemas.get(name) or {}).get("properties")
        properties = properties if isinstance(properties, dict) else {}
        arguments = {}
        for key, value in self.PARAMETER.findall(function.group(2)):
            schema = properties.get(key.strip())
            arguments[key.strip()] = _typed(value, schema if isinstance(schema, dict) else {})
        return name, json.dumps(arguments, ensure_ascii=False)


def _typed(text: str, schema: Mapping[str, Any]) -> Any:
    """A parameter's text (less the newline after its tag and before its end) as the type its
    schema names; text that does not read as that type stays text."""
    value = text.removeprefix("\n").removesuffix("\n")
    kinds = schema.get("type", "string")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if value.strip().lower() == "null" and ("null" in kinds or "string" not in kinds):
        return None
    for kind in kinds:
        try:
            if kind == "integer":
                return int(value.strip())
            if kind == "number":
                number = float(value.strip())
                written_whole = not any(mark in value for mark in ".eE")
                return int(number) if number.is_integer() and written_whole else number
            if kind == "boolean" and value.strip().lower() in ("true", "false"):
                return value.strip().lower() == "true"
            if kind in ("object", "array"):
                try:
                    return json.loads(value)
                except ValueError:
                    return ast.literal_eval(value.strip())
        except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
            continue
    return value


class RequiredToolCalls(ToolCallReader):
    """``tool_choice="required"``: the answer is a JSON list of calls, read once it is whole;
    an answer cut short (max_tokens) is content."""

    def __init__(self) -> None:
        super().__init__()
        self.text = ""

    def feed(self, piece: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        self.text += piece
        if not final:
            return "", []
        try:
            calls = json.loads(self.text)
        except ValueError:
            return self.text, []
        if not (
            isinstance(calls, list)
            and all(isinstance(c, dict) and {"name", "parameters"} <= c.keys() for c in calls)
        ):
            return self.text, []
        self.num_calls = len(calls)
        return "", [
            call_delta(i, call["name"], json.dumps(call["parameters"], ensure_ascii=False))
            for i, call in enumerate(calls)
        ]

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return "tool_calls" if self.num_calls and engine_reason == "stop" else engine_reason


class NamedToolCall(ToolCallReader):
    """A named ``tool_choice``: the whole answer is the call's arguments, streamed as they come
    (finish_reason stays the engine's, as OpenAI reports a forced call)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, piece: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        if not piece and not (final and self.num_calls == 0):
            return "", []
        first = self.num_calls == 0
        self.num_calls = 1
        return "", [call_delta(0, self.name if first else None, piece)]


def tool_call_reader(
    request: ChatCompletionRequest, auto_parser: str | None
) -> ToolCallReader | None:
    """The reader a request's ``tool_choice`` needs; None: the answer is all content.

    Raises ValueError for "auto" on a server started without a tool-call parser.
    """
    choice = request.tool_choice
    if isinstance(choice, NamedToolChoice):
        return NamedToolCall(choice.function.name)
    if choice == "required":
        return RequiredToolCalls()
    if choice != "auto":
        return None
    if auto_parser is None:
        raise ValueError(
            '"auto" tool choice requires --enable-auto-tool-choice and '
            "--tool-call-parser to be set."
        )
    tools = {tool.function.name: tool.function.parameters for tool in request.tools or []}
    return TOOL_CALL_PARSERS[auto_parser](tools, request.parallel_tool_calls)


ReaderFactory = Callable[[Mapping[str, Any], bool], ToolCallReader]
TOOL_CALL_PARSERS: dict[str, ReaderFactory] = {
    "hermes": HermesToolCalls,
    "qwen3_coder": Qwen3CoderToolCalls,
}
"""``--tool-call-parser`` names (vLLM's, and a plugin's) -> the reader of that format."""
BUILT_IN_TOOL_CALL_PARSERS = tuple(TOOL_CALL_PARSERS)

Reader = TypeVar("Reader", bound=type[ToolCallReader])


def register_tool_call_parser(name: str) -> Callable[[Reader], Reader]:
    """Decorate a ``ToolCallReader`` subclass (in a ``--tool-parser-plugin`` file): ``--tool-call-
    parser NAME`` then reads ``tool_choice="auto"`` answers with it, built per request as
    ``cls(tools, parallel)``: the request's tools (name -> parameters' JSON schema) and its
    ``parallel_tool_calls``."""

    def register(cls: Reader) -> Reader:
        if not (isinstance(cls, type) and issubclass(cls, ToolCallReader)):
            raise TypeError(f"tool-call parser {name!r} must be a ToolCallReader subclass.")
        TOOL_CALL_PARSERS[name] = cast(ReaderFactory, cls)
        return cls

    return register
