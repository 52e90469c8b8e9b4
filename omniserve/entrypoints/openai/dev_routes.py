"""vLLM's routes for developers: the torch profiler's start and stop (while
``OMNISERVE_TORCH_PROFILER_DIR`` is set) and, with ``VLLM_SERVER_DEV_MODE=1``, resetting the
prefix cache and the multimodal caches (between benchmark runs, say), sleep mode (``/sleep``,
``/wake_up``, ``/is_sleeping``: a trainer sharing the machine) and ``/collective_rpc``."""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Query
from fastapi.responses import Response

from omniserve import envs
from omniserve.engine.async_llm import AsyncLLM
from omniserve.entrypoints.openai.routing import documented
from omniserve.entrypoints.openai.serving_engine import ServingError

T = TypeVar("T")


def dev_router(engine: AsyncLLM) -> APIRouter:
    router = APIRouter()
    if envs.torch_profiler_dir():

        @router.post("/start_profile", responses=documented())
        async def start_profile() -> Response:
            return await _profile(engine.start_profile())

        @router.post("/stop_profile", responses=documented())
        async def stop_profile() -> Response:
            return await _profile(engine.stop_profile())

    if envs.server_dev_mode():

        @router.post("/reset_prefix_cache", responses=documented())
        async def reset_prefix_cache() -> Response:
            if not await engine.reset_prefix_cache():
                raise ServingError(
                    "The prefix cache can be reset only while no request holds KV blocks; "
                    "retry when the running requests have finished.",
                    HTTPStatus.CONFLICT,
                )
            return Response(status_code=200)

        @router.post("/reset_mm_cache", responses=documented())
        async def reset_mm_cache() -> Response:
            await engine.reset_mm_cache()
            return Response(status_code=200)

        @router.post("/sleep", responses=documented())
        async def sleep(level: int = 1) -> Response:
            await _client_errors(engine.sleep(level))
            return Response(status_code=200)

        @router.post("/wake_up", responses=documented())
        async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> Response:
            await _client_errors(engine.wake_up(tags))
            return Response(status_code=200)

        @router.get("/is_sleeping", responses=documented())
        async def is_sleeping() -> dict[str, bool]:
            return {"is_sleeping": await engine.is_sleeping()}

        @router.post("/collective_rpc", responses=documented())
        async def collective_rpc(request: CollectiveRPCRequest) -> dict[str, list[Any]]:
            call = engine.collective_rpc(request.method, request.timeout, tuple(request.args),
                                         request.kwargs)  # fmt: skip
            return {"results": await _client_errors(call)}

    return router


@dataclass
class CollectiveRPCRequest:
    """vLLM's ``/collective_rpc`` body: a worker method by name, its arguments (JSON)."""

    method: str
    timeout: float | None = None
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)


async def _client_errors(call: Awaitable[T]) -> T:
    """A utility's ValueError (a bad level or tag, requests still running, no such method) is
    the client's 400; a TimeoutError a 504."""
    try:
        return await call
    except ValueError as exc:
        raise ServingError(str(exc)) from exc
    except TimeoutError as exc:
        raise ServingError(str(exc), HTTPStatus.GATEWAY_TIMEOUT) from exc


async def _profile(call: Awaitable[None]) -> Response:
    """A profiler start/stop; one out of turn (a second start, a stop with none running) is 400."""
    try:
        await call
    except RuntimeError as exc:
        raise ServingError(str(exc)) from exc
    return Response(status_code=200)
