"""Tool calling as the OpenAI SDK uses it, on a tiny Qwen3 served with ``--enable-auto-tool-choice
--tool-call-parser hermes``: "required" and named choices enforced by the grammar engine, "auto"
calls read from the hermes blocks the model writes (the random model is made to write one with a
regex constraint), streamed deltas assembled by the SDK equal the whole answer, and tool results
go back through the chat template."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest

from omniserve.entrypoints.openai.tool_parsers import HermesToolCalls, Qwen3CoderToolCalls
from tests.server_utils import MODEL, Server, assert_error

WEATHER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "unit"],
    "properties": {
        "city": {"enum": ["Paris", "Oslo"]},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "additionalProperties": False,
                "required": ["zone"],
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
            },
        },
    },
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TIGHT = {"structured_outputs": {"disable_any_whitespace": True}}  # a random model pads JSON
HERMES_CALL = (
    r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "(Paris|Oslo)", "unit": "celsius"\}\}\n</tool_call>'
)


class Weather(pydantic.BaseModel):
    city: Literal["Paris", "Oslo"]
    unit: Literal["celsius", "fahrenheit"]


def _calls(message: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def _ask(server: Server, stream: bool = False, **kwargs: Any) -> Any:
    """The answer as the SDK gives it; streamed ones assembled by the SDK's own helper."""
    kwargs = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "max_tokens": 120,
        "temperature": 0.0,
        **kwargs,
    }
    client = server.client()
    if not stream:
        return client.chat.completions.create(**kwargs)
    with client.chat.completions.stream(**kwargs) as events:
        return events.get_final_completion()


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_validate_against_their_tools(qwen3_server: Server, stream: bool) -> None:
    choice = _ask(qwen3_server, stream, tool_choice="required", extra_body=TIGHT).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    for name, arguments in _calls(choice.message):
        jsonschema.validate(arguments, SCHEMAS[name])
    assert all(c.id.startswith("chatcmpl-tool-") for c in choice.message.tool_calls)
    if not stream:
        assert _calls(choice.message) == _calls(
            _ask(qwen3_server, True, tool_choice="required", extra_body=TIGHT).choices[0].message
        )
    single = (
        _ask(
            qwen3_server,
            stream,
            tool_choice="required",
            parallel_tool_calls=False,
            extra_body=TIGHT,
        )
        .choices[0]
        .message
    )
    assert len(single.tool_calls) == 1


def test_named_choice_calls_that_function_streamed_and_not(qwen3_server: Server) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    whole = _ask(qwen3_server, tool_choice=named, extra_body=TIGHT).choices[0]
    assert whole.finish_reason == "stop"  # as OpenAI reports a forced call
    ((name, arguments),) = _calls(whole.message)
    assert name == "get_time"
    jsonschema.validate(arguments, SCHEMAS["get_time"])
    chunks = list(
        qwen3_server.client().chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice=named,
            max_tokens=120,
            temperature=0.0,
            stream=True,
            extra_body=TIGHT,
        )
    )
    deltas = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_time"  # the first carries the name
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == arguments


def test_parse_with_a_pydantic_tool(qwen3_server: Server) -> None:
    """``client.chat.completions.parse``: strict pydantic tools come back as parsed objects."""
    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    completion = qwen3_server.client().chat.completions.parse(
        model=MODEL,
        messages=ASK,
        tools=[tool],
        max_tokens=120,
        temperature=0.0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body=TIGHT,
    )
    assert isinstance(
        completion.choices[0].message.tool_calls[0].function.parsed_arguments, Weather
    )


@pytest.mark.parametrize("stream", [False, True])
def test_auto_calls_are_read_from_hermes_blocks(qwen3_server: Server, stream: bool) -> None:
    choice = _ask(
        qwen3_server, stream, extra_body={"structured_outputs": {"regex": HERMES_CALL}}
    ).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    ((name, arguments),) = _calls(choice.message)
    assert name == "get_weather" and arguments["unit"] == "celsius"
    plain = _ask(qwen3_server, tool_choice="none", max_tokens=8).choices[0]
    assert plain.message.tool_calls is None and plain.finish_reason == "length"


def test_a_round_trip_renders_calls_and_results_through_the_template(qwen3_server: Server) -> None:
    call = (
        _ask(qwen3_server, tool_choice="required", parallel_tool_calls=False, extra_body=TIGHT)
        .choices[0]
        .message.tool_calls[0]
    )
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"},
    ]
    prompt = qwen3_server.post("/tokenize", {"messages": messages, "tools": TOOLS}).json()
    text = qwen3_server.post("/detokenize", {"tokens": prompt["tokens"]}).json()["prompt"]
    arguments = json.dumps(json.loads(call.function.arguments))
    assert (
        f'<tool_call>\n{{"name": "{call.function.name}", "arguments": {arguments}}}\n'
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n21 degrees\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in text
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    answer = qwen3_server.client().chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4
    )
    assert answer.choices[0].message.content


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"tool_choice": "required"}, "tool_choice is only allowed when tools are given"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "names the function 'nope', which is not among the tools",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "each function needs its own name"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "Give one output constraint, not response_format and tool_choice",
        ),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "1",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": "{oops"},
                            }
                        ],
                    },
                ]
            },
            r"messages\[1\].tool_calls\[0\].function.arguments is not JSON",
        ),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(
    qwen3_server: Server, body: dict, match: str
) -> None:
    response = qwen3_server.post(
        "/v1/chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": 4, **body}
    )
    assert re.search(match, assert_error(response, 400)["message"])


def test_auto_needs_the_servers_parser(default_server: Server) -> None:
    response = default_server.post(
        "/v1/chat/completions", {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 4}
    )
    assert (
        "requires --enable-auto-tool-choice and --tool-call-parser"
        in assert_error(response, 400)["message"]
    )


@pytest.mark.parametrize(
    "text",
    [
        'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n',
        'a <tool_call>{"name": "unknown", "arguments": {}}</tool_call> b',
        '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>\n\nDone. ',
        "no calls, only text \n",
        '<tool_call>{"name": "get_time", "argu',
    ],
)
def test_hermes_reading_does_not_depend_on_the_chunks(text: str) -> None:
    def read(step: int) -> tuple[str, list[tuple[str, str]]]:
        reader, content, calls = HermesToolCalls(list(SCHEMAS), True), "", []
        for start in range(0, len(text), step):
            piece, new = reader.feed(text[start : start + step], start + step >= len(text))
            content += piece
            calls += [(c["function"]["name"], c["function"]["arguments"]) for c in new]
        return content, calls

    whole = read(len(text))
    assert all(read(step) == whole for step in (1, 2, 3, 7))
    if "Sure" in text:
        assert whole == (
            "Sure.",
            [("get_time", '{"zone": "UTC"}'), ("get_weather", '{"city": "Oslo"}')],
        )
    if "unknown" in text:  # not one of the tools: the model's text, as written
        assert whole == (text, [])
    if "Done" in text:
        assert whole[0] == "Done."
    if text.endswith("argu"):  # cut off inside a call
        assert whole == (text, [])


CODER_SCHEMAS = {
    "search": {
        "type": "object",
        "properties": {
            "query": {"type": "string"},
            "limit": {"type": "integer"},
            "score": {"type": "number"},
            "exact": {"type": "boolean"},
            "filters": {"type": "object"},
            "tags": {"type": "array"},
            "note": {"type": ["string", "null"]},
        },
    },
    "noop": {"type": "object", "properties": {}},
}
CODER_TEXT = (
    "Looking it up.\n<tool_call>\n<function=search>\n<parameter=query>\nbest 42 pizza\n"
    "</parameter>\n<parameter=limit>\n5\n</parameter>\n<parameter=score>\n0.5\n</parameter>\n"
    '<parameter=exact>\nTrue\n</parameter>\n<parameter=filters>\n{"city": "Oslo"}\n'
    "</parameter>\n<parameter=tags>\n['a', 'b']\n</parameter>\n<parameter=note>\nnull\n"
    "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=noop>\n</function>\n"
    "</tool_call>"
)


@pytest.mark.parametrize("step", [len(CODER_TEXT), 1, 2, 5, 13])
def test_qwen3_coder_calls_take_the_schema_types(step: int) -> None:
    """vLLM's ``qwen3_coder`` format: parameter text read as its schema's type (a JSON or
    Python literal for objects and arrays), whatever the chunks."""
    reader, content, calls = Qwen3CoderToolCalls(CODER_SCHEMAS, True), "", []
    for start in range(0, len(CODER_TEXT), step):
        piece, new = reader.feed(CODER_TEXT[start : start + step], start + step >= len(CODER_TEXT))
        content += piece
        calls += [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in new]
    assert content == "Looking it up."
    assert calls == [
        ("search", {"query": "best 42 pizza", "limit": 5, "score": 0.5, "exact": True,
                    "filters": {"city": "Oslo"}, "tags": ["a", "b"], "note": None}),
        ("noop", {}),
    ]  # fmt: skip
    assert reader.finish_reason("stop") == "tool_calls"


def test_qwen3_coder_leaves_what_is_no_call_as_content() -> None:
    """A function the request did not offer, or a block without one, is the model's text; a
    value that does not read as its type stays text."""
    for text in ("<tool_call><function=rm>\n</function></tool_call>",
                 "<tool_call>{\"name\": \"search\"}</tool_call>",
                 "<tool_call><function=search><parameter=query>piz"):  # fmt: skip
        reader = Qwen3CoderToolCalls(CODER_SCHEMAS, True)
        assert reader.feed(text, True) == (text, [])
    reader = Qwen3CoderToolCalls(CODER_SCHEMAS, True)
    _, (call,) = reader.feed("<tool_call><function=search><parameter=limit>many"
                             "<parameter=exact>maybe</function></tool_call>", True)  # fmt: skip
    assert json.loads(call["function"]["arguments"]) == {"limit": "many", "exact": "maybe"}


PLUGIN = '''
import json

from omniserve.entrypoints.openai.tool_parsers import (
    ToolCallReader, call_delta, register_tool_call_parser,
)


@register_tool_call_parser("callline")
class CallLines(ToolCallReader):
    """Lines ``CALL name {json}`` are calls; the rest is content."""

    def __init__(self, tools, parallel):
        super().__init__()
        self.text = ""

    def feed(self, piece, final):
        self.text += piece
        if not final:
            return "", []
        content, calls = [], []
        for line in self.text.splitlines():
            if line.startswith("CALL "):
                _, name, arguments = line.split(" ", 2)
                calls.append(call_delta(self.num_calls, name, json.dumps(json.loads(arguments))))
                self.num_calls += 1
            else:
                content.append(line)
        return "\\n".join(content), calls
'''


def test_a_plugin_file_registers_a_parser(tmp_path, capsys) -> None:
    """vLLM's ``--tool-parser-plugin``: the file's parser is a ``--tool-call-parser`` name, and
    ``tool_choice="auto"`` requests read their answers with it; a bad file or name is refused."""
    from omniserve.entrypoints.cli import build_parser, main
    from omniserve.entrypoints.openai.chat_protocol import ChatCompletionRequest
    from omniserve.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS, tool_call_reader

    plugin = tmp_path / "my_parsers.py"
    plugin.write_text(PLUGIN)
    parser = build_parser()
    args = parser.parse_args(
        [
            "serve",
            "--tool-parser-plugin",
            str(plugin),
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "callline",
        ]
    )
    args.check_flags(parser, args)  # fmt: skip
    assert "callline" in TOOL_CALL_PARSERS
    request = ChatCompletionRequest(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], tool_choice="auto",
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
    )  # fmt: skip
    reader = tool_call_reader(request, "callline")
    assert reader is not None
    content, calls = reader.feed('Sure.\nCALL f {"x": 1}', final=True)
    assert content == "Sure." and calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('nope')")
    for flags, message in (
        (["--tool-parser-plugin", str(tmp_path / "none.py")], "none.py: not a Python file"),
        (["--tool-parser-plugin", str(broken)], "broken.py failed to load: RuntimeError('nope')"),
        (["--tool-call-parser", "mistral"], "--tool-call-parser 'mistral' is none of"),
    ):
        with pytest.raises(SystemExit):
            main(["serve", *flags])
        assert message in capsys.readouterr().err
    del TOOL_CALL_PARSERS["callline"]
