"""A real `omniserve serve` subprocess on loopback, for the end-to-end server tests.

``launch_server(model, log_dir, *flags)`` starts one, waits for /health and stops it on exit;
``Server`` drives it with the official `openai` SDK (sync and async) or raw httpx, and reads its
Prometheus metrics.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "sk-test"
MODEL = "tiny"
REPO_ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 300  # generous: CI machines may be busy


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path
    verify: ssl.SSLContext | bool = True
    """What httpx verifies TLS with (a server with --ssl-certfile: that certificate)."""

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=60, **kwargs
        )

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=60
        )

    def post(
        self,
        path: str,
        body: Any = None,
        *,
        key: str | None = API_KEY,
        content: bytes | None = None,
        timeout: float = 60,
    ) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if content is not None:
            headers["Content-Type"] = "application/json"
            return httpx.post(self.url + path, content=content, headers=headers, timeout=timeout,
                              verify=self.verify)  # fmt: skip
        return httpx.post(self.url + path, json=body, headers=headers, timeout=timeout,
                          verify=self.verify)  # fmt: skip

    def get(self, path: str, *, key: str | None = API_KEY, timeout: float = 60) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(self.url + path, headers=headers, timeout=timeout, verify=self.verify)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics, keyed by (name, labels without model_name)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {
            (
                s.name,
                tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")),
            ): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }


def metric(values: dict, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples that carry ``labels`` (so over engines, unless given)."""
    wanted = set(labels.items())
    return sum(
        value
        for (sample, sample_labels), value in values.items()
        if sample == name and wanted <= set(sample_labels)
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def assert_error(response: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI error shape with ``status``; returns its ``error`` object."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert error["code"] is None or isinstance(error["code"], str)
    return error


@contextlib.contextmanager
def launch_server(model: Path | None, log_dir: Path, *flags: str) -> Iterator[Server]:
    """`omniserve serve model --served-model-name tiny --api-key ... *flags` on a free port."""
    with launch_servers([(model, log_dir, flags)]) as (server,):
        yield server


@contextlib.contextmanager
def launch_servers(
    specs: list[tuple[Path | None, Path, tuple[str, ...]]],
) -> Iterator[list[Server]]:
    """Several servers, one per (model, log dir, flags), started and stopped side by side."""
    servers: list[Server] = []
    try:
        for model, log_dir, flags in specs:
            servers.append(_start(model, log_dir, flags))
        for server in servers:
            _wait_healthy(server)
        yield servers
    finally:
        for server in servers:
            server.proc.send_signal(signal.SIGTERM)
        for server in servers:
            try:
                server.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.proc.kill()
                server.proc.wait()


def _start(model: Path | None, log_dir: Path, flags: tuple[str, ...]) -> Server:
    """``model`` None starts ``omniserve serve`` with no model: the built-in default."""
    port = free_port()
    log = log_dir / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "omniserve.entrypoints.cli",
        "serve",
        *([str(model)] if model is not None else []),
        "--port",
        str(port),
        "--served-model-name",
        MODEL,
        "--api-key",
        API_KEY,
        "--uvicorn-log-level",
        "warning",
        *flags,
    ]
    with log.open("wb") as log_file:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log_file, stderr=subprocess.STDOUT)
    cert = flags[flags.index("--ssl-certfile") + 1] if "--ssl-certfile" in flags else None
    scheme = "https" if cert else "http"
    verify = ssl.create_default_context(cafile=cert) if cert else True
    return Server(f"{scheme}://127.0.0.1:{port}", proc, log, verify)


def _wait_healthy(server: Server) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if server.proc.poll() is not None:
            pytest.fail(f"server exited ({server.proc.returncode}):\n{server.log.read_text()}")
        try:
            health = httpx.get(server.url + "/health", timeout=2, verify=server.verify)
            if health.status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"server did not start:\n{server.log.read_text()}")
        time.sleep(0.3)


def assert_kill_fails_cleanly(server: Server, kill_pid: int, **stream_kwargs: Any) -> None:
    """Start a stream, SIGKILL ``kill_pid`` (an engine process) mid-stream: the stream errors
    within 10 s naming the engine, /health turns 503 and a new request gets a 503."""
    client = server.client()
    stream = client.completions.create(
        model=MODEL, prompt="Still talking", stream=True, **stream_kwargs
    )
    chunks = iter(stream)
    next(chunks)
    os.kill(kill_pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(openai.APIError, match="engine"):
        for _ in chunks:
            pass
    assert time.monotonic() - start < 10
    error = assert_error(httpx.get(server.url + "/health"), 503)
    assert "engine" in error["message"]
    assert assert_error(httpx.post(server.url + "/ping"), 503) == error
    with pytest.raises(openai.InternalServerError) as dead:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert dead.value.status_code == 503
