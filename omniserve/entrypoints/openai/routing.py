"""HTTP plumbing the API routes share: server-sent event responses that stop when the client
leaves, handlers cancelled on disconnect, and the OpenAPI description of what a route answers."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from omniserve.entrypoints.openai.protocol import ErrorResponse


class EventStreamResponse(StreamingResponse):
    """SSE that stops the moment the client goes away, even between tokens.

    Starlette only notices a disconnect when a write fails; here a listener races the stream,
    and the body iterator is always closed, so the generator's ``finally`` (the abort) runs now.
    """

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client vanished mid-write
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def with_cancellation(handler: Callable[..., Awaitable[Response]]) -> Callable[..., Any]:
    """Cancel the handler (and so abort its request) if the client disconnects first."""

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Response | None:
        handler_task = asyncio.ensure_future(handler(*args, **kwargs))
        disconnect_task = asyncio.ensure_future(_wait_for_disconnect(kwargs["raw_request"]))
        try:
            await asyncio.wait([handler_task, disconnect_task], return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect_task.cancel()
            if not handler_task.done():
                handler_task.cancel()  # the client left first, or the server is stopping
        return handler_task.result() if handler_task.done() else None  # None: nobody listens

    return wrapper


def documented(body: type | None = None, chunk: type | None = None) -> dict[int | str, Any]:
    """The OpenAPI responses a route really gives: its body (JSON, or with ``stream`` an SSE
    stream of ``chunk`` events), and the error statuses, all in OpenAI's error shape."""
    responses: dict[int | str, Any] = {
        int(status): {"model": ErrorResponse, "description": status.phrase}
        for status in (
            HTTPStatus.BAD_REQUEST,
            HTTPStatus.UNAUTHORIZED,
            HTTPStatus.NOT_FOUND,
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            HTTPStatus.INTERNAL_SERVER_ERROR,
            HTTPStatus.SERVICE_UNAVAILABLE,
        )
    }
    if body is not None:
        content: dict[str, Any] = {"application/json": {}}
        if chunk is not None:  # the schema of one event, as OpenAPI 3.1 tools read SSE
            content["text/event-stream"] = {
                "schema": {
                    "type": "object",
                    "required": ["data"],
                    "properties": {
                        "event": {"type": "string"},
                        "data": {
                            "anyOf": [
                                {"const": "[DONE]"},
                                {
                                    "type": "string",
                                    "contentMediaType": "application/json",
                                    "contentSchema": {
                                        "$ref": f"#/components/schemas/{chunk.__name__}"
                                    },
                                },
                                {
                                    "type": "string",
                                    "contentMediaType": "application/json",
                                    "contentSchema": {"$ref": "#/components/schemas/ErrorResponse"},
                                },
                            ]
                        },
                    },
                    "description": f"data: <{chunk.__name__}> events (an error event if the "
                    "request fails midway), then data: [DONE]",
                }
            }
        responses[200] = {"model": body, "content": content}
    return responses
