"""The ``omniserve`` command's offline subcommands, run as a user would."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMNISERVE_ENABLE_MULTIPROCESSING": "0"}


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "omniserve.entrypoints.cli", *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )


@pytest.mark.slow
def test_make_tiny_and_generate(tmp_path):
    out = tmp_path / "ckpt"
    made = _run("make-tiny", "LlamaForCausalLM", "--out", str(out))
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == str(out)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    gen = _run(
        "generate",
        str(out),
        "--prompt",
        "Once upon a time",
        "--max-tokens",
        "5",
        "--dtype",
        "float32",
    )
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("'Once upon a time' -> ")


def test_models_lists_the_zoo():
    listed = _run("models")
    assert listed.returncode == 0, listed.stderr
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM"):
        assert arch in listed.stdout


@pytest.mark.slow
def test_errors_are_one_line_and_nonzero(tmp_path):
    missing = _run("generate", str(tmp_path / "nope"))
    assert missing.returncode == 2
    assert "not a directory" in missing.stderr and "Traceback" not in missing.stderr
    unknown = _run("make-tiny", "NoSuchArch", "--out", str(tmp_path / "x"))
    assert unknown.returncode == 2 and "NoSuchArch" in unknown.stderr


VLLM_SERVE_FLAGS = [  # from `vllm serve --help`: each means the same here, or nothing (logged)
    "--host",
    "0.0.0.0",
    "--port",
    "8001",
    "--api-key",
    "k",
    "--served-model-name",
    "a",
    "b",
    "--chat-template",
    "{{ messages }}",
    "--max-model-len",
    "128",
    "--dtype",
    "bfloat16",
    "--seed",
    "1",
    "--tensor-parallel-size",
    "1",
    "--pipeline-parallel-size",
    "1",
    "--data-parallel-size",
    "1",
    "--distributed-executor-backend",
    "mp",
    "--block-size",
    "16",
    "--max-num-seqs",
    "8",
    "--max-num-batched-tokens",
    "256",
    "--enable-chunked-prefill",
    "--no-enable-prefix-caching",
    "--num-gpu-blocks-override",
    "64",
    "--gpu-memory-utilization",
    "0.5",
    "--max-logprobs",
    "5",
    "--generation-config",
    "vllm",
    "--limit-mm-per-prompt",
    '{"image": 1}',
    "--mm-processor-kwargs",
    '{"max_pixels": 1000}',
    "--mm-processor-cache-gb",
    "1",
    "--media-io-kwargs",
    '{"video": {"num_frames": 8}}',
    "--allowed-local-media-path",
    "/tmp",
    "--allowed-media-domains",
    "example.com",
    "--reasoning-parser",
    "qwen3",
    "--shutdown-timeout",
    "5",
    "--allowed-origins",
    '["http://a"]',
    "--allowed-methods",
    '["GET"]',
    "--allowed-headers",
    '["x"]',
    "--allow-credentials",
    "--enforce-eager",
    "--trust-remote-code",
    "--disable-log-requests",
    "--disable-log-stats",
    "--swap-space",
    "4",
    "--disable-custom-all-reduce",
    "--tokenizer-mode",
    "auto",
    "--load-format",
    "safetensors",
    "--kv-cache-dtype",
    "auto",
    "--download-dir",
    "/tmp",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--exclude-tools-when-tool-choice-none",
]


def test_serve_takes_vllm_flags(caplog):
    from omniserve.entrypoints.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "model-dir", *VLLM_SERVE_FLAGS])
    with caplog.at_level("INFO", logger="omniserve.engine.arg_checks"):
        args.check_flags(parser, args)
    assert (
        args.gpu_memory_utilization,
        args.max_logprobs,
        args.allowed_origins,
        args.tool_call_parser,
    ) == (0.5, 5, ["http://a"], "hermes")
    assert args.enforce_eager and "--enforce-eager has no effect" not in caplog.text
    assert "--swap-space has no effect here: preempted requests are recomputed" in caplog.text


def test_run_batch_takes_the_same_vllm_flags(caplog):
    from omniserve.entrypoints.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["run-batch", "-i", "in", "-o", "out", "--trust-remote-code",
                              "--compilation-config", '{"level": 0}'])  # fmt: skip
    with caplog.at_level("INFO", logger="omniserve.engine.arg_checks"):
        args.check_flags(parser, args)
    assert "--trust-remote-code has no effect here" in caplog.text
    args = parser.parse_args(["serve", "-O0"])  # vLLM's optimization level 0: no graphs
    args.check_flags(parser, args)
    assert args.optimization_level == 0
    assert parser.parse_args(["serve", "--shutdown-timeout", "inf"]).shutdown_timeout == float(
        "inf"
    )


def test_serve_refuses_flags_of_missing_features(capsys):
    from omniserve.entrypoints.cli import main

    for flags, message in (
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
        (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
        (["--enable-log-outputs"], "--enable-log-outputs needs --enable-log-requests"),
        (["--enable-log-requests", "--max-log-len", "-1"], "--max-log-len: -1 is not in [0,"),
        (["--port", "70000"], "argument --port: 70000 is not in [0, 65535]"),
        (["--max-request-body-mb", "0"], "argument --max-request-body-mb: 0 is not in"),
        (["--shutdown-timeout", "-1"], "argument --shutdown-timeout: -1 is not in [0, inf]"),
        (["--allowed-origins", '"http://a.com"'], "is not a JSON list of strings"),
        (["--allowed-headers", '["x", 1]'], "is not a JSON list of strings"),
        (["--enable-lora", "--lora-modules", "a"], "--lora-modules 'a': expected name=path"),
        (
            ["--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 3}'],
            "speculative_config.method 'eagle3' is not supported",
        ),
        (
            ["--speculative-config", '{"method": "ngram", "prompt_lookup_max": 0}'],
            "speculative_config needs num_speculative_tokens",
        ),
        (
            [
                "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 2}',
                "--async-scheduling",
            ],
            "--speculative-config does not work with --async-scheduling",
        ),
    ):
        for command in (["serve", "model-dir"], ["run-batch", "-i", "in", "-o", "out"]):
            if command[0] == "run-batch" and flags[0] not in _SERVING_FLAGS:
                continue  # a server flag run-batch has not
            with pytest.raises(SystemExit) as exit_:
                main([*command, *flags])
            assert exit_.value.code == 2
            assert message in capsys.readouterr().err


_SERVING_FLAGS = {"--enable-auto-tool-choice", "--lora-modules", "--enable-log-outputs",
                  "--enable-log-requests", "--enable-lora", "--speculative-config"}  # fmt: skip
"""The flags ``serve`` and ``run-batch`` share, which both check alike."""


def test_max_logprobs_and_memory_utilization(tiny_checkpoint, monkeypatch):
    from omniserve import LLM, SamplingParams
    from omniserve.worker.memory import cpu_kv_budget_for_utilization

    assert cpu_kv_budget_for_utilization(0.9, 1) > cpu_kv_budget_for_utilization(0.5, 1)
    monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(
        str(tiny_checkpoint("Qwen3ForCausalLM")),
        max_model_len=64,
        max_logprobs=2,
        gpu_memory_utilization=0.5,
    )
    try:
        with pytest.raises(ValueError, match="at most 2 logprobs"):
            llm.generate("hi", SamplingParams(max_tokens=2, logprobs=3), use_tqdm=False)
        assert (
            llm.generate("hi", SamplingParams(max_tokens=2, logprobs=2), use_tqdm=False)[0]
            .outputs[0]
            .logprobs
        )
    finally:
        llm.llm_engine.shutdown()


@contextlib.contextmanager
def _file_host(files: dict[str, bytes]) -> Iterator[str]:
    """A local http server of ``files`` (GET a name; PUT stores one there; else a 404)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            body = files.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body if body is not None else b"no such file")

        def do_PUT(self) -> None:  # noqa: N802
            files[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(201)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_run_batch_reads_and_uploads_by_url(tmp_path):
    """vLLM's: an http(s) input is fetched, an http(s) output is PUT; a failing status says
    which URL answered what."""
    from omniserve.entrypoints.openai.run_batch import read_input, upload_output

    answers = tmp_path / "answers.jsonl"
    answers.write_text('{"id": 1}\n')
    with _file_host({"/in.jsonl": b'{"custom_id": "a"}\n'}) as host:
        assert asyncio.run(read_input(f"{host}/in.jsonl")) == '{"custom_id": "a"}\n'
        with pytest.raises(RuntimeError, match=f"GET {host}/missing answered 404"):
            asyncio.run(read_input(f"{host}/missing"))
        asyncio.run(upload_output(answers, f"{host}/out.jsonl"))
        assert asyncio.run(read_input(f"{host}/out.jsonl")) == '{"id": 1}\n'


@pytest.mark.slow
def test_run_batch_answers_each_line_as_the_server_would(tiny_checkpoint, tmp_path):
    """vLLM's run-batch: each line's answer is what its route answers (a refusal a 400 with the
    route's error body), lines that reach no route carry an error, in input order; the batch
    is fetched from a URL and the answers PUT to one."""
    from omniserve import LLM, SamplingParams

    model_dir = str(tiny_checkpoint("Qwen3ForCausalLM"))
    messages = [{"role": "user", "content": "Hello"}]
    chat = {"model": "tiny", "messages": messages, "max_tokens": 5, "temperature": 0}
    lines = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {"custom_id": "completion", "method": "POST", "url": "/v1/completions",
         "body": {"model": "tiny", "prompt": "Once upon", "max_tokens": 4}},
        {"custom_id": "response", "method": "POST", "url": "/v1/responses",
         "body": {"model": "tiny", "input": "Hi", "max_output_tokens": 4}},
        {"custom_id": "empty", "method": "POST", "url": "/v1/chat/completions",
         "body": {**chat, "messages": []}},
        {"custom_id": "stream", "method": "POST", "url": "/v1/chat/completions",
         "body": {**chat, "stream": True}},
        {"custom_id": "embed", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "tiny", "input": ["Hello", "Hi"]}},
        {"custom_id": "moderation", "method": "POST", "url": "/v1/moderations", "body": {}},
        {"custom_id": "rerank", "method": "POST", "url": "/v1/rerank",
         "body": {"model": "tiny", "query": "Hello", "documents": ["Hi", "Bye"], "top_n": 1}},
        {"custom_id": "pool", "method": "POST", "url": "/pooling",
         "body": {"model": "tiny", "input": "Hello there", "task": "token_embed"}},
    ]  # fmt: skip
    files = {"/batch.jsonl": ("\n".join([*map(json.dumps, lines), "{not json"]) + "\n").encode()}
    with _file_host(files) as host:
        run = _run("run-batch", "-i", f"{host}/batch.jsonl", "-o", f"{host}/out.jsonl",
                   "--output-tmp-dir", str(tmp_path), "--model", model_dir,
                   "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "256",
                   "--kv-cache-memory", "16MiB", "--max-num-seqs", "1")  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]  # (2 lines in flight at a time)
    assert list(tmp_path.iterdir()) == []  # the staged upload is gone
    answers = [json.loads(line) for line in files["/out.jsonl"].decode().splitlines()]
    assert [a["custom_id"] for a in answers] == [*(line["custom_id"] for line in lines), None]
    statuses = [a["response"] and a["response"]["status_code"] for a in answers]
    assert statuses == [200, 200, 200, 400, None, 200, None, 200, 200, None]
    body = answers[0]["response"]["body"]
    assert (
        answers[0]["response"]["request_id"] == body["id"] and body["object"] == "chat.completion"
    )
    assert answers[1]["response"]["body"]["object"] == "text_completion"
    assert answers[2]["response"]["body"]["status"] == "incomplete"
    assert answers[3]["response"]["body"]["error"]["param"] == "messages"
    embedded = answers[5]["response"]["body"]
    assert embedded["object"] == "list" and [d["index"] for d in embedded["data"]] == [0, 1]
    assert len(answers[7]["response"]["body"]["results"]) == 1
    pooled = answers[8]["response"]["body"]
    assert len(pooled["data"][0]["data"]) == pooled["usage"]["prompt_tokens"] > 1
    errors = [a["error"] and a["error"]["code"] for a in answers]
    assert errors == [None, None, None, None, "invalid_request", None, "invalid_url", None, None,
                      "invalid_request"]  # fmt: skip
    assert "stream" in answers[4]["error"]["message"]
    assert "line 10" in answers[9]["error"]["message"]
    offline = LLM(model_dir, dtype="float32", max_model_len=256, kv_cache_memory="16MiB")
    greedy = offline.chat(messages, SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)
    assert body["choices"][0]["message"]["content"] == greedy[0].outputs[0].text


def test_chat_and_complete_talk_to_a_running_server(qwen3_server):
    """vLLM's `vllm chat` / `vllm complete`: one --quick message, or a conversation on stdin
    (each turn sent with the ones before), answers streamed; a refusal is said, not raised."""
    import io

    from omniserve.entrypoints.cli import build_parser
    from tests.server_utils import API_KEY

    def run(*argv: str, stdin: str = "") -> tuple[int, str]:
        args = build_parser().parse_args([*argv, "--url", f"{qwen3_server.url}/v1",
                                          "--api-key", API_KEY, "--max-tokens", "4"])  # fmt: skip
        out = io.StringIO()
        return args.func(args, io.StringIO(stdin), out), out.getvalue()

    status, text = run("chat", "-q", "Hello")
    assert status == 0 and text.strip()
    status, text = run("chat", "--system-prompt", "Be brief.", stdin="Hi\n\nAnd then?\n")
    assert status == 0 and text.startswith("Please enter a message for the chat model:\n> ")
    assert text.count("> ") == 4  # two turns, a blank line (asked again), the end of input
    status, text = run("complete", "-q", "Once upon a time")
    assert status == 0 and text.strip()
    status, text = run("chat", "--model-name", "nope", "-q", "Hi")
    assert status == 1 and "Error:" in text and "nope" in text


def test_serve_flags_from_a_config_file(tmp_path) -> None:
    """vLLM's --config FILE: YAML of flags (either spelling), switches as booleans, lists and
    mappings; the model from the file; the command line's own flags win."""
    from omniserve.entrypoints.cli import build_parser
    from omniserve.entrypoints.cli_config import with_config_file

    config = tmp_path / "serve.yaml"
    config.write_text(
        "model: /models/qwen\n"
        "max-num-seqs: 64\n"
        "max_model_len: 2048\n"
        "enforce-eager: true\n"
        "enable-prefix-caching: false\n"
        "served-model-name: [a, b]\n"
        "limit-mm-per-prompt: {image: 2}\n"
    )
    parser = build_parser()
    argv = with_config_file(["serve", "--config", str(config), "--max-num-seqs", "8"], parser)
    args = parser.parse_args(argv)
    assert args.model == "/models/qwen" and args.max_num_seqs == 8  # the command line wins
    assert args.max_model_len == 2048
    assert args.enforce_eager and args.enable_prefix_caching is False
    assert args.served_model_name == ["a", "b"]
    assert json.loads(args.limit_mm_per_prompt) == {"image": 2}
    args = parser.parse_args(with_config_file(["serve", "/other", f"--config={config}"], parser))
    assert args.model == "/other"
    config.write_text("- not a mapping\n")
    with pytest.raises(ValueError, match="not a YAML mapping"):
        with_config_file(["serve", "--config", str(config)], parser)
