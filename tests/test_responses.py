"""The Responses API (``/v1/responses``) as the OpenAI SDK uses it: each request answers as the
chat request it amounts to (same tokens, same usage), streamed events assemble (by the SDK's own
accumulator) into the whole response, thinking and tool calls come as their own output items,
``previous_response_id`` continues a stored conversation exactly as if it had been sent whole,
background responses run, cancel and are deleted, ``truncation: "auto"`` drops the oldest turns,
and what has no meaning here is a 400 naming the field."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from omniserve.entrypoints.openai.responses_protocol import (
    ResponseObject,
    ResponsesRequest,
    conversation_of,
)
from omniserve.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from omniserve.entrypoints.openai.serving_engine import ServingError
from tests.server_utils import API_KEY, MODEL, Server, assert_error
from tests.test_reasoning import THOUGHT_THEN_ANSWER
from tests.test_tool_calls import HERMES_CALL, TIGHT, TOOLS, WEATHER

FLAT_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0.0}


def _stream(server: Server, **kwargs: Any) -> tuple[Any, list[Any]]:
    """The final response the SDK assembles from the events, and the events."""
    with server.client().responses.stream(**kwargs) as stream:
        events = list(stream)
        return stream.get_final_response(), events


def _items(response: Any) -> list[tuple[str, str]]:
    """(type, text or call) of each output item."""
    out = []
    for item in response.output:
        if item.type == "message":
            out.append(("message", "".join(part.text for part in item.content)))
        elif item.type == "reasoning":
            out.append(("reasoning", "".join(part.text for part in item.content)))
        else:
            out.append(("function_call", f"{item.name} {item.arguments}"))
    return out


def test_an_answer_is_the_chat_answer_whole_and_streamed(qwen3_server: Server) -> None:
    client = qwen3_server.client()
    chat = client.chat.completions.create(
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_completion_tokens=6, logprobs=True, top_logprobs=2, **GREEDY,
    )  # fmt: skip
    response = client.responses.create(
        instructions="Be brief.", input="Hi", max_output_tokens=6, top_logprobs=2,
        include=["message.output_text.logprobs"], metadata={"run": "1"}, **GREEDY,
    )  # fmt: skip
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat.choices[0].message.content
    assert (response.status, response.incomplete_details.reason) == (
        "incomplete",
        "max_output_tokens",
    )
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, 6)
    assert usage.total_tokens == usage.input_tokens + 6
    logprobs = response.output[0].content[0].logprobs
    expected = chat.choices[0].logprobs.content  # a prefix-cache hit may round differently
    assert [lp.token for lp in logprobs] == [lp.token for lp in expected]
    assert [lp.logprob for lp in logprobs] == pytest.approx(
        [lp.logprob for lp in expected], abs=1e-4
    )
    assert all(len(lp.top_logprobs) == 2 for lp in logprobs)
    assert (response.instructions, response.metadata, response.temperature) == (
        "Be brief.", {"run": "1"}, 0.0,
    )  # fmt: skip
    # a stream cut by max_output_tokens ends with response.incomplete (as OpenAI's), which the
    # SDK's accumulator does not take as an end: read the raw events
    events = list(client.responses.create(
        instructions="Be brief.", input="Hi", max_output_tokens=6, stream=True, **GREEDY
    ))  # fmt: skip
    assert events[-1].response.output[0].content[0].text == response.output_text
    assert events[-1].response.status == "incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete",
    ]  # fmt: skip
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == response.output_text


def test_thinking_and_tool_calls_are_output_items(qwen3_server: Server) -> None:
    ask = {"input": "Think, then answer.", "max_output_tokens": 40, **GREEDY}
    regex = {"extra_body": {"structured_outputs": {"regex": THOUGHT_THEN_ANSWER}}}
    whole = qwen3_server.client().responses.create(**ask, **regex)
    (kind, thought), (kind2, answer) = _items(whole)
    assert (kind, kind2) == ("reasoning", "message") and thought.strip() and answer
    assert whole.output_text == answer
    # the tokens up to </think>: <think>, a newline, the word's tokens, a newline, </think>
    assert 4 <= whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens
    streamed, _ = _stream(qwen3_server, **ask, **regex)
    assert _items(streamed) == _items(whole)

    calls = {"input": "What is the weather in Paris?", "tools": FLAT_TOOLS,
             "max_output_tokens": 120, **GREEDY}  # fmt: skip
    auto = {"extra_body": {"structured_outputs": {"regex": HERMES_CALL}}}
    whole = qwen3_server.client().responses.create(**calls, **auto)
    (kind, text), (kind2, call) = _items(whole)
    assert (kind, text, kind2) == ("message", "Let me check.", "function_call")
    assert whole.output[1].call_id and whole.status == "completed"
    streamed, events = _stream(qwen3_server, **calls, **auto)
    assert _items(streamed) == _items(whole)
    assert "response.function_call_arguments.done" in [e.type for e in events]
    for choice in ("required", {"type": "function", "name": "get_time"}):
        forced = qwen3_server.client().responses.create(
            **calls, tool_choice=choice, extra_body=TIGHT
        )
        assert [item.type for item in forced.output] == ["function_call"]
        item = forced.output[0]
        jsonschema.validate(
            json.loads(item.arguments),
            FLAT_TOOLS[[t["name"] for t in FLAT_TOOLS].index(item.name)]["parameters"],
        )  # noqa: E501
        if isinstance(choice, dict):
            assert item.name == "get_time"


def test_previous_response_id_continues_as_if_sent_whole(qwen3_server: Server) -> None:
    client = qwen3_server.client()
    first = client.responses.create(
        instructions="Use the tools.", input="What is the weather in Paris?", tools=FLAT_TOOLS,
        tool_choice="required", max_output_tokens=120, extra_body=TIGHT, **GREEDY,
    )  # fmt: skip
    call = first.output[0]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees"}
    follow = {"tools": FLAT_TOOLS, "tool_choice": "none", "max_output_tokens": 8, **GREEDY}
    chained = client.responses.create(previous_response_id=first.id, input=[result], **follow)
    whole = [
        {"role": "user", "content": "What is the weather in Paris?"},
        *[item.model_dump(exclude_none=True) for item in first.output],
        result,
    ]
    sent = client.responses.create(input=whole, **follow)  # the instructions are not carried over
    assert chained.output_text == sent.output_text
    assert chained.usage.input_tokens == sent.usage.input_tokens
    assert sent.usage.input_tokens_details.cached_tokens > 0  # the chained prompt's blocks
    assert chained.previous_response_id == first.id
    assert client.responses.retrieve(chained.id).output_text == chained.output_text
    (item,) = client.responses.input_items.list(first.id).data
    assert (item.type, item.content[0].text) == ("message", "What is the weather in Paris?")
    page = client.responses.input_items.list(sent.id, order="asc", limit=2)
    assert [i.type for i in page.data] == ["message", "function_call"] and page.has_more
    rest = client.responses.input_items.list(sent.id, order="asc", after=page.data[-1].id)
    assert [i.type for i in rest.data] == ["function_call_output"] and not rest.has_more


def test_media_parts_answer_as_in_chat(default_server: Server) -> None:
    """On the trained demo model: input_image and input_audio answer as chat's parts do."""
    from tests.test_default_model import IMAGE, WAV, _png

    image = "data:image/png;base64," + base64.b64encode(_png(IMAGE)).decode()
    audio = {"data": base64.b64encode(WAV).decode(), "format": "wav"}
    question = {"type": "input_text", "text": "What do you see and hear?"}
    client = default_server.client()
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image}},
            {"type": "input_audio", "input_audio": audio}, question]}],
        max_tokens=24, **GREEDY,
    )  # fmt: skip
    response = client.responses.create(
        input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": image, "detail": "auto"},
            {"type": "input_audio", "input_audio": audio}, question]}],
        max_output_tokens=24, **GREEDY,
    )  # fmt: skip
    assert response.output_text == chat.choices[0].message.content
    details = response.usage.input_tokens_details.model_extra
    assert details["image_tokens"] == chat.usage.prompt_tokens_details.image_tokens > 0
    assert details["audio_tokens"] == chat.usage.prompt_tokens_details.audio_tokens > 0
    broken = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    content = [{"role": "user", "content": [question, broken]}]
    bad = default_server.post("/v1/responses", {"model": MODEL, "input": content})
    assert assert_error(bad, 400)["param"] == "input[0].content[1]"


def test_json_schema_format(qwen3_server: Server) -> None:
    response = qwen3_server.client().responses.create(
        input="Weather?", max_output_tokens=60, extra_body=TIGHT, **GREEDY,
        text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER}},
    )  # fmt: skip
    jsonschema.validate(json.loads(response.output_text), WEATHER)
    assert response.text.format.schema_ == WEATHER  # echoed


def _wait(client: openai.OpenAI, response_id: str) -> Any:
    for _ in range(200):
        response = client.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress"):
            return response
        time.sleep(0.05)
    raise AssertionError(f"{response_id} still {response.status}")


def test_background_store_cancel_and_delete(qwen3_server: Server) -> None:
    client = qwen3_server.client()
    queued = client.responses.create(input="Hi", max_output_tokens=5, background=True, **GREEDY)
    assert queued.status == "queued" and queued.background
    done = _wait(client, queued.id)
    assert done.status == "incomplete" and done.usage.output_tokens == 5
    long = client.responses.create(
        input="Hi", max_output_tokens=900, background=True, extra_body={"ignore_eos": True}
    )
    assert client.responses.cancel(long.id).status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    error = assert_error(qwen3_server.post("/v1/responses", {
        "model": MODEL, "input": "x", "previous_response_id": long.id}), 400)  # fmt: skip
    assert "cancelled" in error["message"] and error["param"] == "previous_response_id"
    assert client.responses.cancel(done.id).status == "incomplete"  # ended: as it is
    client.responses.delete(queued.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(queued.id)
    unstored = client.responses.create(input="Hi", max_output_tokens=2, store=False)
    assert not unstored.store
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    plain = client.responses.create(input="Hi", max_output_tokens=2)
    assert_error(qwen3_server.post(f"/v1/responses/{plain.id}/cancel", {}), 400)


def test_a_background_stream_is_resumed_from_any_event(qwen3_server: Server) -> None:
    """background + stream: the events a stream sends, numbered; ``GET ...?stream=true&
    starting_after=N`` sends the rest again, after the run or in its middle."""
    client = qwen3_server.client()
    greedy = {"input": "Hi", **GREEDY, "extra_body": {"ignore_eos": True}}
    events = list(client.responses.create(background=True, stream=True, max_output_tokens=6,
                                          **greedy))  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    stored = _wait(client, events[0].response.id)
    assert stored.background and stored.status == "incomplete"
    assert stored.output_text == client.responses.create(max_output_tokens=6, **greedy).output_text
    again = client.responses.retrieve(stored.id, stream=True, starting_after=3)
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events[4:]]
    # A client that leaves after five events picks the run up where it left it.
    stream = client.responses.create(background=True, stream=True, max_output_tokens=200,
                                     **greedy)  # fmt: skip
    events_left = iter(stream)
    first = [next(events_left) for _ in range(5)]
    stream.close()
    rest = list(client.responses.retrieve(first[0].response.id, stream=True, starting_after=4))
    numbers = [e.sequence_number for e in first + rest]
    assert numbers == list(range(len(numbers))) and rest[-1].type == "response.incomplete"
    assert rest[-1].response.usage.output_tokens == 200
    # Only a background run created with stream has events to stream again.
    quiet = client.responses.create(background=True, max_output_tokens=2, **greedy)
    for query, param in (("stream=true", "stream"), ("starting_after=2", "starting_after")):
        response = httpx.get(f"{qwen3_server.url}/v1/responses/{quiet.id}?{query}",
                             headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
        assert assert_error(response, 400)["param"] == param


def test_truncation_auto_drops_the_oldest_turns(qwen3_server: Server) -> None:
    long = " ".join(["word"] * 700)
    conversation = [
        {"role": "user", "content": long},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "ok"}]},
        {"role": "user", "content": "Hi"},
    ]  # fmt: skip
    body = {"model": MODEL, "input": conversation, "max_output_tokens": 400}
    error = assert_error(qwen3_server.post("/v1/responses", body), 400)
    assert error["code"] == "context_length_exceeded"
    response = qwen3_server.post("/v1/responses", {**body, "truncation": "auto"}).json()
    short = qwen3_server.post("/v1/responses", {**body, "input": conversation[2:]}).json()
    assert response["usage"]["input_tokens"] == short["usage"]["input_tokens"]


@pytest.mark.parametrize(
    ("body", "param", "match"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "no hosted tools"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice.type", "not available"),
        (
            {"input": [{"type": "item_reference", "id": "x"}]},
            "input[0].type",
            "previous_response_id",
        ),  # noqa: E501
        ({"include": ["reasoning.encrypted_content"]}, "include", "not available here"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0]",
            "input_file is not supported",
        ),  # fmt: skip
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "input[0].content[0].file_id",
            "no Files API",
        ),  # fmt: skip
        (
            {
                "input": [
                    {"role": "user", "content": "hi"},
                    {
                        "type": "function_call",
                        "call_id": "1",
                        "name": "get_weather",
                        "arguments": "{oops",
                    },
                ]
            },
            "input[1].arguments",
            "not JSON",
        ),  # fmt: skip
        ({"input": [{"role": "tool", "content": "hi"}]}, "input[0].role", "must be one of"),
        ({"use_beam_search": True}, "use_beam_search", "chat and completions"),
        ({"max_output_tokens": 5000}, "max_output_tokens", "maximum context length"),
        ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
        ({"background": True, "store": False}, "background", "background needs store=true"),
        ({"reasoning": {"summary": "detailed"}}, "reasoning.summary", "auto"),
        (
            {"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice",
            "not among the tools",
        ),  # fmt: skip
        ({"previous_response_id": "resp_nope"}, "previous_response_id", "No stored response"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(
    qwen3_server: Server, body: dict, param: str | None, match: str
) -> None:
    response = qwen3_server.post("/v1/responses", {"model": MODEL, "input": "x", **body})
    error = assert_error(response, 404 if "resp_nope" in str(body) else 400)
    assert match in error["message"] and error["param"] == param, error


def test_conversation_origins_follow_dropped_turns() -> None:
    request = ResponsesRequest(
        instructions="sys",
        input=[
            {"role": "user", "content": "a"},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text",
                                                                          "text": "r"}]},
            {"role": "user", "content": [{"type": "input_text", "text": "b"}]},
        ],
    )  # fmt: skip
    conversation = conversation_of(request, [{"role": "user", "content": "old"}])
    roles = [m["role"] for m in conversation.messages]
    assert roles == ["system", "user", "user", "assistant", "tool", "user"]
    assert conversation.relocate("messages[3].tool_calls[0].function.arguments is bad") == (
        "input[1].arguments is bad"
    )
    assert conversation.relocate("messages[4].content[0]") == "input[2].output[0]"
    assert conversation.relocate("messages[0]: x") == "instructions: x"
    assert conversation.drop_oldest_turn()  # the stored turn
    assert [m["role"] for m in conversation.messages][:2] == ["system", "user"]
    assert conversation.relocate("messages[4].content[0]") == "input[3].content[0]"
    assert conversation.drop_oldest_turn()  # the call and its result go with their turn
    assert conversation.relocate("messages[1].content[0]") == "input[3].content[0]"
    assert not conversation.drop_oldest_turn()  # the last turn stays


def test_a_chain_stores_each_turn_once() -> None:
    """Each stored response holds its own turn and names the one it continued: a long chat
    with an image in its first turn stores the image once, not once per turn."""
    image = "data:image/png;base64," + "A" * 100_000
    store = ResponseStore(10**7)

    def put(response_id: str, turn: list[dict[str, Any]], parent: str | None) -> None:
        request = ResponsesRequest(model="m", input="x", previous_response_id=parent)
        response = ResponseObject.of(request, response_id, "m", {"temperature": 1, "top_p": 1})
        store.put(StoredResponse(response, turn, [], parent=parent))

    first = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]},
             {"role": "assistant", "content": "A cat."}]  # fmt: skip
    put("resp_1", first, None)
    for i in range(2, 21):
        turn = [{"role": "user", "content": f"Q{i}"}, {"role": "assistant", "content": f"A{i}"}]
        put(f"resp_{i}", turn, f"resp_{i - 1}")
    conversation = store.conversation("resp_20")
    assert len(conversation) == 40 and conversation[:2] == first
    assert conversation[-2:] == [{"role": "user", "content": "Q20"},
                                 {"role": "assistant", "content": "A20"}]  # fmt: skip
    assert store.size < 2 * len(image)
    store.pop("resp_10")
    with pytest.raises(ServingError, match="'resp_10', an earlier turn of 'resp_20'"):
        store.conversation("resp_20")
    assert len(store.conversation("resp_9")) == 18
