"""The server's lifecycle: SIGTERM drains (new requests and /health 503, streams in flight finish,
or end with an error event when the drain runs out of time), and no process outlives the server,
however it ends.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from tests.server_utils import MODEL, Server, assert_error, launch_server

MAX_MODEL_LEN = 2048
LONG = {"max_tokens": 400, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
"""Seconds of decoding on the tiny model: outlives the checks made right after SIGTERM."""
EXIT_TIMEOUT_S = 20


def _descendants(server: Server) -> list[psutil.Process]:
    return psutil.Process(server.proc.pid).children(recursive=True)


def _assert_all_gone(processes: list[psutil.Process], timeout: float) -> None:
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    assert not alive, f"survived the server: {[(p.pid, p.name()) for p in alive]}"


def _launch(tiny_checkpoint: Any, tmp_path: Path, *flags: str) -> Any:
    return launch_server(
        tiny_checkpoint("Qwen3ForCausalLM"),
        tmp_path,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory",
        "64MiB",
        *flags,
    )


@pytest.mark.slow
def test_sigterm_drains_streams_and_refuses_new_requests(
    tiny_checkpoint: Any, tmp_path: Path
) -> None:
    with _launch(tiny_checkpoint, tmp_path, "--shutdown-timeout", "60") as server:
        children = _descendants(server)
        assert children, "the engine core runs in a child process"
        stream = server.client().completions.create(
            model=MODEL, prompt="Go on", stream=True, **LONG
        )
        chunks = iter(stream)
        next(chunks)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # the drain starts on the server's next loop turn
        error = assert_error(httpx.get(server.url + "/health", timeout=5), 503)
        assert error["code"] == "server_shutting_down"
        error = assert_error(
            server.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}), 503
        )
        assert "shutting down" in error["message"]
        assert httpx.get(server.url + "/metrics", timeout=5).status_code == 200
        finish = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finish[-1] == "length"  # the stream in flight ran to its end
        assert server.proc.wait(EXIT_TIMEOUT_S) is not None
        _assert_all_gone(children, timeout=5)
        assert "draining 1 request(s) in flight" in server.log.read_text()


@pytest.mark.slow
def test_sigterm_without_drain_time_ends_streams_with_an_error_event(
    tiny_checkpoint: Any, tmp_path: Path
) -> None:
    with _launch(tiny_checkpoint, tmp_path) as server:  # --shutdown-timeout 0, as vLLM's
        children = _descendants(server)
        client = server.client()
        streams = [
            iter(client.completions.create(model=MODEL, prompt=f"Go on {i}", stream=True, **LONG))
            for i in range(3)
        ]
        for stream in streams:
            next(stream)
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        for stream in streams:
            with pytest.raises(openai.APIError, match="shutting down"):
                for _ in stream:
                    pass
        assert server.proc.wait(EXIT_TIMEOUT_S) is not None
        assert time.monotonic() - start < 10
        _assert_all_gone(children, timeout=5)


@pytest.mark.slow
def test_sigkill_of_the_server_leaves_no_orphan(tiny_checkpoint: Any, tmp_path: Path) -> None:
    """Every child (the engine core and its tensor-parallel workers) watches its parent."""
    with _launch(tiny_checkpoint, tmp_path, "--tensor-parallel-size", "2") as server:
        children = _descendants(server)
        names = " ".join(" ".join(p.cmdline()) for p in children)
        assert len(children) >= 3, names  # the engine core and two workers, at least
        stream = iter(
            server.client().completions.create(model=MODEL, prompt="Go on", stream=True, **LONG)
        )
        next(stream)
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(5)
        _assert_all_gone(children, timeout=15)
