"""Structured outputs (xgrammar): JSON schemas, JSON objects, regexes, choices and EBNF grammars
constrain what a random-weight model writes, offline and over the API, streamed and not, beside
free requests in the same batch; a bad constraint is a 400 (a ValueError offline)."""

from __future__ import annotations

import base64
import json
import random
import re
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import numpy as np
import pydantic
import pytest

from omniserve import LLM, SamplingParams
from omniserve.config import ModelConfig
from omniserve.sampling_params import StructuredOutputsParams
from omniserve.structured_output import StructuredOutputManager
from omniserve.tokenizer import get_tokenizer
from tests.server_utils import MODEL, Server, assert_error

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["color", "ok", "n"],
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
}
REGEX = r"[a-c]{3}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe"]
MAX_TOKENS = 200  # a random model may pad JSON with whitespace; the grammar still closes it


class Answer(pydantic.BaseModel):
    color: Literal["red", "green", "blue"]
    ok: bool


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Any) -> Iterator[LLM]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
        engine = LLM(
            str(tiny_checkpoint("Qwen3ForCausalLM")),
            dtype="float32",
            max_model_len=512,
            kv_cache_memory="32MiB",
        )
    yield engine
    engine.llm_engine.shutdown()


def _constrained(**constraint: Any) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(**constraint),
    )


def test_every_kind_of_constraint_holds_offline_in_one_batch(llm: LLM) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate("Free text", free, use_tqdm=False)[0].outputs[0]
    prompts = ["Describe", "Any object", "Code", "Answer", "Digits", "Free text"]
    params = [
        _constrained(json=SCHEMA, disable_any_whitespace=True),
        _constrained(json_object=True, disable_any_whitespace=True),
        _constrained(regex=REGEX),
        _constrained(choice=CHOICES),
        _constrained(grammar='root ::= "n=" [0-9] [0-9]'),
        free,
    ]
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    jsonschema.validate(json.loads(outs[0].text), SCHEMA)
    # Any JSON object may go on past max_tokens (keys are free text): a valid beginning, and
    # a whole object when it stopped by itself.
    assert outs[1].text.startswith("{")
    if outs[1].finish_reason == "stop":
        assert isinstance(json.loads(outs[1].text), dict)
    assert re.fullmatch(REGEX, outs[2].text)
    assert outs[3].text in CHOICES
    assert re.fullmatch(r"n=[0-9]{2}", outs[4].text)
    assert all(outs[i].finish_reason == "stop" for i in (0, 2, 3, 4))
    assert outs[5].token_ids == alone.token_ids  # a free request is untouched by its neighbours


def test_sampled_children_each_follow_the_constraint(llm: LLM) -> None:
    params = SamplingParams(
        n=4,
        temperature=1.0,
        seed=7,
        max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(regex=REGEX),
    )
    texts = [c.text for c in llm.generate("Codes", params, use_tqdm=False)[0].outputs]
    assert all(re.fullmatch(REGEX, text) for text in texts), texts
    assert len(set(texts)) > 1


DEEP_SCHEMA = '{"type": "array", "items": ' * 65 + "{}" + "}" * 65
"""A valid schema nested 66 levels deep (``MAX_SCHEMA_DEPTH`` is 64)."""


@pytest.mark.parametrize(
    ("constraint", "needle"),
    [
        (
            {"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}},
            "structured_outputs.json is not valid",
        ),
        ({"regex": "(unclosed"}, "structured_outputs.regex is not valid"),
        ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar is not valid"),
        ({"json": DEEP_SCHEMA}, "structured_outputs.json nests 66 levels"),
        ({"json": "[" * 5000 + "]" * 5000}, "structured_outputs.json nests over "),
    ],
)
def test_bad_constraints_are_value_errors(llm: LLM, constraint: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        llm.generate("x", _constrained(**constraint), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["b"])


@pytest.fixture(scope="module")
def server(qwen3_server: Server) -> Server:
    return qwen3_server


def test_sdk_parse_returns_the_pydantic_object(server: Server) -> None:
    completion = server.client().chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Pick a color."}],
        response_format=Answer,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Answer)


def test_json_schema_streamed_and_not(server: Server) -> None:
    client = server.client()
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
    }
    messages = [{"role": "user", "content": "Describe it."}]
    compact = {"structured_outputs": {"disable_any_whitespace": True}}
    full = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        response_format=response_format,
        extra_body=compact,
    )
    jsonschema.validate(json.loads(full.choices[0].message.content), SCHEMA)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        stream=True,
        response_format=response_format,
        extra_body=compact,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full.choices[0].message.content


def test_vllm_fields_on_completions_and_chat(server: Server) -> None:
    client = server.client()
    out = client.completions.create(
        model=MODEL,
        prompt="Code:",
        max_tokens=MAX_TOKENS,
        n=2,
        temperature=1.0,
        seed=3,
        extra_body={"structured_outputs": {"regex": REGEX}},
    )
    assert all(re.fullmatch(REGEX, choice.text) for choice in out.choices)
    compact = {"structured_outputs": {"disable_any_whitespace": True}}
    chat = client.chat.completions.create(
        model=MODEL,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        messages=[{"role": "user", "content": "Well?"}],
        extra_body={"guided_choice": CHOICES},
    )
    assert chat.choices[0].message.content in CHOICES
    obj = client.chat.completions.create(
        model=MODEL,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        messages=[{"role": "user", "content": "JSON"}],
        response_format={"type": "json_object"},
        extra_body=compact,
    )
    assert obj.choices[0].message.content.startswith("{")


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex is not valid"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
        ({"structured_outputs": {"jsonn": {}}}, "jsonn"),
        (
            {"guided_regex": "a", "response_format": {"type": "json_object"}},
            "one output constraint, not response_format and guided_regex",
        ),
        ({"response_format": {"type": "json_schema"}}, "json_schema is required"),
        # each named where the request put it, without xgrammar's log time and C++ source line
        (
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "a", "schema": {"type": "nonsense"}}}},
            'response_format.json_schema.schema is not valid: Unsupported type "nonsense"',
        ),
        ({"guided_json": {"type": "nonsense"}}, "guided_json is not valid: Unsupported type"),
        ({"guided_regex": "(a"}, "guided_regex is not valid: Regex parsing error"),
        # too deep to compile in good time (each level costs more), refused before compiling
        (
            {"response_format": {"type": "json_schema", "json_schema": {
                "name": "a", "schema": json.loads(DEEP_SCHEMA)}}},
            "response_format.json_schema.schema nests 66 levels of objects and arrays; at most 64",
        ),
        # compiled in the engine core: a grammar no token can start fails its own request
        (
            {"structured_outputs": {"grammar": 'root ::= root "a"'}},
            "structured_outputs.grammar matches no text this model can write",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": n, "parameters": {"type": t}}}
                       for n, t in (("f", "object"), ("g", "x"))],
             "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tools[1].function.parameters is not valid",
        ),
    ],
)  # fmt: skip
def test_bad_constraints_are_400s(server: Server, fields: dict, needle: str) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 4,
        **fields,
    }
    error = assert_error(server.post("/v1/chat/completions", body), 400)
    assert needle in error["message"], error
    assert ".cc:" not in error["message"]
    if " is not valid" in needle or " nests " in needle or " matches no " in needle:
        assert error["param"] == needle.split(" ", 1)[0]
    ok = server.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_ignore_eos_goes_on_after_the_grammar_ends(llm: LLM) -> None:
    params = SamplingParams(
        temperature=0.0,
        max_tokens=12,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    out = llm.generate("Well?", params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 12 and out.text.startswith(("yes", "no"))


def _no_token_cases(model_dir: str) -> list[dict[str, Any]]:
    """Request fields whose rules together leave no token at some output position: the
    grammar's tokens against ``allowed_token_ids``, bad words, or a ``min_tokens`` that bans the
    only token the grammar has left (its end)."""
    tokenizer = get_tokenizer(model_dir)
    (letter,) = tokenizer.encode("x", add_special_tokens=False)
    digits = [str(d) for d in range(10)]
    return [
        {"guided_regex": "[0-9]+", "allowed_token_ids": [letter]},
        {"guided_choice": ["x"], "min_tokens": 2},
        {"guided_choice": ["x"], "bad_words": ["x"]},
        {"guided_regex": "[0-9]", "bad_words": digits},
    ]


def test_rules_that_leave_no_token_fail_only_their_request(
    server: Server, tiny_checkpoint: Any
) -> None:
    """Each is a 400 naming the cause (streamed, once tokens went out: an error event), and the
    engine serves on: a good request after each, and one running through all of them, are
    answered in full."""
    client = server.client()
    running = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "go"}], max_tokens=64,
        temperature=0.0, stream=True, extra_body={"ignore_eos": True, "min_tokens": 64},
    )  # fmt: skip
    first = next(iter(running))
    for fields in _no_token_cases(str(tiny_checkpoint("Qwen3ForCausalLM"))):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4, **fields}  # fmt: skip
        error = assert_error(server.post("/v1/chat/completions", body), 400)
        assert "no token is possible" in error["message"], (fields, error)
        streamed = server.post("/v1/chat/completions", {**body, "stream": True})
        # a 400 before the stream when the first token fails, else an error event in it
        assert streamed.status_code in (200, 400), streamed.text
        assert "no token is possible" in streamed.text, fields
        ok = server.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert ok.status_code == 200, ok.text
    chunks = [first, *running]
    assert sum(len(c.choices[0].delta.content or "") > 0 for c in chunks if c.choices) > 1
    assert chunks[-1].choices[0].finish_reason == "length"
    assert server.post("/v1/completions", {"model": MODEL, "prompt": "x"}).status_code == 200


def test_rules_that_leave_no_token_end_offline_in_error(llm: LLM, tiny_checkpoint: Any) -> None:
    """Offline, such a request finishes with "error" and its batch-mates are untouched."""
    model_dir = str(tiny_checkpoint("Qwen3ForCausalLM"))
    tokenizer = get_tokenizer(model_dir)
    (letter,) = tokenizer.encode("x", add_special_tokens=False)
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    impossible = [
        SamplingParams(temperature=t, max_tokens=6, allowed_token_ids=[letter],
                       structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
        for t in (0.0, 1.0)
    ]  # fmt: skip
    alone = llm.generate(["Well?"], free, use_tqdm=False)[0].outputs[0]
    outs = llm.generate(["Well?"] * 3, [impossible[0], free, impossible[1]], use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "length", "error"]
    assert outs[1].outputs[0].token_ids == alone.token_ids
    assert all(not outs[i].outputs[0].token_ids for i in (0, 2))


@pytest.mark.parametrize(
    "architecture",
    [
        "Qwen3ForCausalLM",
        "LlamaForCausalLM",
        "Qwen2_5OmniThinkerForConditionalGeneration",
        "Qwen3OmniMoeThinkerForConditionalGeneration",
    ],
)
def test_every_tokenizer_family_writes_valid_json(tiny_checkpoint: Any, architecture: str) -> None:
    """The zoo's tokenizer families (Qwen's, Llama 3's byte-level one, the omni ones with their
    added specials): a writer that takes random allowed tokens always ends with JSON that
    validates, so the grammar engine reads each vocabulary right."""
    path = str(tiny_checkpoint(architecture))
    manager = StructuredOutputManager(ModelConfig.from_path(path))
    params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    tokenizer, rng = get_tokenizer(path), random.Random(0)
    for sample in range(3):
        manager.start(str(sample), manager.compile_async(params).result())
        written: list[int] = []
        while (row := manager.bitmask_row(str(sample))) is not None:
            bits = np.unpackbits(np.frombuffer(row, dtype=np.uint8), bitorder="little")
            token = rng.choice(np.flatnonzero(bits[: manager.vocab_size]).tolist())
            manager.accept(str(sample), [token])
            written.append(token)
        text = tokenizer.decode(written, skip_special_tokens=True)
        jsonschema.validate(json.loads(text), SCHEMA)
    manager.shutdown()


def test_json_schema_with_image_and_audio(default_server: Server) -> None:
    """On the default omni model, constrained and given an image and a sound."""
    from tests.test_default_model import IMAGE, WAV, _messages, _png

    content = (
        default_server.client()
        .chat.completions.create(
            model=MODEL,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": SCHEMA},
            },
            extra_body={"structured_outputs": {"disable_any_whitespace": True}},
            messages=_messages(
                {
                    "type": "image_url",
                    "image_url": {
                        "url": "data:image/png;base64," + base64.b64encode(_png(IMAGE)).decode()
                    },
                },
                {
                    "type": "input_audio",
                    "input_audio": {"data": base64.b64encode(WAV).decode(), "format": "wav"},
                },
            ),
        )
        .choices[0]
        .message.content
    )
    jsonschema.validate(json.loads(content), SCHEMA)
