"""What chat and completions share: errors, request ids, prompt limits, the sampling mapping.

Every request error is decided here, once, so both endpoints answer a mistake the same way: a
``ServingError`` carries the HTTP status and the OpenAI error fields, and ``to_serving_error`` maps
engine exceptions (``ValueError`` -> 400, ``EngineDeadError`` -> 503) onto it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import json
import logging
import re
import uuid
from collections.abc import AsyncGenerator
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from omniserve.engine.async_llm import AsyncLLM
from omniserve.engine.exceptions import (
    EngineDeadError,
    EngineGenerateError,
    EngineSleepingError,
    EngineStoppingError,
)
from omniserve.engine.processor import TRUNCATE_REFUSAL, ContextLengthError, kept_prompt_start
from omniserve.entrypoints.beam_search import BeamSearchBatch, BeamSearchParams, BeamSequence
from omniserve.entrypoints.chat_utils import ChatRenderer, locate_mm_error
from omniserve.entrypoints.logger import RequestLogger
from omniserve.entrypoints.openai.chat_protocol import ChatCompletionRequest
from omniserve.entrypoints.openai.completion_protocol import CompletionRequest
from omniserve.entrypoints.openai.embedding_protocol import (
    ChatPromptFields,
    EmbeddingChatRequest,
    EmbeddingCompletionRequest,
    PoolingChatRequest,
    PoolingCompletionRequest,
)
from omniserve.entrypoints.openai.engine_prompt import EnginePrompt
from omniserve.entrypoints.openai.protocol import (
    CompletionTokensDetails,
    ErrorInfo,
    ErrorResponse,
    PromptLogprob,
    PromptOptions,
    PromptTokensDetails,
    SamplingRequest,
    UsageInfo,
    accepted_names,
)
from omniserve.entrypoints.openai.responses_protocol import ResponsesRequest
from omniserve.entrypoints.openai.score_protocol import (
    ClassificationChatRequest,
    ClassificationCompletionRequest,
    RerankRequest,
    ScoreRequest,
)
from omniserve.entrypoints.openai.speech_protocol import CreateSpeechRequest
from omniserve.entrypoints.openai.tokenize_protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from omniserve.entrypoints.openai.transcription_protocol import TranscriptionRequest
from omniserve.lora.request import LoRARequest
from omniserve.multimodal.errors import MultiModalInputError
from omniserve.outputs import Logprob, RequestOutput
from omniserve.sampling_params import SamplingParams
from omniserve.tokenizer import tokenizer_refusal

if TYPE_CHECKING:
    from omniserve.entrypoints.openai.serving_models import OpenAIServingModels

logger = logging.getLogger(__name__)
T = TypeVar("T")
OutputStream = AsyncGenerator[RequestOutput, None]
"""One prompt's outputs (``AsyncLLM.generate``); closing it aborts the request."""
EventStream = AsyncGenerator[str, None]
"""A streamed response's server-sent events."""


class ServingError(Exception):
    """A request the server refuses, with its HTTP status and OpenAI error fields.

    OpenAI's shape: ``type`` is "invalid_request_error" for the client's mistakes and
    "server_error" for ours; ``code`` is a machine-readable string where OpenAI has one
    ("model_not_found", "invalid_api_key", "context_length_exceeded", ...), else null.
    """

    def __init__(
        self,
        message: str,
        status: HTTPStatus = HTTPStatus.BAD_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param if param is not None or status != 400 else leading_param(message)
        self.code = code

    def to_response(self) -> ErrorResponse:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code)
        )


_FIELD_PATH = re.compile(r"[a-z_][a-z0-9_]*(?:\[\d+\]|\[\*\]|\.[a-z_][a-z0-9_]*)*")


@functools.cache
def _request_fields() -> frozenset[str]:
    models = (ChatCompletionRequest, CompletionRequest, TokenizeChatRequest,
              TokenizeCompletionRequest, DetokenizeRequest, CreateSpeechRequest,
              ResponsesRequest, TranscriptionRequest, EmbeddingChatRequest,
              EmbeddingCompletionRequest, ScoreRequest, RerankRequest,
              ClassificationChatRequest, ClassificationCompletionRequest, PoolingChatRequest,
              PoolingCompletionRequest)  # fmt: skip
    return frozenset(name for model in models for name in accepted_names(model))


def leading_param(message: str) -> str | None:
    """The request field a 400's message begins with ("logit_bias keys must ...",
    "messages[0].content[1] (image) ..."): its ``param``; None when it begins otherwise."""
    match = _FIELD_PATH.match(message)
    if match is None or match.end() < len(message) and message[match.end()] not in " :":
        return None
    path = match.group(0)
    return path if re.split(r"[.\[]", path, maxsplit=1)[0] in _request_fields() else None


def to_serving_error(exc: BaseException) -> ServingError:
    """Client mistakes are 400s, a dead or stopping engine is 503, a request the engine failed
    on is a 500 (the engine lives on); anything else is our bug (500, logged, text not sent)."""
    if isinstance(exc, ServingError):
        return exc
    if isinstance(exc, EngineDeadError):
        return ServingError(
            "The engine is dead; the server cannot serve requests.",
            HTTPStatus.SERVICE_UNAVAILABLE,
            code="engine_dead",
        )
    if isinstance(exc, EngineStoppingError):
        return ServingError(str(exc), HTTPStatus.SERVICE_UNAVAILABLE, code="server_shutting_down")
    if isinstance(exc, EngineSleepingError):
        return ServingError(str(exc), HTTPStatus.SERVICE_UNAVAILABLE, code="engine_sleeping")
    if isinstance(exc, EngineGenerateError):
        return ServingError(str(exc), HTTPStatus.INTERNAL_SERVER_ERROR, code="internal_error")
    if isinstance(exc, ContextLengthError):
        return ServingError(str(exc), param=exc.param, code="context_length_exceeded")
    if isinstance(exc, MultiModalInputError):  # its part, or the field its detail begins with
        return ServingError(str(exc), param=exc.location or leading_param(exc.detail))
    if isinstance(exc, (ValueError, TypeError)):
        return ServingError(str(exc))
    error_id = uuid.uuid4().hex[:12]
    logger.error("Internal error %s while serving a request", error_id, exc_info=exc)
    return ServingError(
        f"Internal server error (id {error_id}; the server log has the cause).",
        HTTPStatus.INTERNAL_SERVER_ERROR,
        code="internal_error",
    )


def sse_event(payload: Any) -> str:
    """One server-sent event; ``payload`` is a pydantic model or a JSON-able dict."""
    body = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {body}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def merge_async_iterators(
    *iterators: AsyncGenerator[T, None],
) -> AsyncGenerator[tuple[int, T], None]:
    """Interleave several async iterators as items arrive, tagging each with its iterator index.

    Leaving early (an error, or the consumer closing us) cancels and closes every iterator, which
    for ``AsyncLLM.generate`` aborts its request.
    """
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            await iterators[0].aclose()
        return
    pending = {asyncio.ensure_future(it.__anext__()): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(iterators[index].__anext__())] = index
                yield index, item
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for iterator in iterators:
            await iterator.aclose()


class OpenAIServing:
    """Base of the endpoint handlers: model names, tokenization, limits and sampling params."""

    prompt_field: ClassVar[str] = "prompt"
    """The request field a too-long prompt's error names."""

    def __init__(
        self,
        engine: AsyncLLM,
        models: OpenAIServingModels,
        chat_template: str | None = None,
        trust_request_chat_template: bool = False,
        request_logger: RequestLogger | None = None,
        chat_template_content_format: str = "auto",
        return_tokens_as_token_ids: bool = False,
        force_include_usage: bool = False,
    ) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.model_config.max_model_len
        self.models = models
        self.request_logger = request_logger
        self.renderer = ChatRenderer.from_config(engine.config, engine.tokenizer, chat_template,
                                                 chat_template_content_format)  # fmt: skip
        self.trust_request_chat_template = trust_request_chat_template
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        """--return-tokens-as-token-ids: every request's default."""
        self.force_include_usage = force_include_usage
        """--enable-force-include-usage: streams end with their usage whatever they ask."""
        """Whether requests may bring their own chat template (rendered in jinja's sandbox)."""
        self.default_sampling = engine.model_config.default_sampling_params()

    def text_tokenizer(self, what: str, param: str | None = None) -> Any:
        """The tokenizer, which ``what`` needs; a 400 naming it where the server loads none
        (--skip-tokenizer-init)."""
        if self.tokenizer is None:
            raise ServingError(tokenizer_refusal(what), param=param)
        return self.tokenizer

    def check_model(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's ``model`` names (None: the base model); 404 if none."""
        return self.models.resolve(name)

    def check_engine(self) -> None:
        if self.engine.errored:
            raise to_serving_error(EngineDeadError("engine dead"))

    @staticmethod
    def new_request_id(prefix: str, given: str | None = None) -> str:
        """The response id: from the request's own ``request_id`` (vLLM's field), else random."""
        return f"{prefix}-{given if given is not None else uuid.uuid4().hex}"

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """The most characters one token stands for (its longest vocabulary entry, in bytes
        for byte-level vocabularies): a text longer than max_model_len times this cannot fit,
        whatever it tokenizes to."""
        return max(map(len, self.tokenizer.get_vocab()))

    def check_text_length(self, num_chars: int, param: str) -> None:
        """Refuse text that cannot fit before spending any time tokenizing it."""
        limit = self.max_model_len * self.max_chars_per_token
        if num_chars > limit:
            raise ServingError(
                f"This model's maximum context length is {self.max_model_len} tokens, and no "
                f"text longer than {limit} characters fits in it; the {param} text has "
                f"{num_chars} characters.",
                param=param,
                code="context_length_exceeded",
            )

    async def tokenize_text(
        self, text: str, add_special_tokens: bool = True, param: str = "prompt"
    ) -> EnginePrompt:
        """Token ids of ``text``, checked for length first and tokenized off the event loop."""
        tokenizer = self.text_tokenizer(f"A text {param}", param)
        self.check_text_length(len(text), param)
        encoding = await self.engine.run_input_work(
            functools.partial(tokenizer, text, add_special_tokens=add_special_tokens)
        )
        return EnginePrompt(text, list(encoding.input_ids))

    async def render_chat(
        self,
        request: ChatCompletionRequest | TokenizeChatRequest | ChatPromptFields,
        tools: list[dict[str, Any]] | None = None,
    ) -> EnginePrompt:
        """A chat request's messages -> the templated prompt and its media, fetched
        concurrently; ``tools`` are listed by the template.

        Length limits are the engine's processor's, on the prompt with its media placeholders
        expanded (a ``ContextLengthError`` becomes a 400 naming the field).
        """
        self.text_tokenizer("Chat (its template)", "messages")
        if request.chat_template is not None and not self.trust_request_chat_template:
            raise ServingError(
                "A chat_template in the request needs the server started with "
                "--trust-request-chat-template.",
                param="chat_template",
            )
        mm_processor_kwargs = request.mm_processor_kwargs
        self.engine.processor.check_mm_kwargs(mm_processor_kwargs or {})
        self.check_text_length(_text_chars(request.messages), "messages")
        prompt, locations = await self.renderer.for_template(request.chat_template).render_async(
            request.messages,
            mm_processor_kwargs=mm_processor_kwargs,
            executor=self.engine.input_pool,
            add_special_tokens=request.add_special_tokens,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template_kwargs=request.template_kwargs,
            tools=tools,
        )
        return EnginePrompt.from_rendered(prompt, locations)

    async def render_parts(
        self, parts: list[Any], where: str, mm_processor_kwargs: dict[str, Any] | None
    ) -> EnginePrompt:
        """Content parts (field ``where``) as one prompt without a chat template: vLLM's score
        inputs (``ChatRenderer._prompt``)."""
        self.check_text_length(_text_chars([{"content": parts}]), where)
        prompt, locations = await self.renderer.render_async(
            [{"role": "user", "content": parts}],
            mm_processor_kwargs=mm_processor_kwargs,
            executor=self.engine.input_pool,
            where=where,
            template=False,
            add_special_tokens=True,
        )
        return EnginePrompt.from_rendered(prompt, locations)

    def apply_prompt_options(self, prompt: EnginePrompt, request: PromptOptions) -> EnginePrompt:
        """``truncate_prompt_tokens`` (keep the last k tokens; -1: max_model_len) and
        ``cache_salt``, as vLLM applies them to the tokenized prompt."""
        keep = request.truncate_prompt_tokens
        if keep is not None:
            if prompt.mm_data or isinstance(prompt.embeds, list):
                raise ServingError(f"{TRUNCATE_REFUSAL}.", param="truncate_prompt_tokens")
            start = kept_prompt_start(len(prompt.token_ids), keep, self.max_model_len)
            if start:
                embeds = prompt.embeds[start:] if prompt.embeds is not None else None
                prompt = dataclasses.replace(
                    prompt, text=None, token_ids=prompt.token_ids[start:], embeds=embeds
                )
        return dataclasses.replace(prompt, cache_salt=request.cache_salt)

    def check_token_ids(self, token_ids: list[int]) -> EnginePrompt:
        """A prompt given as token ids: not empty, and each id in the vocabulary (the error
        names this route's prompt field)."""
        if not token_ids:
            raise ServingError("The prompt is empty.", param=self.prompt_field)
        try:
            self.engine.processor.check_token_ids(self.prompt_field, token_ids)
        except ValueError as exc:
            raise ServingError(str(exc), param=self.prompt_field) from exc
        return EnginePrompt(None, token_ids)

    async def prompt_of(self, prompt: str | list[int], add_special_tokens: bool) -> EnginePrompt:
        """One prompt of OpenAI's forms (text, or token ids), tokenized and checked."""
        if isinstance(prompt, str):
            engine_prompt = await self.tokenize_text(prompt, add_special_tokens, self.prompt_field)
            if not engine_prompt.token_ids:
                raise ServingError("The prompt is empty.", param=self.prompt_field)
            return engine_prompt
        return self.check_token_ids(prompt)

    def sampling_params(
        self,
        request: SamplingRequest,
        *,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """``request.to_sampling_params`` with this server's defaults and limits; what it
        refuses is a 400 naming the field its message begins with."""
        try:
            return request.to_sampling_params(
                self.default_sampling, self.engine.model_config.max_logprobs,
                max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            )  # fmt: skip
        except ValueError as exc:
            raise ServingError(str(exc)) from exc

    def token_text(self, token_id: int, logprob: Logprob | None = None, as_id: bool = False) -> str:
        """A logprobs entry's token: its text, or "token_id:<id>" (return_tokens_as_token_ids)."""
        if as_id:
            return f"token_id:{token_id}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        if self.tokenizer is None:  # (--skip-tokenizer-init: ids are all there is)
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    @staticmethod
    def top_entries(position: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
        """The k most likely tokens at one position, most likely first."""
        return sorted(position.items(), key=lambda item: -item[1].logprob)[:k]

    def prompt_logprobs_json(
        self, request: SamplingRequest, output: RequestOutput
    ) -> list[dict[str, PromptLogprob] | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt position (the first has none), the prompt's
        token and the top ``request.prompt_logprobs``, keyed by token id."""
        k = request.prompt_logprobs
        if k is None:
            return None
        prompt_ids = output.prompt_token_ids or []  # (refused for prompts of embeddings)
        positions = output.prompt_logprobs or [None] * len(prompt_ids)
        result: list[dict[str, PromptLogprob] | None] = []
        for token_id, position in zip(prompt_ids, positions, strict=False):
            if position is None:
                result.append(None)
                continue
            entries = dict(self.top_entries(position, k))
            if token_id in position:
                entries[token_id] = position[token_id]
            result.append({
                str(t): PromptLogprob(logprob=clamp_logprob(lp.logprob), rank=lp.rank,
                                      decoded_token=self.token_text(t, lp))
                for t, lp in entries.items()
            })  # fmt: skip
        return result

    @staticmethod
    def usage(
        outputs: list[RequestOutput], completion_tokens: int, audio_tokens: int | None = None
    ) -> UsageInfo:
        """Usage over the prompts' (expanded) tokens, with OpenAI's prompt_tokens_details:
        prefix-cache hits and the tokens that stand for images, audio and video; spoken
        answers' codec frames count as completion tokens too (completion_tokens_details, set
        whenever audio was asked for: ``audio_tokens`` not None, 0 when nothing was spoken)."""
        prompt_tokens = sum(o.num_prompt_tokens for o in outputs)
        details = PromptTokensDetails(
            cached_tokens=sum(o.num_cached_tokens for o in outputs),
            **{
                f"{m}_tokens": sum(o.num_mm_tokens.get(m, 0) for o in outputs)
                for m in ("image", "audio", "video")
            },
        )
        completion_tokens += audio_tokens or 0
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=details,
            completion_tokens_details=None
            if audio_tokens is None
            else CompletionTokensDetails(audio_tokens=audio_tokens),
        )

    async def start_generation(
        self,
        prompts: list[EnginePrompt],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> list[OutputStream]:
        """Submit every prompt and wait for each one's first output.

        Waiting for the first output makes submission errors (the processor's validation) a 400
        before any 200 or stream is sent. A failure or cancellation here aborts every prompt.
        """
        ids = [
            request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))
        ]
        generators = self.engine.generate_many(
            [p.to_engine_input() for p in prompts], params, ids, priority, lora_request
        )
        if self.request_logger is not None:
            for rid, p in zip(ids, prompts, strict=True):
                media = sum(len(items) for items in (p.mm_data or {}).values())
                self.request_logger.log_inputs(rid, p.text, p.token_ids, params, lora_request,
                                               media)  # fmt: skip
            if self.request_logger.log_outputs:
                generators = [self.request_logger.watch(rid, params, g)
                              for rid, g in zip(ids, generators, strict=True)]  # fmt: skip
        tasks = [asyncio.ensure_future(anext(g)) for g in generators]
        try:
            firsts = await asyncio.gather(*tasks)
        except BaseException as exc:  # incl. cancellation when the client goes away
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(*(g.aclose() for g in generators), return_exceptions=True)
            if isinstance(exc, MultiModalInputError) and len(prompts) == 1:
                exc = locate_mm_error(exc, prompts[0].mm_locations or {})
            if isinstance(exc, Exception):
                error = to_serving_error(exc)
                if isinstance(exc, ContextLengthError) and error.param is None:
                    error.param = self.prompt_field
                raise error from exc
            raise
        return [_prepend(first, gen) for first, gen in zip(firsts, generators, strict=True)]

    async def beam_search(
        self,
        prompts: list[EnginePrompt],
        params: BeamSearchParams,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> list[tuple[list[BeamSequence], RequestOutput]]:
        """Each prompt's best beams (``entrypoints.beam_search``), with its first step's output
        (its prompt as the engine saw it, for usage). The prompts' searches step together: each
        step's beams of every prompt are one batch of requests."""
        tokenizer = self.text_tokenizer("use_beam_search (its texts)", "use_beam_search")
        try:
            params.check_width(self.engine.model_config.max_logprobs)
        except ValueError as exc:
            raise ServingError(str(exc), param="n") from exc
        batch = BeamSearchBatch(
            len(prompts), params, self.engine.processor.eos_token_ids, self.max_model_len
        )
        for number in itertools.count():
            if batch.done:
                break
            step_prompts = [
                dataclasses.replace(
                    prompts[i], text=None, token_ids=prompts[i].token_ids + beam.tokens
                )
                for i, beam in batch.step_beams()
            ]
            generators = await self.start_generation(
                step_prompts, params.step_params(), f"{request_id}-{number}", priority, lora_request
            )
            batch.take_step(await asyncio.gather(*(final_output(g) for g in generators)))
        decode = functools.partial(tokenizer.decode, skip_special_tokens=True)
        return list(zip(batch.results(decode), batch.firsts, strict=True))


def split_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """OpenAI's four prompt forms -> a list of single prompts (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


async def final_output(generator: OutputStream) -> RequestOutput:
    """A non-streamed request's one output (FINAL_ONLY), its errors as ``ServingError``; the
    generator is closed whatever happens (which aborts the request if it is unfinished)."""
    final: RequestOutput | None = None
    try:
        async for output in generator:
            final = output
    except Exception as exc:
        raise to_serving_error(exc) from exc
    finally:
        await generator.aclose()
    assert final is not None and final.finished, "a FINAL_ONLY request ends with its output"
    return final


def _text_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of text in chat messages (string contents and text parts)."""
    total = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(
                len(part["text"])
                for part in content
                if isinstance(part, dict) and isinstance(part.get("text"), str)
            )
    return total


async def _prepend(first: T, rest: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


def clamp_logprob(value: float) -> float:
    """JSON has no -inf; vLLM reports impossible tokens as -9999."""
    return max(value, -9999.0)
