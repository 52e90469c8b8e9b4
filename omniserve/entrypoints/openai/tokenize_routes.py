"""vLLM's tokenizer routes: ``/tokenize`` (a prompt or a chat, media placeholders expanded as the
engine sees them), ``/detokenize``, and with ``--enable-tokenizer-info-endpoint``
``/get_tokenizer_info`` (the tokenizer's class, its configuration and the chat template)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter

from omniserve.entrypoints.chat_utils import locate_mm_error
from omniserve.entrypoints.openai.protocol import OpenAIBaseModel
from omniserve.entrypoints.openai.routing import documented
from omniserve.entrypoints.openai.serving_engine import (
    OpenAIServing,
    ServingError,
    to_serving_error,
)
from omniserve.entrypoints.openai.tokenize_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from omniserve.multimodal.errors import MultiModalInputError


class TokenizerInfoResponse(OpenAIBaseModel, extra="allow"):
    """The tokenizer's init settings (JSON-able ones) beside its class and chat template."""

    tokenizer_class: str


def tokenize_router(serving: OpenAIServing, info_endpoint: bool = False) -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize", responses=documented())
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        return await _tokenize(serving, request)

    @router.post("/detokenize", responses=documented())
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        serving.check_model(request.model)
        try:
            serving.engine.processor.check_token_ids("tokens", request.tokens)
            tokenizer = serving.text_tokenizer("/detokenize", "tokens")
            return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))
        except (ValueError, TypeError, OverflowError) as exc:
            raise ServingError(f"Cannot detokenize: {exc}", param="tokens") from exc

    if info_endpoint:

        @router.get("/get_tokenizer_info", responses=documented())
        async def get_tokenizer_info() -> TokenizerInfoResponse:
            tokenizer = serving.text_tokenizer("/get_tokenizer_info")
            return tokenizer_info(tokenizer, serving.renderer.chat_template)

    return router


def tokenizer_info(tokenizer: Any, chat_template: str | None) -> TokenizerInfoResponse:
    """vLLM's ``/get_tokenizer_info`` body: the tokenizer's init settings that JSON can carry
    (others, such as token objects, as their text), its class, and the chat template served."""
    settings = {
        key: _jsonable(value)
        for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items()
    }
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        settings["chat_template"] = template
    settings["tokenizer_class"] = type(tokenizer).__name__
    return TokenizerInfoResponse(**settings)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)


async def _tokenize(serving: OpenAIServing, request: TokenizeRequest) -> TokenizeResponse:
    """Token ids as the engine will see them: media placeholders expanded to their tokens."""
    serving.check_model(request.model)
    try:
        if isinstance(request, TokenizeChatRequest):
            prompt = await serving.render_chat(
                request, [tool.model_dump(exclude_none=True) for tool in request.tools or []]
            )
        else:
            prompt = await serving.tokenize_text(request.prompt, request.add_special_tokens)
        ids = prompt.token_ids
        if prompt.mm_data:
            try:
                ids = await serving.engine.engine_token_ids(prompt.to_engine_input())
            except MultiModalInputError as exc:
                raise locate_mm_error(exc, prompt.mm_locations or {}) from exc
    except ValueError as exc:
        raise to_serving_error(exc) from exc
    strs = serving.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
    return TokenizeResponse(
        count=len(ids), max_model_len=serving.max_model_len, tokens=ids, token_strs=strs
    )
