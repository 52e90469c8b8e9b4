"""POST /v1/chat/completions: messages -> chat template -> engine -> OpenAI chat responses."""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

from omniserve.entrypoints.beam_search import BeamSearchParams
from omniserve.entrypoints.openai.audio_encoding import encode_audio, pcm16
from omniserve.entrypoints.openai.chat_protocol import (
    ChatCompletionAudio,
    ChatCompletionLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprob,
    ChatLogprobsContent,
    ChatMessage,
)
from omniserve.entrypoints.openai.engine_prompt import EnginePrompt
from omniserve.entrypoints.openai.protocol import (
    FunctionCall,
    ToolCall,
    UsageInfo,
)
from omniserve.entrypoints.openai.reasoning import ReasoningParser, StreamingSplit
from omniserve.entrypoints.openai.serving_engine import (
    SSE_DONE,
    EventStream,
    OpenAIServing,
    OutputStream,
    ServingError,
    clamp_logprob,
    final_output,
    sse_event,
    to_serving_error,
)
from omniserve.entrypoints.openai.tool_parsers import ToolCallReader, tool_call_reader
from omniserve.lora.request import LoRARequest
from omniserve.outputs import CompletionOutput, Logprob, RequestOutput
from omniserve.sampling_params import SamplingParams, SpeechParams


class ChatAnswer:
    """One choice's answer as OpenAI message fields, fed its text as it grows: the thinking
    split off (``--reasoning-parser``), then tool calls read from the rest (``tools``). A whole
    answer is one final feed, so streamed and whole answers are split by the same code."""

    def __init__(
        self,
        reasoning: StreamingSplit | None,
        tools: ToolCallReader | None,
        include_reasoning: bool,
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.include_reasoning = include_reasoning
        self.text = ""

    def feed(self, new_text: str, final: bool) -> dict[str, Any]:
        """The delta's fields that changed: reasoning_content, content, tool_calls."""
        self.text += new_text
        reasoning, content = (
            self.reasoning.feed(self.text, final) if self.reasoning else ("", new_text)
        )
        delta: dict[str, Any] = {}
        if reasoning and self.include_reasoning:
            delta["reasoning_content"] = reasoning
        if self.tools is not None:
            content, calls = self.tools.feed(content, final)
            if calls:
                delta["tool_calls"] = calls
        if content:
            delta["content"] = content
        return delta

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return self.tools.finish_reason(engine_reason) if self.tools else engine_reason

    @staticmethod
    def message(delta: dict[str, Any]) -> ChatMessage:
        """A whole answer's message from its one (final) delta."""
        calls = [
            ToolCall(id=call["id"], function=FunctionCall(**call["function"]))
            for call in delta.get("tool_calls", [])
        ]
        return ChatMessage(
            role="assistant",
            # an empty answer is "" (as OpenAI and vLLM give it); null only beside tool calls
            content=delta.get("content", None if calls else ""),
            reasoning_content=delta.get("reasoning_content"),
            tool_calls=calls or None,
        )


class OpenAIServingChat(OpenAIServing):
    prompt_field = "messages"

    def __init__(
        self,
        *args: Any,
        reasoning_parser: ReasoningParser | None = None,
        tool_call_parser: str | None = None,
        exclude_tools_when_tool_choice_none: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.reasoning_parser = reasoning_parser
        self.tool_call_parser = tool_call_parser
        """The format of "auto" tool calls (None: the server takes no "auto" tool choice)."""
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | EventStream:
        """A full response, or (``stream=true``) the SSE events of one.

        Raises ``ServingError`` for anything wrong with the request, before any output is sent.
        """
        lora = self.check_model(request.model)
        self.check_engine()
        request_id = self.new_request_id("chatcmpl", request.request_id)
        if request.use_beam_search:
            return await self._beam_search(request, request_id, lora)
        generator, thinking = await self.generate(request, request_id, lora)
        if request.stream:
            return self._stream(request, request_id, generator, thinking)
        return await self._full(request, request_id, generator, thinking)

    async def generate(
        self, request: ChatCompletionRequest, request_id: str, lora: LoRARequest | None
    ) -> tuple[OutputStream, bool]:
        """Render the request, start its generation and wait for its first output (so errors
        are 400s before any answer is sent): its outputs, and whether the prompt left the model
        thinking (the answer then starts in its reasoning)."""
        prompt, params, thinking = await self._prepare(request)
        (generator,) = await self.start_generation(
            [prompt], params, request_id, request.priority, lora
        )
        return generator, thinking

    async def _beam_search(
        self, request: ChatCompletionRequest, request_id: str, lora: LoRARequest | None
    ) -> ChatCompletionResponse:
        """The n best beams as the n choices (``use_beam_search``)."""
        if request.wants_audio:
            raise ServingError("use_beam_search answers in text only.", param="modalities")
        prompt, params, thinking = await self._prepare(request)
        beam_params = BeamSearchParams(
            beam_width=request.n,
            max_tokens=request.output_limit or self.max_model_len,
            ignore_eos=request.ignore_eos,
            length_penalty=request.length_penalty,
        )
        ((beams, first),) = await self.beam_search(
            [prompt], beam_params, request_id, request.priority, lora
        )
        choices = []
        for index, beam in enumerate(beams):
            answer = self.answer(request, thinking)
            choices.append(
                ChatCompletionResponseChoice(
                    index=index,
                    message=answer.message(answer.feed(beam.text, final=True)),
                    finish_reason=answer.finish_reason(beam.finish_reason),
                    token_ids=beam.tokens if request.return_token_ids else None,
                )
            )
        return ChatCompletionResponse(
            id=request_id,
            model=self.models.response_name(request.model),
            choices=choices,
            usage=self.usage([first], sum(len(beam.tokens) for beam in beams)),
            prompt_token_ids=first.prompt_token_ids if request.return_token_ids else None,
        )

    async def _prepare(
        self, request: ChatCompletionRequest
    ) -> tuple[EnginePrompt, SamplingParams, bool]:
        """The rendered prompt, its sampling params, and whether it leaves the model thinking."""
        try:
            tool_call_reader(request, self.tool_call_parser)  # "auto" needs a parser
            tools = request.template_tools(self.exclude_tools_when_tool_choice_none)
            prompt = await self.render_chat(request, tools)
        except ValueError as exc:
            raise to_serving_error(exc) from exc
        thinking = self.reasoning_parser is not None and self.reasoning_parser.opens_in_prompt(
            prompt.text
        )
        prompt = self.apply_prompt_options(prompt, request)
        params = self.sampling_params(
            request, max_tokens=request.output_limit, logprobs=request.num_logprobs
        )
        if request.wants_audio:
            params = params.clone(
                output_modalities=list(request.modalities or []),
                speech=self._speech_params(request),
            )
        return prompt, params, thinking

    def _speech_params(self, request: ChatCompletionRequest) -> SpeechParams:
        """The request's voice (checked against the model's) and talker settings; a model that
        cannot speak is a 400 saying why."""
        config = self.engine.model_config
        if config.speech is None:
            raise ServingError(
                f"Audio output is not available: {config.no_speech_reason}.", param="modalities"
            )
        assert request.audio is not None  # the request model requires it with audio
        try:
            voice = config.speech.resolve_voice(request.audio.voice_name)
        except ValueError as exc:
            raise ServingError(str(exc), param="audio.voice") from exc
        options = request.speech.model_dump(exclude_none=True) if request.speech else {}
        return SpeechParams(voice=voice, **options)

    def _audio(
        self, request: ChatCompletionRequest, out: CompletionOutput, audio_id: str, transcript: str
    ) -> ChatCompletionAudio | None:
        """``message.audio`` of a whole answer (None for a text-only request)."""
        if out.audio is None or request.audio is None:
            return None
        assert self.engine.model_config.speech is not None
        data = encode_audio(
            out.audio, request.audio.format, self.engine.model_config.speech.sample_rate
        )
        return ChatCompletionAudio(
            id=audio_id,
            data=base64.b64encode(data).decode(),
            expires_at=int(time.time()) + AUDIO_TTL_S,
            transcript=transcript,
        )

    def answer(self, request: ChatCompletionRequest, thinking: bool) -> ChatAnswer:
        """A reader of one choice's answer: its thinking, content and tool calls."""
        split = (
            StreamingSplit(self.reasoning_parser, thinking)
            if self.reasoning_parser is not None
            else None
        )
        return ChatAnswer(
            split, tool_call_reader(request, self.tool_call_parser), request.include_reasoning
        )

    async def _full(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        generator: OutputStream,
        thinking: bool,
    ) -> ChatCompletionResponse:
        final = await final_output(generator)
        choices = []
        echo = _echo(request)
        for out in sorted(final.outputs, key=lambda o: o.index):
            answer = self.answer(request, thinking)
            message = answer.message(answer.feed(out.text, final=True))
            if echo:
                message.content = echo + (message.content or "")
            message.audio = self._audio(request, out, _audio_id(), message.content or "")
            if message.audio is not None and "text" not in (request.modalities or []):
                message.content = None  # OpenAI: an audio-only answer's text is its transcript
            choices.append(
                ChatCompletionResponseChoice(
                    index=out.index,
                    message=message,
                    logprobs=self.logprobs(request, out) if request.logprobs else None,
                    finish_reason=answer.finish_reason(out.finish_reason),
                    stop_reason=out.stop_reason,
                    token_ids=list(out.token_ids) if request.return_token_ids else None,
                )
            )
        usage = self.usage(
            [final],
            sum(len(out.token_ids) for out in final.outputs),
            sum(out.num_audio_tokens for out in final.outputs) if request.wants_audio else None,
        )
        return ChatCompletionResponse(
            id=request_id,
            model=self.models.response_name(request.model),
            choices=choices,
            usage=usage,
            prompt_token_ids=final.prompt_token_ids if request.return_token_ids else None,
            prompt_logprobs=self.prompt_logprobs_json(request, final),
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        generator: OutputStream,
        thinking: bool,
    ) -> EventStream:
        """OpenAI's chunk sequence: a role chunk per choice (and the echoed message), content
        (reasoning, tool call) deltas, usage, [DONE]. With return_token_ids, the first chunk of
        output carries the prompt's token ids and each chunk its new ones."""
        created = int(time.time())
        options = request.stream_options
        num_generated = [0] * request.n
        num_audio = [0] * request.n

        def spoken() -> int | None:  # codec frames so far; None for a text-only request
            return sum(num_audio) if request.wants_audio else None

        answers = [self.answer(request, thinking) for _ in range(request.n)]
        audio_ids = [_audio_id() for _ in range(request.n)]
        audio_only = request.wants_audio and "text" not in (request.modalities or [])
        prompt_ids_sent = not request.return_token_ids

        def chunk(
            choices: list[ChatCompletionStreamChoice],
            usage: UsageInfo | None = None,
            prompt_token_ids: list[int] | None = None,
        ) -> str:
            return sse_event(
                ChatCompletionStreamResponse(
                    id=request_id,
                    created=created,
                    model=self.models.response_name(request.model),
                    choices=choices,
                    usage=usage,
                    prompt_token_ids=prompt_token_ids,
                )
            )

        try:
            echo = _echo(request)
            for index in range(request.n):
                yield chunk(
                    [
                        ChatCompletionStreamChoice(
                            index=index, delta={"role": "assistant", "content": ""}
                        )
                    ]
                )
                if echo:
                    yield chunk([ChatCompletionStreamChoice(index=index, delta={"content": echo})])
            latest: list[RequestOutput] = []
            async for output in generator:
                latest = [output]
                for out in output.outputs:
                    num_generated[out.index] += len(out.token_ids)
                    wants_logprobs = request.logprobs and out.token_ids
                    answer = answers[out.index]
                    changes = answer.feed(out.text, out.finish_reason is not None)
                    if out.audio is not None:
                        num_audio[out.index] = out.num_audio_tokens
                        changes = _audio_delta(changes, out, audio_ids[out.index], audio_only)
                    if not (changes or out.finish_reason or wants_logprobs):
                        continue  # e.g. text held back while it may still become a stop string
                    choice = ChatCompletionStreamChoice(
                        index=out.index,
                        delta=changes,
                        logprobs=self.logprobs(request, out) if wants_logprobs else None,
                        finish_reason=answer.finish_reason(out.finish_reason),
                        stop_reason=out.stop_reason,
                        token_ids=list(out.token_ids) if request.return_token_ids else None,
                    )
                    running = (
                        self.usage(latest, sum(num_generated), spoken())
                        if options and options.continuous_usage_stats
                        else None
                    )
                    yield chunk(
                        [choice], running, None if prompt_ids_sent else output.prompt_token_ids
                    )
                    prompt_ids_sent = True
            if self.force_include_usage or (options and options.include_usage):
                yield chunk([], self.usage(latest, sum(num_generated), spoken()))
        except Exception as exc:  # e.g. the engine died mid-stream: tell the client in-band
            yield sse_event(to_serving_error(exc).to_response())
        finally:
            await generator.aclose()  # aborts it if unfinished
        yield SSE_DONE

    def logprobs(
        self, request: ChatCompletionRequest, out: CompletionOutput
    ) -> ChatCompletionLogprobs:
        """OpenAI's chat shape: per generated token, its logprob and the top alternatives."""
        as_ids = request.return_tokens_as_token_ids or self.return_tokens_as_token_ids
        content = []
        for token_id, position in zip(out.token_ids, out.logprobs or [], strict=False):
            content.append(
                ChatLogprobsContent(
                    **self._entry(token_id, position.get(token_id), as_ids).model_dump(),
                    top_logprobs=[
                        self._entry(t, lp, as_ids)
                        for t, lp in self.top_entries(position, request.top_logprobs or 0)
                    ],
                )
            )
        return ChatCompletionLogprobs(content=content)

    def _entry(self, token_id: int, logprob: Logprob | None, as_id: bool) -> ChatLogprob:
        text = self.token_text(token_id, logprob, as_id)
        return ChatLogprob(
            token=text,
            bytes=list(text.encode("utf-8")),
            logprob=clamp_logprob(logprob.logprob) if logprob else -9999.0,
        )


AUDIO_TTL_S = 3600
"""``expires_at`` of an answer's audio: now + an hour (answers are not stored; the field is
OpenAI's and its clients read it)."""


def _audio_id() -> str:
    return f"audio-{uuid.uuid4().hex}"


def _audio_delta(
    changes: dict[str, Any], out: CompletionOutput, audio_id: str, audio_only: bool
) -> dict[str, Any]:
    """A streamed chunk's ``delta.audio``: the new samples as base64 PCM16 with the answer's
    id, the text as its transcript when only audio was asked for, and ``expires_at`` on the
    last one (OpenAI's chunk fields)."""
    audio: dict[str, Any] = {}
    if out.audio is not None and len(out.audio):
        audio.update(id=audio_id, data=base64.b64encode(pcm16(out.audio)).decode())
    if audio_only and "content" in changes:
        audio.update(id=audio_id, transcript=changes.pop("content"))
    if out.finish_reason is not None:
        audio.update(id=audio_id, expires_at=int(time.time()) + AUDIO_TTL_S)
    return {**changes, "audio": audio} if audio else changes


def _echo(request: ChatCompletionRequest) -> str:
    """What ``echo`` puts before the answer: the last message's text when it is the assistant's
    (the role of the answer), as vLLM; else nothing."""
    last = request.messages[-1] if request.echo and request.messages else None
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return ""
    content = last.get("content")
    if isinstance(content, list):
        return "".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return content if isinstance(content, str) else ""
