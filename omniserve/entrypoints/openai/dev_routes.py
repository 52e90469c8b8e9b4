"""vLLM's routes for developers: the torch profiler's start and stop (while
``OMNISERVE_TORCH_PROFILER_DIR`` is set) and, with ``VLLM_SERVER_DEV_MODE=1``, resetting the
prefix cache and the multimodal caches (between benchmark runs, say)."""

from __future__ import annotations

from collections.abc import Awaitable
from http import HTTPStatus

from fastapi import APIRouter
from fastapi.responses import Response

from omniserve import envs
from omniserve.engine.async_llm import AsyncLLM
from omniserve.entrypoints.openai.routing import documented
from omniserve.entrypoints.openai.serving_engine import ServingError


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

    return router


async def _profile(call: Awaitable[None]) -> Response:
    """A profiler start/stop; one out of turn (a second start, a stop with none running) is 400."""
    try:
        await call
    except RuntimeError as exc:
        raise ServingError(str(exc)) from exc
    return Response(status_code=200)
