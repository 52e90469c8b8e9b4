"""The OpenAI-compatible HTTP server: ``build_app(engine, args)`` and ``run_server(args)``.

Every error leaves in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``; request
validation failures are 400s (FastAPI's default would be 422). A client that disconnects aborts its
request: non-streaming handlers race a disconnect listener (``with_cancellation``), and streams stop
through ``EventStreamResponse``. Both end up closing ``AsyncLLM.generate``, which aborts.

SIGTERM/SIGINT drain first (``DrainingServer``): new requests and /health get 503 at once, the
requests in flight get up to ``--shutdown-timeout`` seconds to finish, then those left end with an
error (a final error event in a stream), and only then does uvicorn close and the engine stop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator
from http import HTTPStatus
from pathlib import Path
from types import FrameType
from typing import Annotated, Any, Literal

import uvicorn
from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse, Response

from omniserve import __version__, envs
from omniserve.config import is_classifier
from omniserve.engine.arg_utils import EngineArgs
from omniserve.engine.async_llm import AsyncLLM
from omniserve.engine.exceptions import EngineStoppingError
from omniserve.entrypoints.logger import RequestLogger
from omniserve.entrypoints.openai.audio_encoding import MEDIA_TYPES
from omniserve.entrypoints.openai.chat_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
)
from omniserve.entrypoints.openai.completion_protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from omniserve.entrypoints.openai.dev_routes import dev_router
from omniserve.entrypoints.openai.middleware import (
    APIKeyMiddleware,
    BodySizeLimitMiddleware,
    DrainMiddleware,
    HeaderCountMiddleware,
    InvocationsMiddleware,
    Lifecycle,
    RequestIdMiddleware,
    TraceContextMiddleware,
    add_error_handlers,
    add_user_middleware,
    error_json,
)
from omniserve.entrypoints.openai.playground import playground_router
from omniserve.entrypoints.openai.pooling_routes import pooling_router
from omniserve.entrypoints.openai.protocol import (
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from omniserve.entrypoints.openai.reasoning import REASONING_PARSERS
from omniserve.entrypoints.openai.responses_protocol import (
    DeletedResponse,
    InputItemList,
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
)
from omniserve.entrypoints.openai.routing import (
    EventStreamResponse,
    documented,
    with_cancellation,
)
from omniserve.entrypoints.openai.server_args import uvicorn_options
from omniserve.entrypoints.openai.serving_chat import OpenAIServingChat
from omniserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from omniserve.entrypoints.openai.serving_engine import (
    ServingError,
    to_serving_error,
)
from omniserve.entrypoints.openai.serving_models import OpenAIServingModels
from omniserve.entrypoints.openai.serving_responses import OpenAIServingResponses
from omniserve.entrypoints.openai.serving_score import OpenAIServingScores
from omniserve.entrypoints.openai.serving_speech import OpenAIServingSpeech
from omniserve.entrypoints.openai.serving_transcription import OpenAIServingTranscription, Task
from omniserve.entrypoints.openai.speech_protocol import CreateSpeechRequest, VoiceList
from omniserve.entrypoints.openai.ssl_refresh import CertificateRefresher
from omniserve.entrypoints.openai.tokenize_routes import tokenize_router
from omniserve.entrypoints.openai.transcription_protocol import TranscriptionResponse, form_schema
from omniserve.lora.request import parse_lora_modules
from omniserve.metrics import LoggingStatLogger, PrometheusStatLogger

logger = logging.getLogger(__name__)

STATS_TIMEOUT_S = 2.0
"""How long /metrics waits for fresh scheduler stats before serving the last ones."""
FLUSH_TIMEOUT_S = 2.0
"""After a drain runs out of time: how long the ended requests get to send their error."""
CLOSE_TIMEOUT_S = 5
"""uvicorn's own graceful-shutdown bound, a backstop once the drain is over."""


class DrainingServer(uvicorn.Server):
    """uvicorn whose first SIGTERM/SIGINT drains before it stops (see the module docstring);
    a second signal stops at once."""

    def __init__(
        self,
        config: uvicorn.Config,
        engine: AsyncLLM,
        lifecycle: Lifecycle,
        shutdown_timeout: float,
        refresh_ssl: bool = False,
    ) -> None:
        super().__init__(config)
        self.engine = engine
        self.lifecycle = lifecycle
        self.shutdown_timeout = shutdown_timeout
        self.refresh_ssl = refresh_ssl
        self._refresh_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None  # held: the loop keeps tasks weakly

    async def serve(self, sockets: list[Any] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list[Any] | None = None) -> None:
        await super().startup(sockets)
        config = self.config
        if self.refresh_ssl and config.ssl is not None:  # (--enable-ssl-refresh)
            assert config.ssl_keyfile is not None and config.ssl_certfile is not None
            refresher = CertificateRefresher(config.ssl, config.ssl_keyfile,
                                             config.ssl_certfile, config.ssl_ca_certs)  # fmt: skip
            self._refresh_task = asyncio.ensure_future(refresher.run())

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        if self._refresh_task is not None:
            self._refresh_task.cancel()
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.lifecycle.draining or self._loop is None:
            if self.lifecycle.draining:
                logger.warning("Second signal: stopping now, without waiting for requests.")
                self.force_exit = True
            super().handle_exit(sig, frame)
            return
        self.lifecycle.draining = True  # from here on, new requests get 503
        self._loop.call_soon_threadsafe(self._start_drain, sig)

    def _start_drain(self, sig: int) -> None:
        self._drain_task = asyncio.ensure_future(self._drain(sig))

    async def _drain(self, sig: int) -> None:
        loop = asyncio.get_running_loop()
        if self.lifecycle.in_flight:
            logger.info(
                "%s: draining %d request(s) in flight for up to %g s "
                "(--shutdown-timeout); signal again to stop now.",
                signal.Signals(sig).name,
                self.lifecycle.in_flight,
                self.shutdown_timeout,
            )
        await self._wait_for_requests(loop.time() + self.shutdown_timeout)
        if self.lifecycle.in_flight:
            logger.warning(
                "Ending %d request(s) still in flight with an error: the server is stopping.",
                self.lifecycle.in_flight,
            )
            await self.engine.stop_requests(
                EngineStoppingError(
                    "The server is shutting down and stopped this request before it finished."
                )
            )
            await self._wait_for_requests(loop.time() + FLUSH_TIMEOUT_S)
        super().handle_exit(sig, None)  # uvicorn's shutdown; its lifespan stops the engine

    async def _wait_for_requests(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while self.lifecycle.in_flight and loop.time() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file path, or the Jinja template itself."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template.")


def build_app(engine: AsyncLLM, args: argparse.Namespace) -> FastAPI:
    """The FastAPI app over a running engine; ``args`` are the ``serve`` flags.

    The app owns the engine from here on: the server's shutdown stops it.
    """
    names = list(getattr(args, "served_model_name", None) or [engine.model_config.name])
    chat_template = load_chat_template(getattr(args, "chat_template", None))
    parser_name = engine.config.structured_outputs_config.reasoning_parser
    auto_tools = getattr(args, "enable_auto_tool_choice", False)
    trust = getattr(args, "trust_request_chat_template", False)
    models = OpenAIServingModels(engine, names)
    request_logger = (
        RequestLogger(
            getattr(args, "max_log_len", None), getattr(args, "enable_log_outputs", False)
        )
        if getattr(args, "enable_log_requests", False)
        else None
    )
    shared: dict[str, Any] = {
        "request_logger": request_logger,
        "chat_template_content_format": getattr(args, "chat_template_content_format", "auto"),
        "return_tokens_as_token_ids": getattr(args, "return_tokens_as_token_ids", False),
        "force_include_usage": getattr(args, "enable_force_include_usage", False),
    }
    chat = OpenAIServingChat(
        engine,
        models,
        chat_template,
        trust_request_chat_template=trust,
        **shared,
        reasoning_parser=REASONING_PARSERS[parser_name] if parser_name else None,
        tool_call_parser=getattr(args, "tool_call_parser", None) if auto_tools else None,
        exclude_tools_when_tool_choice_none=getattr(
            args, "exclude_tools_when_tool_choice_none", False
        ),
    )
    completion = OpenAIServingCompletion(
        engine, models, chat_template, trust_request_chat_template=trust, **shared
    )
    pooling = OpenAIServingScores(
        engine, models, chat_template, trust_request_chat_template=trust, **shared
    )
    speech = OpenAIServingSpeech(engine, models, chat_template, **shared)
    if chat.default_sampling:
        logger.info(
            "Default sampling parameters from the checkpoint's generation config, for "
            "fields a request omits: %s (--generation-config vllm turns them off).",
            chat.default_sampling,
        )
    stat_logger = next(
        (s for s in engine.stat_loggers if isinstance(s, PrometheusStatLogger)), None
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        # Here, not after uvicorn returns: uvicorn re-raises SIGTERM on exit, which would kill
        # the process before any later cleanup ran.
        engine.shutdown()

    docs = not getattr(args, "disable_fastapi_docs", False)
    app = FastAPI(title="omniserve", version=__version__, lifespan=lifespan,
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None)  # fmt: skip
    app.state.models = models
    add_error_handlers(app, getattr(args, "log_error_stack", False))

    health_responses: dict[int | str, dict[str, Any]] = {
        200: {"description": "The engine is alive (empty body)", "content": None},
        503: {
            "model": ErrorResponse,
            "description": "The engine is dead or the server is shutting down",
        },
    }

    # /ping: vLLM's alias, which SageMaker probes (POST too); HEAD: load balancers probe with it.
    @app.api_route("/ping", methods=["GET", "POST", "HEAD"], response_class=Response,
                   responses=health_responses)  # fmt: skip
    @app.api_route("/health", methods=["GET", "HEAD"], response_class=Response,
                   responses=health_responses)  # fmt: skip
    async def health() -> Response:
        try:
            await engine.check_health()
        except Exception as exc:
            return error_json(to_serving_error(exc))
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    if getattr(args, "enable_server_load_tracking", False):

        @app.get("/load")
        async def load() -> dict[str, int]:
            """vLLM's: the requests in flight, this one aside."""
            return {"server_load": app.state.lifecycle.in_flight - 1}

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={
            200: {"description": "Prometheus text exposition format"},
            404: {"model": ErrorResponse, "description": "Metrics are not enabled"},
        },
    )
    async def metrics() -> Response:
        if stat_logger is None:
            raise ServingError("Metrics are not enabled.", HTTPStatus.NOT_FOUND)
        if not engine.errored:
            with contextlib.suppress(Exception):  # a dead or busy engine keeps the last stats
                engine_stats = await asyncio.wait_for(engine.get_engine_stats(), STATS_TIMEOUT_S)
                for rank, stats in enumerate(engine_stats):
                    stat_logger.record_scheduler_stats(stats, rank)
        body, content_type = stat_logger.render()
        return Response(body, media_type=content_type)

    responses = OpenAIServingResponses(chat, int(envs.responses_store_mb() * 2**20))
    transcription = OpenAIServingTranscription(chat)
    app.include_router(
        _api_router(engine, chat, completion, speech, responses, transcription, models)
    )
    app.include_router(pooling_router(pooling))
    app.include_router(
        tokenize_router(completion, getattr(args, "enable_tokenizer_info_endpoint", False))
    )
    app.include_router(dev_router(engine))
    if not getattr(args, "no_playground", False):
        app.include_router(
            playground_router(_playground_info(engine, names), getattr(args, "api_key", None))
        )
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        """FastAPI's schema without the 422s it documents by default: validation errors are
        400s here (``middleware.add_error_handlers``), as in OpenAI's API."""
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = default_openapi()  # FastAPI keeps it as app.openapi_schema
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    config = engine.model_config
    if getattr(args, "enable_request_id_headers", False):
        app.add_middleware(RequestIdMiddleware)
    if engine.config.observability_config.otlp_traces_endpoint:
        app.add_middleware(TraceContextMiddleware)
    app.add_middleware(InvocationsMiddleware, generates=config.runner == "generate",
                       classifies=is_classifier(config.architecture))  # fmt: skip
    max_body_mb = getattr(args, "max_request_body_mb", None)
    if max_body_mb is not None:
        app.add_middleware(BodySizeLimitMiddleware, max_bytes=int(max_body_mb * 2**20))
    if getattr(args, "api_key", None):  # before any body is read
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key)
    if (max_headers := getattr(args, "h11_max_header_count", None)) is not None:
        app.add_middleware(HeaderCountMiddleware, max_headers=max_headers)  # (outermost)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=getattr(args, "allowed_origins", ["*"]),
        allow_methods=getattr(args, "allowed_methods", ["*"]),
        allow_headers=getattr(args, "allowed_headers", ["*"]),
        allow_credentials=getattr(args, "allow_credentials", False),
    )
    for path in getattr(args, "middleware", None) or []:
        add_user_middleware(app, path)
    app.state.lifecycle = Lifecycle()
    app.add_middleware(DrainMiddleware, lifecycle=app.state.lifecycle)  # outermost: counts all
    return app


def _playground_info(engine: AsyncLLM, names: list[str]) -> dict[str, Any]:
    """The served model as the playground shows it: its name and limits, the media it takes
    (modality -> items per prompt, None: no limit) and its voices."""
    mm_processor = engine.processor.mm_processor
    speech = engine.model_config.speech
    return {
        "model": names[0],
        "max_model_len": engine.model_config.max_model_len,
        "media": mm_processor.info.get_allowed_mm_limits() if mm_processor is not None else {},
        "voices": list(speech.voices) if speech is not None else [],
        "default_voice": speech.default_voice if speech is not None else None,
    }


def _api_router(
    engine: AsyncLLM,
    chat: OpenAIServingChat,
    completion: OpenAIServingCompletion,
    speech: OpenAIServingSpeech,
    responses: OpenAIServingResponses,
    transcription: OpenAIServingTranscription,
    models: OpenAIServingModels,
) -> APIRouter:
    router = APIRouter()
    max_model_len = engine.model_config.max_model_len

    def respond(result: Any) -> Response:
        if isinstance(result, AsyncIterator):
            return EventStreamResponse(result)
        return Response(result.model_dump_json(), media_type="application/json")

    @router.get(
        "/v1/models", responses={401: {"model": ErrorResponse, "description": "Unauthorized"}}
    )
    async def show_models() -> ModelList:
        return ModelList(data=models.cards(max_model_len, completion.default_sampling))

    @router.get("/v1/models/{model:path}", responses=documented(ModelCard))
    async def show_model(model: str) -> ModelCard:  # names may hold slashes ("Qwen/...")
        return models.card(model, max_model_len, completion.default_sampling)

    if envs.allow_runtime_lora_updating():  # vLLM's routes, behind vLLM's switch

        @router.post("/v1/load_lora_adapter", responses=documented())
        async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> PlainTextResponse:
            await models.load(request.lora_name, request.lora_path)
            return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added.")

        @router.post("/v1/unload_lora_adapter", responses=documented())
        async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> PlainTextResponse:
            await models.unload(request.lora_name)
            return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed.")

    @router.post(
        "/v1/chat/completions",
        responses=documented(ChatCompletionResponse, ChatCompletionStreamResponse),
    )
    @with_cancellation
    async def create_chat_completion(
        request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        return respond(await chat.create_chat_completion(request))

    @router.post(
        "/v1/completions", responses=documented(CompletionResponse, CompletionStreamResponse)
    )
    @with_cancellation
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return respond(await completion.create_completion(request))

    @router.post(
        "/v1/audio/speech",
        response_class=Response,
        responses={
            **documented(),
            200: {
                "description": "The audio file (or SSE events with stream_format sse)",
                "content": {media: {} for media in {*MEDIA_TYPES.values(), "text/event-stream"}},
            },
        },
    )
    @with_cancellation
    async def create_speech(request: CreateSpeechRequest, raw_request: Request) -> Response:
        body, kind = await speech.create_speech(request)
        media = "text/event-stream" if kind == "sse" else MEDIA_TYPES[request.encoding]
        return EventStreamResponse(body, media_type=media)

    async def speech_to_text(raw_request: Request, task: Task) -> Response:
        async with raw_request.form(max_files=1, max_fields=64) as form:
            result = await transcription.create(form, task)
        if isinstance(result, str):
            return PlainTextResponse(result)
        return respond(result)

    transcript = {
        **documented(),
        200: {
            "model": TranscriptionResponse,
            "description": "The transcript: JSON, plain text, or with stream SSE events",
            "content": {"application/json": {}, "text/plain": {}, "text/event-stream": {}},
        },
    }

    @router.post("/v1/audio/transcriptions", responses=transcript, response_class=Response,
                 openapi_extra=form_schema())  # fmt: skip
    @with_cancellation
    async def create_transcription(raw_request: Request) -> Response:
        return await speech_to_text(raw_request, "transcribe")

    @router.post("/v1/audio/translations", responses=transcript, response_class=Response,
                 openapi_extra=form_schema())  # fmt: skip
    @with_cancellation
    async def create_translation(raw_request: Request) -> Response:
        return await speech_to_text(raw_request, "translate")

    @router.get("/v1/audio/voices", responses=documented())
    async def list_voices() -> VoiceList:
        return speech.voices()

    @router.post("/v1/responses", responses=documented(ResponseObject, ResponseStreamEvent))
    @with_cancellation
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        return respond(await responses.create_response(request))

    @router.get(
        "/v1/responses/{response_id}", responses=documented(ResponseObject, ResponseStreamEvent)
    )
    async def retrieve_response(
        response_id: str,
        stream: bool = False,
        starting_after: Annotated[int | None, Query(ge=0)] = None,
    ) -> Response:
        if stream:
            return respond(responses.stream_stored(response_id, starting_after))
        if starting_after is not None:
            raise ServingError("starting_after goes with stream=true.", param="starting_after")
        return respond(responses.retrieve(response_id))

    @router.get("/v1/responses/{response_id}/input_items", responses=documented())
    async def list_input_items(
        response_id: str,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
    ) -> InputItemList:
        return responses.input_items(response_id, limit, order, after)

    @router.post("/v1/responses/{response_id}/cancel", responses=documented())
    async def cancel_response(response_id: str) -> ResponseObject:
        return await responses.cancel(response_id)

    @router.delete("/v1/responses/{response_id}", responses=documented())
    async def delete_response(response_id: str) -> DeletedResponse:
        return await responses.delete(response_id)

    return router


async def serve(args: argparse.Namespace) -> None:
    """Start the engine, then serve until SIGINT/SIGTERM; always stop the engine."""
    names = args.served_model_name
    engine_args = EngineArgs.from_cli_args(args)
    stat_logger = PrometheusStatLogger(
        names[0] if names else args.model,
        num_engines=engine_args.data_parallel_size,
        max_loras=engine_args.max_loras if engine_args.enable_lora else 0,
    )
    engine = AsyncLLM.from_engine_args(
        engine_args,
        stat_loggers=[stat_logger, *log_stats(args)],
        input_threads=args.input_processing_threads,
    )
    try:
        app = build_app(engine, args)
        for name, path, base in parse_lora_modules(getattr(args, "lora_modules", None)):
            await app.state.models.load(name, path, base)  # a bad adapter stops start-up
        config = uvicorn.Config(
            app,
            **uvicorn_options(args),
            timeout_keep_alive=5,
            timeout_graceful_shutdown=CLOSE_TIMEOUT_S,
        )
        await DrainingServer(config, engine, app.state.lifecycle, args.shutdown_timeout,
                             getattr(args, "enable_ssl_refresh", False)).serve()  # fmt: skip
    finally:
        engine.shutdown()


def log_stats(args: argparse.Namespace) -> list[LoggingStatLogger]:
    """The periodic stats line, unless ``--disable-log-stats``."""
    return [] if args.disable_log_stats else [LoggingStatLogger(envs.log_stats_interval())]


def run_server(args: argparse.Namespace) -> None:
    asyncio.run(serve(args))
