"""The OpenAI server's ASGI middlewares: API-key auth, request draining at shutdown, the
request-body size limit and SageMaker's ``/invocations``; plain ASGI (not BaseHTTPMiddleware),
so each runs before the body is read and leaves ``receive`` to the disconnect listeners. Their
refusals use OpenAI's error shape, as do the exception handlers (``add_error_handlers``) for
everything the routes raise."""

from __future__ import annotations

import importlib
import json
import logging
import math
import secrets
import uuid
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from omniserve.engine.exceptions import (
    EngineDeadError,
    EngineGenerateError,
    EngineSleepingError,
    EngineStoppingError,
)
from omniserve.entrypoints.openai.score_protocol import FIRST_NAMES
from omniserve.entrypoints.openai.serving_engine import ServingError, to_serving_error
from omniserve.tracing import TRACE_HEADERS, trace_headers

logger = logging.getLogger(__name__)


def route_path(scope: Scope) -> str:
    """The path the routes see: uvicorn's path less ``--root-path`` (a proxy's prefix)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def error_json(error: ServingError) -> JSONResponse:
    return JSONResponse(error.to_response().model_dump(), status_code=error.status)


def add_error_handlers(app: FastAPI, log_stack: bool = False) -> None:
    """Every error a route raises leaves as one OpenAI-shaped body. The errors
    ``to_serving_error`` knows (client mistakes, a dead or stopping engine) are answered by
    handlers of their own classes; only the handler of ``Exception`` is Starlette's last resort,
    which logs the traceback of what it answers, so only our own bugs reach it. ``log_stack``
    (vLLM's ``--log-error-stack``): the others' tracebacks are logged too."""

    def answer(request: Request, exc: Exception) -> JSONResponse:
        if log_stack:
            logger.error("Error answering %s %s", request.method, request.url.path, exc_info=exc)
        return error_json(to_serving_error(exc))  # (logs anything not a client mistake)

    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    for known in (ServingError, ValueError, TypeError, EngineDeadError, EngineStoppingError,
                  EngineGenerateError, EngineSleepingError):  # fmt: skip
        app.add_exception_handler(known, answer)
    app.add_exception_handler(Exception, answer)


_UNION_BRANCHES = frozenset(("str", "int", "float", "bool", "dict", "list", "none"))
"""pydantic names the branch of a union in an error's location ("prompt.str"); the others
("list[int]", "function-after[...]") are not identifiers."""


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """pydantic's errors as one 400: "field: problem; ...", ``param`` = the first bad field."""
    problems, fields = [], []
    content_type = request.headers.get("content-type", "")
    for error in exc.errors():
        if error.get("type") == "json_invalid":
            return error_json(
                ServingError(
                    f"Malformed JSON body: {error.get('ctx', {}).get('error', 'cannot parse')}."
                )
            )
        if tuple(error.get("loc", ())) == ("body",) and error.get("type") == "missing":
            return error_json(ServingError("The request body is empty: send a JSON object."))
        if tuple(error.get("loc", ())) == ("body",) and "json" not in content_type:
            # FastAPI reads a body as JSON only when its Content-Type says so
            return error_json(
                ServingError(
                    "The body must be a JSON object sent with Content-Type: application/json "
                    f"(got {content_type or 'no Content-Type'})."
                )
            )
        field = ""
        for part in error.get("loc", ()):
            if isinstance(part, int):
                field += f"[{part}]"
            elif part != "body" and str(part).isidentifier() and part not in _UNION_BRANCHES:
                field += f".{part}" if field else str(part)
        message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        problems.append(f"{field}: {message}" if field else message)
        fields.append(field)
    return error_json(
        ServingError(  # a union's branches may each report the same problem
            "; ".join(dict.fromkeys(problems)) or "Invalid request.",
            param=next((f for f in fields if f), None),
        )
    )


def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    status = HTTPStatus(exc.status_code)
    cause = exc.__cause__
    if status == HTTPStatus.BAD_REQUEST and cause is not None:  # FastAPI's body decoding
        # (invalid UTF-8, nesting deeper than Python's parser goes, an integer over its digits,
        # a broken multipart form)
        return error_json(ServingError(f"Malformed body: {type(cause).__name__}: {cause}"))
    return error_json(ServingError(str(exc.detail), status))


class APIKeyMiddleware:
    """Bearer-token auth on every route but the probes, the metrics, the API's description and
    the playground's page (whose calls carry the key); a route added later is guarded too."""

    OPEN_PATHS = frozenset(("/health", "/ping", "/version", "/metrics", "/load", "/", "/docs",
                            "/redoc", "/openapi.json", "/docs/oauth2-redirect"))  # fmt: skip
    OPEN_PREFIXES = ("/playground/",)

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = route_path(scope)
        guarded = path not in self.OPEN_PATHS and not path.startswith(self.OPEN_PREFIXES)
        if scope["type"] == "http" and guarded:
            headers = dict(scope["headers"])
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(
                token.strip(), self.api_key
            ):
                error = ServingError(
                    "Invalid or missing API key.", HTTPStatus.UNAUTHORIZED, code="invalid_api_key"
                )
                await error_json(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Lifecycle:
    """What the drain needs to know: whether it has begun, and how many requests are in flight."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0


class DrainMiddleware:
    """Counts the requests in flight; once draining, answers every new one (and /health, so load
    balancers stop routing here) with a 503. /metrics and /version stay open to watch the drain.
    """

    OPEN_PATHS = ("/metrics", "/version")

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.lifecycle.draining and route_path(scope) not in self.OPEN_PATHS:
            error = ServingError(
                "The server is shutting down; send the request to another replica.",
                HTTPStatus.SERVICE_UNAVAILABLE,
                code="server_shutting_down",
            )
            await error_json(error)(scope, receive, send)
            return
        self.lifecycle.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.in_flight -= 1


class BodySizeLimitMiddleware:
    """Refuse request bodies over ``max_bytes`` with a 413, from Content-Length when declared,
    else as the body streams in, before anything parses it.

    The body is read here and replayed to the app; later ``receive`` calls go to the server, so
    disconnect listeners still see the client leave.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await error_json(self._too_large())(scope, receive, send)
            return
        try:
            body = await read_body(receive, self.max_bytes)
        except BodyTooLarge:
            await error_json(self._too_large())(scope, receive, send)
            return
        if body is not None:  # (None: the client left; nobody to answer)
            await self.app(scope, replaying(body, receive), send)

    def _too_large(self) -> ServingError:
        return ServingError(
            f"The request body is larger than this server accepts ({self.max_bytes} bytes; "
            "--max-request-body-mb).",
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            code="request_too_large",
        )


class BodyTooLarge(Exception):
    pass


class HeaderCountMiddleware:
    """vLLM's ``--h11-max-header-count``: a request with more header fields than this is
    answered 431 before any route sees it (a flood of headers costs every layer that walks
    them)."""

    def __init__(self, app: ASGIApp, max_headers: int) -> None:
        self.app = app
        self.max_headers = max_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        count = len(scope.get("headers", ())) if scope["type"] == "http" else 0
        if count <= self.max_headers:
            await self.app(scope, receive, send)
            return
        error = ServingError(
            f"The request has {count} header fields; this server takes at most "
            f"{self.max_headers} (--h11-max-header-count).",
            HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
            code="too_many_headers",
        )
        await error_json(error)(scope, receive, send)


async def read_body(receive: Receive, max_bytes: float = math.inf) -> bytes | None:
    """A request's whole body, or None if the client leaves first; ``BodyTooLarge`` as soon as
    it passes ``max_bytes``."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > max_bytes:
            raise BodyTooLarge
        if not message.get("more_body", False):
            return b"".join(chunks)


def replaying(body: bytes, receive: Receive) -> Receive:
    """``receive`` that hands the app the body already read, then defers to the server (so
    disconnect listeners still see the client leave)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Any:
        return pending.pop() if pending else await receive()

    return replay


class InvocationsMiddleware:
    """SageMaker's ``POST /invocations``, as vLLM answers it: the body goes to the route its
    fields name (``invocation_path``), as if sent there."""

    def __init__(self, app: ASGIApp, generates: bool, classifies: bool) -> None:
        self.app = app
        self.generates = generates
        self.classifies = classifies

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        invoked = scope["type"] == "http" and scope["method"] == "POST"
        if not invoked or route_path(scope) != "/invocations":
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        if body is None:
            return  # the client left
        try:
            path = invocation_path(json.loads(body), self.generates, self.classifies)
        except (ValueError, RecursionError, ServingError) as exc:  # (RecursionError: nesting)
            error = exc if isinstance(exc, ServingError) else ServingError(
                f"POST /invocations takes a JSON object: {exc}.")  # fmt: skip
            await error_json(error)(scope, receive, send)
            return
        path = scope.get("root_path", "") + path
        scope = {**scope, "path": path, "raw_path": path.encode()}
        await self.app(scope, replaying(body, receive), send)


def invocation_path(body: object, generates: bool, classifies: bool) -> str:
    """The route of an ``/invocations`` body, by its fields in vLLM's order of request types:
    ``messages`` a chat (embeddings or classification on a model that does not generate),
    ``prompt`` a completion, ``query`` with ``documents`` a rerank, ``queries`` / ``text_1`` /
    ``data_1`` a score, ``input`` embeddings (a sequence classifier's: classification)."""
    if not isinstance(body, dict):
        raise ServingError("POST /invocations takes a JSON object.")
    pools = "/classify" if classifies else "/v1/embeddings"
    if "messages" in body:
        return "/v1/chat/completions" if generates else pools
    if "prompt" in body and generates:
        return "/v1/completions"
    if "query" in body and "documents" in body:
        return "/rerank"
    if any(name in body for name in FIRST_NAMES):
        return "/score"
    if "input" in body:
        return pools
    raise ServingError(
        "POST /invocations routes a request by its fields, and this one has none of them: "
        "messages (chat), prompt (completions), input (embeddings or classification), query "
        f"and documents (rerank), or {', '.join(FIRST_NAMES)} (score)."
        + ("" if generates else " This model does not generate text (prompt is not taken).")
    )


def user_middleware(path: str) -> Any:
    """The class or function ``--middleware module.NAME`` names; ValueError naming the path
    when it does not import or is neither."""
    module, sep, name = path.partition(":")
    if not sep:
        module, _, name = path.rpartition(".")
    try:
        target = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"--middleware {path}: cannot import it ({exc}).") from None
    if not callable(target):
        raise ValueError(f"--middleware {path} is neither a class nor a function.")
    return target


def add_user_middleware(app: FastAPI, path: str) -> None:
    """vLLM's ``--middleware module.NAME``: a class as ``app.add_middleware(cls)``, a function
    as ``@app.middleware("http")``."""
    target = user_middleware(path)
    if isinstance(target, type):
        app.add_middleware(target)  # type: ignore[arg-type]  # (any ASGI middleware class)
    else:
        app.middleware("http")(target)


class TraceContextMiddleware:
    """``--otlp-traces-endpoint``: an HTTP request's W3C trace context headers (``traceparent``,
    ``tracestate``) in ``TRACE_HEADERS`` while it is served, so its spans join that trace."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = scope.get("headers", ())  # (none in a lifespan scope)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw}
        token = TRACE_HEADERS.set(trace_headers(headers))
        try:
            await self.app(scope, receive, send)
        finally:
            TRACE_HEADERS.reset(token)


class RequestIdMiddleware:
    """vLLM's --enable-request-id-headers: every answer carries ``X-Request-Id``, the request's
    own header when it sent one, else a new id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = dict(scope["headers"]).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
