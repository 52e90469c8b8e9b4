"""``serve``'s HTTP server flags, vLLM's names throughout: where it listens, TLS, auth, CORS,
request limits, uvicorn's logging and the API's own switches; ``check_server_args`` refuses
what could not start before any weights load, and ``uvicorn_options`` hands uvicorn its part."""

from __future__ import annotations

import argparse
import ssl
from pathlib import Path
from typing import Any

from omniserve.engine.arg_checks import json_str_list, number_in


def add_server_args(server: argparse._ArgumentGroup) -> None:
    add = server.add_argument
    add("--host", default="127.0.0.1", help="Address to bind (0.0.0.0 for every interface).")
    add("--port", type=number_in(int, 0, 65535), default=8000, help="TCP port to listen on.")
    add(
        "--api-key",
        default=None,
        help="Require 'Authorization: Bearer KEY' on every route but the probes and metrics.",
    )
    add(
        "--no-playground",
        action="store_true",
        help="Do not serve the web playground (a chat page at /).",
    )
    add(
        "--max-request-body-mb",
        type=number_in(float, 1e-3),
        default=100.0,
        help="Largest request body accepted (413 above it), media included.",
    )
    add(
        "--shutdown-timeout",
        type=number_in(float, 0),
        default=0.0,
        help="On SIGTERM/SIGINT, seconds the requests in flight get to finish (new ones get 503 "
        "meanwhile); those left then end with an error. 0: end them at once.",
    )
    for what in ("origins", "methods", "headers"):
        add(
            f"--allowed-{what}",
            type=json_str_list,
            default=["*"],
            help=f"CORS: allowed {what}, as a JSON list.",
        )
    add("--allow-credentials", action="store_true", help="CORS: allow credentials.")
    add(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level (info logs every request).",
    )
    add(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="Do not log a line per request (uvicorn's access log).",
    )
    add(
        "--root-path",
        default=None,
        help="The path prefix a proxy serves this API under (FastAPI's root_path).",
    )
    add("--ssl-keyfile", default=None, help="Serve HTTPS: the TLS private key file.")
    add("--ssl-certfile", default=None, help="Serve HTTPS: the TLS certificate file.")
    add("--ssl-ca-certs", default=None, help="CA certificates to verify client certificates.")
    add(
        "--ssl-cert-reqs",
        type=int,
        default=int(ssl.CERT_NONE),
        choices=[int(ssl.CERT_NONE), int(ssl.CERT_OPTIONAL), int(ssl.CERT_REQUIRED)],
        help="Client certificates: 0 not asked, 1 optional, 2 required (Python's ssl module).",
    )
    add(
        "--middleware",
        action="append",
        default=[],
        metavar="MODULE.NAME",
        help="An ASGI middleware to add (repeatable, vLLM's): a class goes through "
        "app.add_middleware, a function through @app.middleware('http'); they run before "
        "the server's own (API key, CORS, ...).",
    )
    add(
        "--log-error-stack",
        action="store_true",
        help="Log the traceback of every error response, clients' mistakes too (ours are "
        "logged always).",
    )
    add(
        "--log-config-file",
        default=None,
        metavar="FILE",
        help="A logging configuration (JSON or YAML dictConfig, or an ini file) for uvicorn's and "
        "omniserve's loggers, applied at start-up.",
    )
    add(
        "--h11-max-incomplete-event-size",
        type=int,
        default=None,
        help="The largest HTTP request head (bytes) h11 buffers before refusing it "
        "(uvicorn's default: 16 KiB).",
    )
    add(
        "--h11-max-header-count",
        type=number_in(int, 1),
        default=256,
        help="The most header fields a request may carry; more get a 431 (vLLM's default 256).",
    )
    add(
        "--enable-ssl-refresh",
        action="store_true",
        help="Reload the TLS key, certificate and CA files when they change (a rotated "
        "certificate serves new connections without a restart).",
    )
    add(
        "--disable-fastapi-docs",
        action="store_true",
        help="Serve no /docs, /redoc or /openapi.json.",
    )
    add(
        "--enable-request-id-headers",
        action="store_true",
        help="Answer with an X-Request-Id header (the request's own, else a new one).",
    )
    add(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="Serve GET /get_tokenizer_info: the tokenizer's class, settings and chat template.",
    )
    add(
        "--enable-server-load-tracking",
        action="store_true",
        help="Serve GET /load: the requests in flight, for load balancers.",
    )
    add(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="Logprobs name tokens 'token_id:<id>' unless a request asks otherwise.",
    )
    add(
        "--enable-force-include-usage",
        action="store_true",
        help="Every streamed answer ends with its usage (as with stream_options.include_usage).",
    )


def check_server_args(args: argparse.Namespace) -> None:
    """ValueError for TLS settings uvicorn could not start with."""
    key, cert = getattr(args, "ssl_keyfile", None), getattr(args, "ssl_certfile", None)
    if (key is None) != (cert is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together (HTTPS needs both).")
    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "log_config_file"):
        path = getattr(args, flag, None)
        if path is not None and not Path(path).is_file():
            raise ValueError(f"--{flag.replace('_', '-')} {path}: no such file.")
    if getattr(args, "ssl_cert_reqs", 0) and getattr(args, "ssl_ca_certs", None) is None:
        raise ValueError("--ssl-cert-reqs asks for client certificates: give --ssl-ca-certs.")
    if getattr(args, "middleware", None):
        from omniserve.entrypoints.openai.middleware import user_middleware

        for path in args.middleware:
            user_middleware(path)
    if getattr(args, "enable_ssl_refresh", False) and cert is None:
        raise ValueError("--enable-ssl-refresh reloads HTTPS files: give --ssl-keyfile and "
                         "--ssl-certfile.")  # fmt: skip


def uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "host": args.host,
        "port": args.port,
        "log_level": args.uvicorn_log_level,
        "access_log": not getattr(args, "disable_uvicorn_access_log", False),
        "root_path": getattr(args, "root_path", None) or "",
        "ssl_keyfile": getattr(args, "ssl_keyfile", None),
        "ssl_certfile": getattr(args, "ssl_certfile", None),
        "ssl_ca_certs": getattr(args, "ssl_ca_certs", None),
        "ssl_cert_reqs": getattr(args, "ssl_cert_reqs", int(ssl.CERT_NONE)),
        **({"log_config": args.log_config_file} if getattr(args, "log_config_file", None) else {}),
        "h11_max_incomplete_event_size": getattr(args, "h11_max_incomplete_event_size", None),
    }
