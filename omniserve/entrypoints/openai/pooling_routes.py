"""The routes of pooling requests: OpenAI's ``/v1/embeddings``, vLLM's scoring routes
(``/score``, ``/rerank``, and the paths vLLM also answers them on), ``/classify`` and
``/pooling`` (any task's raw result)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from omniserve.entrypoints.openai.embedding_protocol import (
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingRequest,
    PoolingResponse,
)
from omniserve.entrypoints.openai.routing import documented, with_cancellation
from omniserve.entrypoints.openai.score_protocol import (
    ClassificationRequest,
    ClassificationResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from omniserve.entrypoints.openai.serving_score import OpenAIServingScores


def pooling_router(serving: OpenAIServingScores) -> APIRouter:
    router = APIRouter()

    def respond(body: BaseModel) -> Response:
        return Response(body.model_dump_json(), media_type="application/json")

    @router.post("/v1/embeddings", responses=documented(EmbeddingResponse))
    @with_cancellation
    async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
        return respond(await serving.create_embedding(request))

    @router.post("/pooling", responses=documented(PoolingResponse))
    @with_cancellation
    async def create_pooling(request: PoolingRequest, raw_request: Request) -> Response:
        return respond(await serving.create_pooling(request))

    @router.post("/score", responses=documented(ScoreResponse))
    @router.post("/v1/score", responses=documented(ScoreResponse))
    @with_cancellation
    async def create_score(request: ScoreRequest, raw_request: Request) -> Response:
        return respond(await serving.create_score(request))

    @router.post("/rerank", responses=documented(RerankResponse))
    @router.post("/v1/rerank", responses=documented(RerankResponse))
    @router.post("/v2/rerank", responses=documented(RerankResponse))
    @with_cancellation
    async def do_rerank(request: RerankRequest, raw_request: Request) -> Response:
        return respond(await serving.do_rerank(request))

    @router.post("/classify", responses=documented(ClassificationResponse))
    @with_cancellation
    async def create_classification(
        request: ClassificationRequest, raw_request: Request
    ) -> Response:
        return respond(await serving.create_classification(request))

    return router
