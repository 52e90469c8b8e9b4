"""vLLM's HTTP server flags on one server: HTTPS (``--ssl-keyfile`` / ``--ssl-certfile``),
``--root-path``, ``--enable-request-id-headers``, ``--enable-server-load-tracking``,
``--return-tokens-as-token-ids``, ``--enable-force-include-usage``, ``--disable-fastapi-docs``
and ``--disable-uvicorn-access-log``; and TLS settings that could not start, refused first."""

from __future__ import annotations

import datetime
import ipaddress
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server_utils import API_KEY, MODEL, Server, assert_error, launch_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}


async def probe_header(request: Any, call_next: Any) -> Any:
    """A function middleware (``--middleware tests.test_server_flags.probe_header``)."""
    response = await call_next(request)
    response.headers["x-probe"] = "function"
    return response


class ProbeMiddleware:
    """A class middleware (pure ASGI): its header on every answer."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def send_tagged(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message["headers"], (b"x-probe-class", b"1")]}
            await send(message)

        await self.app(scope, receive, send_tagged if scope["type"] == "http" else send)


def _self_signed(directory: Path, org: str = "omniserve") -> tuple[Path, Path]:
    """A key and a certificate for 127.0.0.1 (the certificate is its own authority), of
    organization ``org``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1"),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, org)])  # fmt: skip
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    key_file, cert_file = directory / "key.pem", directory / "cert.pem"
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))  # fmt: skip
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_file, cert_file


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def server(
    tiny_checkpoint: Any, tmp_path_factory: pytest.TempPathFactory, tls_files: tuple[Path, Path]
) -> Iterator[Server]:
    key, cert = tls_files
    log_config = tmp_path_factory.mktemp("logging") / "logging.json"
    log_config.write_text(json.dumps({
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"tagged": {"format": "UVI| %(levelname)s %(message)s"}},
        "handlers": {"default": {"class": "logging.StreamHandler", "formatter": "tagged",
                                 "stream": "ext://sys.stderr"}},
        "loggers": {"uvicorn": {"handlers": ["default"], "level": "INFO", "propagate": False}},
    }))  # fmt: skip
    with launch_server(
        tiny_checkpoint("Qwen3ForCausalLM"), tmp_path_factory.mktemp("flags"),
        "--max-model-len", "512", "--kv-cache-memory", "16MiB",
        "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--enable-ssl-refresh",
        "--log-config-file", str(log_config), "--h11-max-incomplete-event-size", "65536",
        "--middleware", "tests.test_server_flags.probe_header", "--log-error-stack",
        "--middleware", "tests.test_server_flags:ProbeMiddleware",
        "--root-path", "/api",
        "--enable-request-id-headers", "--enable-server-load-tracking",
        "--return-tokens-as-token-ids", "--enable-force-include-usage",
        "--disable-fastapi-docs", "--disable-uvicorn-access-log", "--uvicorn-log-level", "info",
        "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder",
    ) as running:  # fmt: skip
        yield running


def _get(server: Server, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.get(server.url + path, verify=server.verify, timeout=30, **kwargs)


def test_https_root_path_and_the_api_switches(server: Server) -> None:
    assert server.url.startswith("https://")
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "logprobs": 1, "temperature": 0}
    answer = server.post("/v1/completions", body)
    assert answer.status_code == 200, answer.text
    assert all(t.startswith("token_id:") for t in answer.json()["choices"][0]["logprobs"]["tokens"])
    # under --root-path (a proxy strips its prefix), the probes stay open, the API guarded
    assert _get(server, "/health").status_code == 200
    assert_error(server.post("/v1/completions", body, key=None), 401)
    mine = server.post("/v1/completions", body)
    assert len(mine.headers["x-request-id"]) == 32
    echoed = httpx.post(server.url + "/v1/completions", json=body, verify=server.verify,
                        headers={**AUTH, "X-Request-Id": "abc-1"}, timeout=30)  # fmt: skip
    assert echoed.headers["x-request-id"] == "abc-1"
    assert _get(server, "/load").json() == {"server_load": 0}
    streamed = server.post("/v1/completions", {**body, "stream": True}).text
    events = [json.loads(line[6:]) for line in streamed.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    assert events[-1]["usage"]["completion_tokens"] == 2  # forced: the request asked for none
    for path in ("/docs", "/openapi.json"):
        assert _get(server, path, headers=AUTH).status_code == 404
    assert "GET /health" not in server.log.read_text()  # no access log
    assert "UVI| INFO" in server.log.read_text()  # uvicorn's loggers as --log-config-file says
    # --h11-max-incomplete-event-size 65536: a 40 KB header passes (uvicorn's default: 16 KiB)
    big = _get(server, "/health", headers={"X-Big": "x" * 40_000})
    assert big.status_code == 200
    # --middleware: a function and a class, outside the API key's check (a 401 carries them)
    assert big.headers["x-probe"] == "function" and big.headers["x-probe-class"] == "1"
    refused = server.post("/v1/completions", body, key=None)
    assert refused.status_code == 401 and refused.headers["x-probe-class"] == "1"
    # --log-error-stack: a client's mistake is logged with its traceback
    assert_error(server.post("/v1/completions", {**body, "model": "nope"}), 404)
    log = server.log.read_text()
    assert (
        "Error answering POST /api/v1/completions" in log
        or "Error answering POST /v1/completions" in log
    )
    assert "Traceback" in log


def test_qwen3_coder_tool_calls(server: Server) -> None:
    """``--tool-call-parser qwen3_coder`` end to end (the random model made to write the format
    with a regex): the call's values arrive in their schema's types, streamed or whole."""
    tools = [{"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "properties": {"seats": {"type": "integer"},
                                         "city": {"type": "string"}}}}}]  # fmt: skip
    regex = (r"<tool_call>\n<function=book>\n<parameter=seats>\n(2|3)\n</parameter>\n"
             r"<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>")  # fmt: skip
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Book"}], "tools": tools,
            "temperature": 0, "max_tokens": 200,
            "structured_outputs": {"regex": regex}}  # fmt: skip
    whole = server.post("/v1/chat/completions", body).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls", whole
    (call,) = whole["message"]["tool_calls"]
    assert call["function"]["name"] == "book"
    arguments = json.loads(call["function"]["arguments"])
    assert arguments["city"] == "Oslo" and arguments["seats"] in (2, 3), whole
    streamed = server.post("/v1/chat/completions", {**body, "stream": True}).text
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in streamed.splitlines()
              if line.startswith("data: {") and json.loads(line[6:])["choices"]]  # fmt: skip
    pieces = [c["function"]["arguments"] for d in deltas for c in d.get("tool_calls") or []]
    assert json.loads("".join(pieces)) == arguments


def test_a_rotated_certificate_serves_new_connections(
    server: Server, tls_files: tuple[Path, Path], tmp_path: Path
) -> None:
    """``--enable-ssl-refresh``: new files (written one after the other, the key first) serve
    the next connections; then the old ones again."""
    import ssl
    import time

    from cryptography import x509
    from cryptography.x509.oid import NameOID

    host, port = server.url.removeprefix("https://").split(":")

    def served_org() -> str:
        pem = ssl.get_server_certificate((host, int(port)))
        name = x509.load_pem_x509_certificate(pem.encode()).subject
        return str(name.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value)

    def install(files: tuple[Path, Path], org: str) -> None:
        for source, target in zip(files, tls_files, strict=True):
            target.write_bytes(source.read_bytes())
        deadline = time.monotonic() + 15
        while served_org() != org:
            assert time.monotonic() < deadline, f"still serving {served_org()!r}"
            time.sleep(0.2)

    original = tuple(tmp_path / f"old-{p.name}" for p in tls_files)
    for source, copy in zip(tls_files, original, strict=True):
        copy.write_bytes(source.read_bytes())
    assert served_org() == "omniserve"
    install(_self_signed(tmp_path, "rotated"), "rotated")
    assert "Reloaded the TLS certificate cert.pem" in server.log.read_text()
    install(original, "omniserve")  # (the other tests trust this one)
    assert _get(server, "/health").status_code == 200


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--enable-ssl-refresh"], "--enable-ssl-refresh reloads HTTPS files"),
        (["--log-config-file", "nowhere.json"], "--log-config-file nowhere.json: no such file"),
        (["--middleware", "tests.nowhere.f"], "--middleware tests.nowhere.f: cannot import it"),
        (["--ssl-keyfile", "k.pem"], "--ssl-keyfile and --ssl-certfile go together"),
        (["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"], "--ssl-keyfile k.pem: no such"),
        (["--ssl-cert-reqs", "2"], "--ssl-cert-reqs asks for client certificates"),
    ],
)
def test_tls_settings_that_could_not_start_are_refused(flags, message, capsys) -> None:
    from omniserve.entrypoints.cli import main

    with pytest.raises(SystemExit):
        main(["serve", *flags])
    assert message in capsys.readouterr().err
