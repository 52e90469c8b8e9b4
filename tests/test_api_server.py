"""The OpenAI-compatible server, end to end: a real `omniserve serve` subprocess on loopback,
driven by the official `openai` SDK (sync and async) and raw httpx for the error shapes.

One server for the module. The engine-death test kills that server's engine, so it runs last.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server_utils import (
    API_KEY,
    MODEL,
    Server,
    assert_error,
    assert_kill_fails_cleanly,
    launch_server,
    metric,
)

MAX_MODEL_LEN = 1024  # long enough that a max-length answer outlives the 0.5 s client timeouts
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMNISERVE_TORCH_PROFILER_DIR", str(tmp_path_factory.mktemp("profiles")))
        env.setenv("VLLM_SERVER_DEV_MODE", "1")
        with launch_server(
            tiny_checkpoint("Qwen3ForCausalLM"),
            tmp_path_factory.mktemp("server"),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--kv-cache-memory",
            "64MiB",
            "--max-request-body-mb",
            "2",
            "--enable-tokenizer-info-endpoint",
        ) as running:
            yield running


def _chat(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


# ---- basics ----


def test_serve_help_lists_flags_with_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    from omniserve.entrypoints.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in (
        "--host",
        "--port",
        "--served-model-name",
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--kv-cache-memory",
        "--dtype",
        "--device",
        "--api-key",
        "--chat-template",
        "--enable-prefix-caching, --no-enable-prefix-caching",
        "--seed",
        "--uvicorn-log-level",
    ):
        assert flag in text, flag
    assert "(default: 8000)" in text and "(default: 127.0.0.1)" in text


@pytest.mark.slow
def test_serve_logs_load_progress_and_one_ready_line(server: Server) -> None:
    """What `omniserve serve` prints while it starts: each shard as it is read, where each layer
    runs, then one line with the dtype, the weight bytes and the KV budget."""
    log = server.log.read_text()
    assert "Loaded shard 1/1" in log and "CPU backend: " in log
    ready = [line for line in log.splitlines() if "Ready: Qwen3ForCausalLM" in line]
    assert len(ready) == 1, log[-2000:]
    for part in ("in float32", "weights ", "KV cache ", "tokens in", "loaded in"):
        assert part in ready[0], ready[0]


def test_models_health_version(server: Server) -> None:
    assert httpx.get(server.url + "/health").status_code == 200  # open without the key
    assert httpx.head(server.url + "/health").status_code == 200  # load balancers probe so
    for method in ("GET", "POST", "HEAD"):  # vLLM's /ping, which SageMaker probes
        response = httpx.request(method, server.url + "/ping")
        assert response.status_code == 200 and response.content == b""
    assert httpx.get(server.url + "/version").json()["version"]
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert server.client().models.retrieve(MODEL) == models.data[0]  # GET /v1/models/{model}
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client().models.retrieve("org/nope")


def test_chat_completion_and_usage(server: Server) -> None:
    messages = _chat("Tell me a story about a cat.")
    response = server.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, **GREEDY
    )
    choice = response.choices[0]
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    num_prompt = server.post("/tokenize", {"messages": messages}).json()["count"]
    assert response.usage.prompt_tokens == num_prompt
    assert response.usage.completion_tokens == 10
    assert response.usage.total_tokens == num_prompt + 10


def test_chat_stream_joins_to_full_answer(server: Server) -> None:
    async def run() -> None:
        client = server.async_client()
        messages = _chat("Write a haiku about the sea.")
        full = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=16, **GREEDY
        )
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
        chunks = [chunk async for chunk in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == full.choices[0].message.content
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == "length" and not any(finishes[:-1])
        assert chunks[-1].choices == []
        # The second run of the same prompt may hit the prefix cache: compare the counts only.
        streamed = chunks[-1].usage
        assert (streamed.prompt_tokens, streamed.completion_tokens, streamed.total_tokens) == (
            full.usage.prompt_tokens,
            full.usage.completion_tokens,
            full.usage.total_tokens,
        )
        await client.close()

    asyncio.run(run())


def test_completion_stream_and_echo(server: Server) -> None:
    client = server.client()
    prompt = "The quick brown fox"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY)
    assert full.object == "text_completion" and full.usage.completion_tokens == 12
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, stream=True, **GREEDY
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == full.choices[0].text
    echo = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, echo=True, **GREEDY)
    assert echo.choices[0].text == prompt + full.choices[0].text
    # Token-id prompts and a batch of prompts: one choice per prompt, indexed in order.
    ids = server.post("/tokenize", {"prompt": prompt}).json()["tokens"]
    from_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, **GREEDY)
    assert from_ids.choices[0].text == full.choices[0].text
    batch = client.completions.create(
        model=MODEL, prompt=[prompt, "Hello"], max_tokens=12, **GREEDY
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == full.choices[0].text
    hello = server.post("/tokenize", {"prompt": "Hello"}).json()
    assert batch.usage.prompt_tokens == len(ids) + hello["count"]


def test_n_samples(server: Server) -> None:
    client = server.client()
    kwargs = {
        "model": MODEL,
        "messages": _chat("Name a color."),
        "max_tokens": 8,
        "n": 3,
        "extra_body": {"ignore_eos": True},
    }
    greedy = client.chat.completions.create(temperature=0.0, **kwargs)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.message.content for c in greedy.choices}) == 1
    assert greedy.usage.completion_tokens == 24
    sampled = client.chat.completions.create(temperature=1.0, seed=7, **kwargs)
    assert len({c.message.content for c in sampled.choices}) > 1
    stream = client.chat.completions.create(temperature=1.0, seed=7, stream=True, **kwargs)
    joined = ["", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            joined[choice.index] += choice.delta.content or ""
    assert joined == [c.message.content for c in sampled.choices]  # seeded per sample


def test_chat_logprobs(server: Server) -> None:
    response = server.client().chat.completions.create(
        model=MODEL,
        messages=_chat("Count to three."),
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        **GREEDY,
    )
    content = response.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        # greedy: the chosen token is the most likely one
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.bytes == list(entry.token.encode())


def test_completion_logprobs_and_echo(server: Server) -> None:
    client = server.client()
    prompt = "Once upon a time"
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, logprobs=2, **GREEDY
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert 2 <= len(top) <= 3 and chosen == pytest.approx(max(top.values()))
    echoed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, logprobs=2, echo=True, **GREEDY
    )
    num_prompt = echoed.usage.prompt_tokens
    echo_logprobs = echoed.choices[0].logprobs
    assert len(echo_logprobs.tokens) == num_prompt + 5
    assert echo_logprobs.token_logprobs[0] is None and echo_logprobs.top_logprobs[0] is None
    assert all(lp is not None for lp in echo_logprobs.token_logprobs[1:])
    assert echo_logprobs.token_logprobs[num_prompt:] == pytest.approx(logprobs.token_logprobs)


def test_prompt_logprobs_on_completions_and_chat(server: Server) -> None:
    """vLLM's ``prompt_logprobs``: per prompt position (the first has none) the prompt's token
    and the top k, keyed by token id, with rank and text; the same values as echo's logprobs
    and on the chat route the rendered prompt's; refused with stream and past the limit."""
    prompt, k = "Once upon a time", 3
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    out = server.post("/v1/completions", {**body, "prompt_logprobs": k, "return_token_ids": True})
    choice = out.json()["choices"][0]
    ids, positions = choice["prompt_token_ids"], choice["prompt_logprobs"]
    assert len(positions) == len(ids) and positions[0] is None
    echoed = server.post("/v1/completions", {**body, "echo": True, "logprobs": k}).json()
    echo_logprobs = echoed["choices"][0]["logprobs"]["token_logprobs"][: len(ids)]
    for i, (token_id, position) in enumerate(zip(ids[1:], positions[1:], strict=True), 1):
        assert k <= len(position) <= k + 1 and str(token_id) in position
        entry = position[str(token_id)]
        assert entry["logprob"] == pytest.approx(echo_logprobs[i], abs=1e-5)
        assert entry["rank"] >= 1 and isinstance(entry["decoded_token"], str)
        top = sorted(position.values(), key=lambda e: e["rank"])[:k]
        assert [e["rank"] for e in top] == [1, 2, 3]
    chat = server.post(
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": _chat("hi"),
            "max_tokens": 1,
            "prompt_logprobs": 0,
            "return_token_ids": True,
        },
    ).json()
    assert len(chat["prompt_logprobs"]) == len(chat["prompt_token_ids"])
    assert all(len(p) == 1 for p in chat["prompt_logprobs"][1:])  # k=0: the prompt's token
    error = assert_error(server.post("/v1/completions", {**body, "prompt_logprobs": 1,
                                                          "stream": True}), 400)  # fmt: skip
    assert "prompt_logprobs is not available with stream" in error["message"]
    error = assert_error(server.post("/v1/completions", {**body, "prompt_logprobs": 10_000}), 400)
    assert error["param"] == "prompt_logprobs"


def test_an_empty_answer_is_an_empty_string(server: Server) -> None:
    """A stop string that the first token already holds leaves nothing: content is "", as in
    OpenAI's and vLLM's answers (null is for tool calls)."""
    client = server.client()
    first = (
        client.chat.completions.create(model=MODEL, messages=_chat("hi"), max_tokens=1, **GREEDY)
        .choices[0]
        .message.content
    )
    assert first
    empty = client.chat.completions.create(
        model=MODEL, messages=_chat("hi"), max_tokens=4, stop=[first], **GREEDY
    ).choices[0]
    assert empty.message.content == "" and empty.finish_reason == "stop"


def test_stop_strings(server: Server) -> None:
    client = server.client()
    prompt = "In the beginning"
    full = (
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **GREEDY)
        .choices[0]
        .text
    )
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected = full[: full.index(stop)]
    stopped = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, stop=[stop], **GREEDY
    ).choices[0]
    assert stopped.text == expected and stopped.finish_reason == "stop"
    assert stopped.model_extra["stop_reason"] == stop
    kept = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=24,
        stop=stop,
        temperature=0.0,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    ).choices[0]
    assert kept.text == expected + stop


def test_tokenize_detokenize(server: Server) -> None:
    tokens = server.post("/tokenize", {"model": MODEL, "prompt": "hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    text = server.post("/detokenize", {"model": MODEL, "tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "hello world"}
    # --enable-tokenizer-info-endpoint (vLLM's): the tokenizer's class, settings and template
    info = httpx.get(server.url + "/get_tokenizer_info", headers=AUTH).json()
    assert info["tokenizer_class"].startswith("Qwen2Tokenizer") and "{%" in info["chat_template"]
    assert info["eos_token"] == "<|im_end|>" and "model_max_length" in info


def test_dev_mode_routes_reset_the_caches(server: Server) -> None:
    """VLLM_SERVER_DEV_MODE=1 (this server's): after /reset_prefix_cache a repeated prompt
    reuses no KV; /reset_mm_cache answers (a text model has no media to forget)."""
    body = {"model": MODEL, "prompt": "word " * 40, "max_tokens": 1}

    def cached() -> int:
        return server.post("/v1/completions", body).json()["usage"]["prompt_tokens_details"][
            "cached_tokens"]  # fmt: skip

    cached()
    assert cached() > 0
    assert server.post("/reset_prefix_cache").status_code == 200
    before = metric(server.metrics(), "omniserve:prefix_cache_queries_total")
    assert cached() == 0
    # the engine's counters restart at the reset; the exported counter keeps growing
    assert metric(server.metrics(), "omniserve:prefix_cache_queries_total") > before
    assert server.post("/reset_mm_cache").status_code == 200
    assert_error(server.post("/reset_prefix_cache", key=None), 401)


def test_profile_routes_write_the_trace(server: Server) -> None:
    """vLLM's /start_profile and /stop_profile (the server was started with a profiler dir)."""
    directory = Path(os.environ["OMNISERVE_TORCH_PROFILER_DIR"])
    assert server.post("/start_profile", {}).status_code == 200
    server.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert server.post("/stop_profile", {}).status_code == 200
    assert "aten::" in (directory / "profiler_out_0.txt").read_text()
    assert "not running" in assert_error(server.post("/stop_profile", {}), 400)["message"]


def test_sagemaker_invocations_route_by_the_body(server: Server) -> None:
    """vLLM's ``POST /invocations``: a body goes where its fields say (chat, completion,
    embeddings, rerank, score) and is answered as there; others are 400s naming the fields."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "temperature": 0}  # fmt: skip
    completion = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "temperature": 0}
    for body, route, kind in [
        (chat, "/v1/chat/completions", "chat.completion"),
        (completion, "/v1/completions", "text_completion"),
        ({"model": MODEL, "input": "hi"}, "/v1/embeddings", "list"),
        ({"model": MODEL, "query": "a", "documents": ["b", "c"]}, "/rerank", None),
        ({"model": MODEL, "text_1": "a", "text_2": "b"}, "/score", "list"),
    ]:
        there, here = server.post(route, body), server.post("/invocations", body)
        assert here.status_code == 200, here.text
        answer, expected = here.json(), there.json()
        assert answer.get("object") == kind
        for drop in ("id", "created"):
            answer.pop(drop, None), expected.pop(drop, None)
        assert answer == expected
    streamed = server.post("/invocations", {**chat, "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.rstrip().endswith("data: [DONE]")
    error = assert_error(server.post("/invocations", {"model": MODEL, "text": "hi"}), 400)
    assert "routes a request by its fields, and this one has none of them" in error["message"]
    assert "takes a JSON object" in assert_error(server.post("/invocations", [1]), 400)["message"]
    assert_error(server.post("/invocations", content=b"{oops"), 400)
    assert_error(server.post("/invocations", completion, key=None), 401)
    assert_error(server.post("/score", {"text_1": "a", "text_2": "b"}, key=None), 401)


# ---- errors ----


def test_api_key_enforced(server: Server) -> None:
    for key in (None, "wrong"):
        error = assert_error(
            server.post("/v1/completions", {"model": MODEL, "prompt": "x"}, key=key), 401
        )
        assert "API key" in error["message"]
    assert_error(server.post("/tokenize", {"prompt": "x"}, key=None), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


LONG_TEXT = "word " * (MAX_MODEL_LEN + 10)
ERROR_CASES = [
    ("/v1/chat/completions", {"messages": _chat(LONG_TEXT)}, 400, "maximum context length"),
    ("/v1/completions", {"prompt": LONG_TEXT, "max_tokens": 1}, 400, "maximum context length"),
    (
        "/v1/chat/completions",
        {"messages": _chat("hi"), "max_tokens": MAX_MODEL_LEN},
        400,
        "maximum context length",
    ),
    (
        "/v1/chat/completions",
        {"messages": _chat("hi"), "max_tokens": MAX_MODEL_LEN, "stream": True},
        400,
        "maximum context length",
    ),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (
        "/v1/chat/completions",
        {"messages": _chat("hi"), "max_completion_tokens": -1},
        400,
        "max_completion_tokens",
    ),
    ("/v1/chat/completions", {"messages": _chat("hi"), "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 1000}, 400, "n"),
    ("/v1/chat/completions", {}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": _chat("hi"), "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": _chat("hi"), "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    (
        "/v1/chat/completions",
        {"messages": _chat("hi"), "logprobs": True, "top_logprobs": 50},
        400,
        "top_logprobs",
    ),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "vocabulary"),
    ("/v1/completions", {"prompt": []}, 400, "empty"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**9]}, 400, "vocabulary"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    (
        "/v1/chat/completions",
        {"messages": _chat("hi"), "modalities": ["text", "audio"]},
        400,
        "audio (voice and format) is required",
    ),
    (
        "/v1/chat/completions",
        {"messages": _chat("hi"), "audio": {"voice": "ethan", "format": "wav"}},
        400,
        'apply only with "audio" in modalities',
    ),
    (
        "/v1/chat/completions",
        {
            "messages": _chat("hi"),
            "modalities": ["audio"],
            "audio": {"voice": "ethan", "format": "wav"},
        },
        400,
        "cannot speak",
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "logit_bias": {"one": 5}},
        400,
        "logit_bias keys must be token ids",
    ),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1": 500}}, 400, "[-100, 100]"),
    (
        "/v1/chat/completions",
        {"messages": _chat("hi"), "allowed_token_ids": [10**9]},
        400,
        "allowed_token_ids: token ids",
    ),
    ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}, 404, "does not exist"),
    ("/v1/chat/completions", [1, 2], 400, "object"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),  # its param
    ("/tokenize", {"prompt": "hi", "messages": _chat("hi")}, 400, "not both"),
]


@pytest.mark.parametrize(("path", "body", "status", "needle"), ERROR_CASES)
def test_request_errors(server: Server, path: str, body: Any, status: int, needle: str) -> None:
    if isinstance(body, dict):
        body = {"model": MODEL, **body}
    error = assert_error(server.post(path, body), status)
    assert needle in error["message"] or needle == error["param"], error


def test_malformed_json_and_sdk_errors(server: Server) -> None:
    assert_error(server.post("/v1/chat/completions", content=b'{"model": "tiny", "mess'), 400)
    for content, needle in (
        (b"", "The request body is empty"),
        (b'{"messages": "\xff"}', "Malformed body: UnicodeDecodeError"),
        (b"[" * 3000 + b"]" * 3000, "Malformed body: RecursionError"),
        (b'{"prompt": "x", "n": ' + b"9" * 5000 + b"}", "Malformed body: ValueError"),
        (b'{"prompt": "x", "top_p": NaN}', "top_p: Input should be a finite number"),
    ):
        error = assert_error(server.post("/v1/completions", content=content), 400)
        assert error["message"].startswith(needle), error
    body = b'{"model": "tiny", "prompt": "hi"}'
    for headers in ({"Content-Type": "text/plain"}, {}):
        plain = httpx.post(server.url + "/v1/completions", content=body, timeout=60,
                           headers={"Authorization": f"Bearer {API_KEY}", **headers})  # fmt: skip
        assert "Content-Type: application/json" in assert_error(plain, 400)["message"]
    assert_error(httpx.get(server.url + "/no/such/route", headers=AUTH), 404)
    assert_error(httpx.get(server.url + "/no/such/route"), 401)  # guarded: not even its absence
    client = server.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=MAX_MODEL_LEN)
    assert "maximum context length" in bad.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=_chat("hi"))


@pytest.mark.parametrize(
    ("path", "body", "param", "needle"),
    [
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
        ("/v1/completions", {"prompt": [10**9]}, "prompt", "outside the vocabulary"),
        ("/v1/completions", {"prompt": ["a", [{}]]}, "prompt", "valid"),
        ("/v1/chat/completions", {"messages": [{"role": 1, "content": "hi"}]},
         "messages[0].role", "must be a non-empty string"),
        ("/v1/chat/completions", {"messages": [{"role": None, "content": "hi"}]},
         "messages[0].role", "must be a non-empty string"),
        ("/v1/chat/completions", {"messages": _chat("hi"), "chat_template_kwargs": {"messages": 1}},
         "chat_template_kwargs.messages", "set from the request itself"),
        ("/v1/chat/completions", {"messages": _chat("hi"), "add_generation_prompt": False,
                                  "continue_final_message": True},
         "continue_final_message", "must be the assistant's"),
        ("/v1/completions", {"prompt": "hi", "structured_outputs": {}},
         "structured_outputs", "has no constraint"),
        ("/detokenize", {"tokens": [10**9]}, "tokens", "outside the vocabulary"),
        ("/detokenize", {"tokens": [-1]}, "tokens", "outside the vocabulary"),
        ("/tokenize", {"messages": "x"}, "messages", "valid list"),
    ],
)  # fmt: skip
def test_400s_name_the_field(
    server: Server, path: str, body: dict[str, Any], param: str, needle: str
) -> None:
    error = assert_error(server.post(path, {"model": MODEL, **body}), 400)
    assert error["param"] == param and needle in error["message"], error


@pytest.mark.parametrize(
    ("path", "body", "where"),
    [
        ("/v1/completions", '{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
        ("/v1/chat/completions",
         '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", '
         '"text": "x"}, {"type": "text", "text": "\\udfff"}]}]}',
         "messages[0].content[1].text"),
        ("/v1/completions", '{"model": "a\\ud800", "prompt": "hi"}', "model"),
        ("/v1/completions", '{"model": "tiny", "prompt": "hi", "stop": ["\\ud800"]}',
         "stop[0]"),
        ("/v1/completions", '{"model": "tiny", "prompt": "hi", "a\\ud800": 1}', "a\\ud800"),
        ("/tokenize", '{"model": "tiny", "prompt": "\\ud800"}', "prompt"),
    ],
)  # fmt: skip
def test_lone_surrogates_are_located_400s_and_the_connection_lives(
    server: Server, path: str, body: str, where: str
) -> None:
    """JSON's ``\\uD800``-``\\uDFFF`` escapes parse to text no UTF-8 consumer can encode:
    refused with the place named, on a keep-alive connection that then serves on."""
    headers = {"Authorization": "Bearer sk-test", "Content-Type": "application/json"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
        error = assert_error(client.post(path, content=body.encode()), 400)
        assert f"{where} holds a lone UTF-16 surrogate" in error["message"], error
        ok = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


# ---- metrics, load, cancellation ----


def test_metrics_move_after_traffic(server: Server) -> None:
    before = server.metrics()
    client = server.client()
    for _ in range(2):
        client.completions.create(
            model=MODEL, prompt="Metrics please. " * 12, max_tokens=5, **GREEDY
        )
    after = server.metrics()

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("omniserve:generation_tokens_total") == 10
    assert delta("omniserve:prompt_tokens_total") >= 2
    assert delta("omniserve:request_success_total", finished_reason="length") == 2
    for histogram in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_time_per_output_token_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
    ):
        assert delta(f"omniserve:{histogram}_count") == 2
    # The phases add up: prefill and decode make the inference, inside arrival to finish.
    phase = {name: delta(f"omniserve:request_{name}_time_seconds_sum")
             for name in ("queue", "prefill", "decode", "inference")}  # fmt: skip
    assert phase["prefill"] + phase["decode"] == pytest.approx(phase["inference"], abs=1e-6)
    assert phase["queue"] + phase["inference"] <= delta("omniserve:e2e_request_latency_seconds_sum")
    assert delta("omniserve:prefix_cache_queries_total") > 0
    assert delta("omniserve:prefix_cache_hits_total") > 0  # the second prompt reused the first
    assert metric(after, "omniserve:num_requests_running") == 0
    assert metric(after, "omniserve:kv_cache_usage_perc") == 0


def test_64_concurrent_requests_match_greedy(server: Server) -> None:
    prompts = [f"Request number {i} says" for i in range(8)]

    async def run() -> None:
        client = server.async_client()

        async def complete(prompt: str, stream: bool) -> str:
            if not stream:
                response = await client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=12, **GREEDY
                )
                return response.choices[0].text
            chunks = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=12, stream=True, **GREEDY
            )
            return "".join([c.choices[0].text async for c in chunks if c.choices])

        expected = [await complete(p, stream=False) for p in prompts]
        results = await asyncio.gather(
            *(complete(prompts[i % 8], stream=i % 2 == 1) for i in range(64))
        )
        assert results == [expected[i % 8] for i in range(64)]
        await client.close()

    asyncio.run(run())


def _wait_for_idle(server: Server, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        values = server.metrics()
        idle = all(
            metric(values, f"omniserve:{name}") == 0
            for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        )
        if idle or time.monotonic() > deadline:
            return values
        time.sleep(0.2)


def test_cancelled_streams_free_everything(server: Server) -> None:
    before = server.metrics()

    async def run() -> None:
        client = server.async_client()

        async def read_two_chunks_then_leave() -> None:
            stream = await client.completions.create(
                model=MODEL,
                prompt="Keep talking forever",
                max_tokens=MAX_MODEL_LEN - 16,
                stream=True,
                **GREEDY,
            )
            received = 0
            async for _ in stream:
                received += 1
                if received == 2:
                    break
            await stream.close()

        await asyncio.gather(*(read_two_chunks_then_leave() for _ in range(50)))
        await client.close()

    asyncio.run(run())
    after = _wait_for_idle(server)
    assert metric(after, "omniserve:num_requests_running") == 0
    assert metric(after, "omniserve:num_requests_waiting") == 0
    assert metric(after, "omniserve:kv_cache_usage_perc") == 0
    aborted = metric(after, "omniserve:request_success_total", finished_reason="abort") - metric(
        before, "omniserve:request_success_total", finished_reason="abort"
    )
    assert aborted == 50  # every one was stopped mid-stream, none ran to its length


def test_non_streaming_disconnect_aborts(server: Server) -> None:
    before = server.metrics()
    with pytest.raises(httpx.ReadTimeout):
        server.post(
            "/v1/completions",
            {
                "model": MODEL,
                "prompt": "A long answer",
                "max_tokens": MAX_MODEL_LEN - 16,
                "ignore_eos": True,
            },
            timeout=0.5,
        )
    after = _wait_for_idle(server)
    assert metric(after, "omniserve:num_requests_running") == 0
    assert metric(after, "omniserve:kv_cache_usage_perc") == 0
    assert (
        metric(after, "omniserve:request_success_total", finished_reason="abort")
        - metric(before, "omniserve:request_success_total", finished_reason="abort")
    ) == 1


# ---- no request can take the server down ----

# Each of these killed the engine for every later request (sampler overflow, int64 overflow).
ENGINE_KILLERS = [
    {"temperature": float("inf"), "min_tokens": 4},
    {"temperature": 1e39, "min_tokens": 1},
    {"temperature": float("nan")},
    {"repetition_penalty": 1e-40},
    {"repetition_penalty": 1e-50},
    {"top_p": 1e-50},
    {"top_k": 2**63},
    {"top_k": 2**31},
    {"seed": 2**64},
    {"stop_token_ids": [2**63]},
]


def test_engine_killing_parameters_are_400s_and_the_engine_lives(server: Server) -> None:
    messages = _chat("Hello")
    reference = (
        server.client()
        .chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **GREEDY)
        .choices[0]
        .message.content
    )
    for fields in ENGINE_KILLERS:
        body = {"model": MODEL, "messages": messages, "max_tokens": 8, **fields}
        response = server.post("/v1/chat/completions", content=json.dumps(body).encode())
        error = assert_error(response, 400)
        assert error["type"] == "invalid_request_error", (fields, error)
    # Extreme but computable values are served, n > 1 children of the largest seed included.
    extreme = server.client().chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=4,
        n=2,
        seed=2**64 - 1,
        temperature=3e38,
        top_p=1.2e-38,
        extra_body={"repetition_penalty": 1e30, "top_k": 2**31 - 1, "min_tokens": 2},
    )
    assert len(extreme.choices) == 2
    assert httpx.get(server.url + "/health").status_code == 200
    again = server.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, **GREEDY
    )
    assert again.choices[0].message.content == reference


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"stream": "yes"}, "stream"),
        ({"n": 1.0}, "n"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"logprobs": 1}, "logprobs"),
        ({"ignore_eos": "true"}, "ignore_eos"),
    ],
)
def test_booleans_and_integers_are_strict(
    server: Server, fields: dict[str, Any], field: str
) -> None:
    body = {"model": MODEL, "messages": _chat("Hi"), "max_tokens": 4, **fields}
    error = assert_error(server.post("/v1/chat/completions", body), 400)
    assert error["param"] == field and error["message"].startswith(f"{field}: "), error


def test_processor_kwargs_on_a_text_model_are_refused(server: Server) -> None:
    body = {
        "model": MODEL,
        "messages": _chat("Hi"),
        "max_tokens": 4,
        "mm_processor_kwargs": {"return_tensors": "np"},
    }
    error = assert_error(server.post("/v1/chat/completions", body), 400)
    assert "mm_processor_kwargs given, but this model takes no multimodal input" in error["message"]


def test_bodies_over_the_limit_are_413s(server: Server) -> None:
    big = json.dumps({"model": MODEL, "prompt": "x" * (3 * 2**20)}).encode()
    error = assert_error(server.post("/v1/completions", content=big), 413)
    assert error["code"] == "request_too_large" and "--max-request-body-mb" in error["message"]
    chunks = (b'{"model": "x", "prompt": "' + b"y" * 2**20 for _ in range(4))
    streamed = httpx.post(
        server.url + "/v1/completions",
        content=chunks,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert_error(streamed, 413)  # no Content-Length: counted as it streams in
    assert httpx.get(server.url + "/health").status_code == 200


def test_too_many_headers_are_431s(server: Server) -> None:
    """vLLM's --h11-max-header-count (256 by default): more header fields are refused before
    any route reads the request; fewer pass."""
    body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 1}

    def post(extra: int) -> httpx.Response:
        headers = [("Authorization", f"Bearer {API_KEY}")]
        headers += [(f"x-filler-{i}", "1") for i in range(extra)]
        return httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=60)

    assert post(240).status_code == 200  # (with httpx's own few)
    error = assert_error(post(300), 431)
    assert error["code"] == "too_many_headers" and "--h11-max-header-count" in error["message"]


def test_text_that_cannot_fit_is_refused_before_tokenizing(server: Server) -> None:
    """A text longer than max_model_len times the longest token cannot fit: a 400 without
    tokenizing it (the event loop stays free)."""
    text = "hello " * 200_000  # 1.2 MB
    for path, body in (
        ("/v1/chat/completions", {"messages": _chat(text)}),
        ("/v1/completions", {"prompt": text}),
    ):
        start = time.monotonic()
        error = assert_error(server.post(path, {"model": MODEL, "max_tokens": 4, **body}), 400)
        assert error["code"] == "context_length_exceeded", error
        assert "characters" in error["message"] and time.monotonic() - start < 5


def test_error_bodies_have_openai_types_and_codes(server: Server) -> None:
    missing = assert_error(
        server.post("/v1/chat/completions", {"model": "nope", "messages": _chat("Hi")}), 404
    )
    assert (missing["type"], missing["code"], missing["param"]) == (
        "invalid_request_error",
        "model_not_found",
        "model",
    )
    unauthorized = assert_error(server.post("/v1/models", {}, key="wrong"), 401)
    assert unauthorized["code"] == "invalid_api_key"
    too_long = assert_error(
        server.post(
            "/v1/chat/completions",
            {"model": MODEL, "messages": _chat("Hi"), "max_tokens": MAX_MODEL_LEN},
        ),
        400,
    )
    assert (too_long["code"], too_long["param"]) == ("context_length_exceeded", "max_tokens")
    for path, body, field in (
        ("/v1/chat/completions", {"messages": _chat(LONG_TEXT)}, "messages"),
        ("/v1/completions", {"prompt": LONG_TEXT}, "prompt"),
    ):
        prompt_too_long = assert_error(server.post(path, {"model": MODEL, **body}), 400)
        assert (prompt_too_long["code"], prompt_too_long["param"]) == (
            "context_length_exceeded",
            field,
        )


def test_openapi_schema_documents_bodies_and_real_statuses(server: Server) -> None:
    """What a schema fuzzer checks responses against: each route's body model, and the error
    statuses it really returns (400 for validation, never FastAPI's default 422)."""
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    chat = paths["/v1/chat/completions"]["post"]["responses"]
    assert chat["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ChatCompletionResponse"
    )
    assert "text/event-stream" in chat["200"]["content"]
    assert {"400", "401", "404", "413", "500", "503"} <= set(chat)
    assert all("422" not in op["responses"] for ops in paths.values() for op in ops.values())


def _engine_pid(server_pid: int) -> int:
    """The engine core: the server's spawned child (not multiprocessing's resource tracker)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == server_pid and b"spawn_main" in cmdline:
            return int(entry.name)
    raise AssertionError("no engine child process found")


# ---- vLLM's request fields: each works, or is a 400 naming it ----

CHAT_FIELDS_THAT_WORK = {
    "top_k": 5,
    "min_p": 0.1,
    "repetition_penalty": 1.1,
    "stop_token_ids": [5],
    "include_stop_str_in_output": True,
    "ignore_eos": True,
    "min_tokens": 1,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "seed": 3,
    "structured_outputs": {"choice": ["a", "b"]},
    "guided_choice": ["a", "b"],
    "guided_decoding_backend": "xgrammar",
    "prompt_logprobs": 1,
    "documents": [{"title": "t", "text": "x"}],
    "reasoning_effort": "low",
    "include_reasoning": True,
    "parallel_tool_calls": False,
    "user": "u",
    "chat_template_kwargs": {"enable_thinking": False},
    "add_generation_prompt": True,
    "max_completion_tokens": 3,
    "logprobs": True,
    "tool_choice": "none",
    "response_format": {"type": "text"},
    "some_other_servers_field": 1,
    "allowed_token_ids": [1, 2],
    "bad_words": ["x"],
    "logit_bias": {"5": 1.0},
    "modalities": ["text"],
    "truncate_prompt_tokens": 8,
    "cache_salt": "s",
    "return_token_ids": True,
    "return_tokens_as_token_ids": True,
    "echo": True,
    "add_special_tokens": True,
    "use_beam_search": True,
}
CHAT_FIELDS_REFUSED = {
    "best_of": 2,
    "logits_processors": ["m.p"],
    "kv_transfer_params": {"a": 1},
    "vllm_xargs": {"a": 1},
    "guided_whitespace_pattern": " ",
    "media_io_kwargs": {"video": {"num_frames": 4}},
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto",
}


def _post_each(server: Server, fields: dict[str, Any]) -> dict[str, httpx.Response]:
    """A chat request per field (field -> its response), sent side by side."""

    async def run() -> dict[str, httpx.Response]:
        async with httpx.AsyncClient(
            base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}
        ) as client:
            responses = await asyncio.gather(
                *(
                    client.post(
                        "/v1/chat/completions",
                        json={
                            "model": MODEL,
                            "messages": _chat("Hi"),
                            "max_tokens": 3,
                            field: value,
                        },
                    )
                    for field, value in fields.items()
                )
            )
        return dict(zip(fields, responses, strict=True))

    return asyncio.run(run())


def test_vllm_chat_fields_that_work(server: Server) -> None:
    failed = {
        field: r.text
        for field, r in _post_each(server, CHAT_FIELDS_THAT_WORK).items()
        if r.status_code != 200
    }
    assert not failed


def test_vllm_chat_fields_refused_by_name(server: Server) -> None:
    for field, response in _post_each(server, CHAT_FIELDS_REFUSED).items():
        error = assert_error(response, 400)
        assert field in error["message"] and "not supported" in error["message"], error
    # A thinking budget needs the model's thinking tags (the tiny tokenizer has none).
    body = {"model": MODEL, "messages": _chat("Hi"), "thinking_token_budget": 10}
    error = assert_error(server.post("/v1/chat/completions", body), 400)
    assert error["message"].startswith("thinking_token_budget")
    assert "no <think> and </think> tokens" in error["message"]
    # xgrammar is the one backend: vLLM's other names are refused, naming the field
    body = {"model": MODEL, "messages": _chat("Hi"), "guided_decoding_backend": "outlines"}
    error = assert_error(server.post("/v1/chat/completions", body), 400)
    assert error["param"] == "guided_decoding_backend" and "xgrammar" in error["message"]


def test_prompt_options_truncation_and_cache_salt(server: Server) -> None:
    """truncate_prompt_tokens keeps the prompt's last tokens; cache_salt keeps prefix-cache
    blocks to the requests with the same salt."""
    prompt = "one two three four five six seven eight nine ten " * 12
    ids = server.post("/tokenize", {"prompt": prompt}).json()["tokens"]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "return_token_ids": True}
    cut = server.post("/v1/completions", {**body, "truncate_prompt_tokens": 5}).json()
    assert cut["usage"]["prompt_tokens"] == 5 and cut["choices"][0]["prompt_token_ids"] == ids[-5:]
    assert_error(server.post("/v1/completions", {**body, "truncate_prompt_tokens": 0}), 400)

    def cached(salt: str | None) -> int:
        answer = server.post("/v1/completions", {**body, "cache_salt": salt}).json()
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("alice") == 0 and cached("alice") > 0  # the second one hits alice's blocks
    assert cached("bob") == 0 and cached(None) == 0  # nor bob's request nor an unsalted one


def test_return_token_ids_and_tokens_as_ids(server: Server) -> None:
    body = {
        "model": MODEL,
        "messages": _chat("Hi"),
        "max_tokens": 5,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "logprobs": True,
        "top_logprobs": 1,
        "return_tokens_as_token_ids": True,
    }
    whole = server.post("/v1/chat/completions", body).json()
    prompt = server.post("/tokenize", {"messages": _chat("Hi")}).json()["tokens"]
    assert whole["prompt_token_ids"] == prompt
    (choice,) = whole["choices"]
    assert [e["token"] for e in choice["logprobs"]["content"]] == [
        f"token_id:{t}" for t in choice["token_ids"]
    ]
    chunks = [
        json.loads(line[6:])
        for line in server.post("/v1/chat/completions", {**body, "stream": True}).text.splitlines()
        if line.startswith("data: {")
    ]
    assert [c["prompt_token_ids"] for c in chunks if c.get("prompt_token_ids")] == [prompt]
    assert (
        sum((c["choices"][0].get("token_ids") or [] for c in chunks if c["choices"]), [])
        == choice["token_ids"]
    )


def test_chat_echo_and_request_templates(server: Server) -> None:
    """echo starts the answer with the assistant message it continues; a request's own chat
    template needs --trust-request-chat-template."""
    body = {
        "model": MODEL,
        "max_tokens": 3,
        "temperature": 0.0,
        "echo": True,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "messages": [*_chat("Count."), {"role": "assistant", "content": "One, two,"}],
    }
    whole = server.post("/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    assert whole.startswith("One, two,") and len(whole) > len("One, two,")
    streamed = [
        json.loads(line[6:])
        for line in server.post("/v1/chat/completions", {**body, "stream": True}).text.splitlines()
        if line.startswith("data: {")
    ]
    assert (
        "".join(c["choices"][0]["delta"].get("content") or "" for c in streamed if c["choices"])
        == whole
    )
    error = assert_error(
        server.post(
            "/v1/chat/completions",
            {"model": MODEL, "messages": _chat("Hi"), "chat_template": "{{ messages }}"},
        ),
        400,
    )
    assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"]


@pytest.mark.slow
def test_a_trusted_request_template_renders_the_prompt(qwen3_server: Server) -> None:
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"
    prompt = qwen3_server.post("/tokenize", {"messages": _chat("Hi"), "chat_template": template})
    text = qwen3_server.post("/detokenize", {"tokens": prompt.json()["tokens"]}).json()["prompt"]
    assert text == "[user] Hi\n[assistant]"
    answer = qwen3_server.post(
        "/v1/chat/completions",
        {"model": MODEL, "messages": _chat("Hi"), "chat_template": template, "max_tokens": 2},
    )
    assert answer.status_code == 200, answer.text


def test_vllm_completion_fields_and_request_id(server: Server) -> None:
    body = {
        "model": MODEL,
        "prompt": "Hi",
        "max_tokens": 2,
        "add_special_tokens": False,
        "request_id": "my-id-1",
    }
    response = server.post("/v1/completions", body)
    assert response.status_code == 200 and response.json()["id"] == "cmpl-my-id-1"
    for field, value in (("prompt_embeds", "AAAA"), ("suffix", "x"), ("priority", 2)):
        error = assert_error(server.post("/v1/completions", {**body, field: value}), 400)
        assert field in error["message"]
    other = server.post("/v1/completions", {**body, "request_id": None, "other_servers_field": 1})
    assert other.status_code == 200, other.text
    assert (
        "Ignored request fields this server does not use: other_servers_field"
        in server.log.read_text()
    )
    # Inside an object too (a misspelt option is in the log, not dropped unseen).
    typo = {**body, "stream": True, "stream_options": {"include_usgae": True}}
    assert server.post("/v1/completions", typo).status_code == 200
    assert "does not use (in StreamOptions): include_usgae" in server.log.read_text()


def test_cors_preflight_is_answered_without_a_key(server: Server) -> None:
    response = httpx.options(
        server.url + "/v1/chat/completions",
        headers={"Origin": "http://example.com", "Access-Control-Request-Method": "POST"},
    )
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] in ("*", "http://example.com")


def test_engine_death_fails_requests_and_health(server: Server) -> None:
    """Runs last: it kills the module's engine."""
    assert_kill_fails_cleanly(
        server, _engine_pid(server.proc.pid), max_tokens=MAX_MODEL_LEN - 16, **GREEDY
    )
