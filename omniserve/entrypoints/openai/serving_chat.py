"""POST /v1/chat/completions: messages -> chat template -> engine -> OpenAI chat responses."""

from __future__ import annotations

import time
from typing import Any

from omniserve.entrypoints.openai.protocol import (
    ChatCompletionLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprob,
    ChatLogprobsContent,
    ChatMessage,
    UsageInfo,
)
from omniserve.entrypoints.openai.reasoning import ReasoningParser, StreamingSplit
from omniserve.entrypoints.openai.serving_engine import (
    SSE_DONE,
    EventStream,
    OpenAIServing,
    OutputStream,
    clamp_logprob,
    sse_event,
    to_serving_error,
)
from omniserve.outputs import CompletionOutput, Logprob, RequestOutput


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args: Any, reasoning_parser: ReasoningParser | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reasoning_parser = reasoning_parser

    async def create_chat_completion(
            self, request: ChatCompletionRequest) -> ChatCompletionResponse | EventStream:
        """A full response, or (``stream=true``) the SSE events of one.

        Raises ``ServingError`` for anything wrong with the request, before any output is sent.
        """
        self.check_model(request.model)
        self.check_engine()
        try:
            prompt = await self.render_chat(
                request.messages, add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template_kwargs=request.template_kwargs,
                mm_processor_kwargs=request.mm_processor_kwargs)
        except ValueError as exc:
            raise to_serving_error(exc) from exc
        prompt_len = len(prompt.token_ids)
        params = self.sampling_params(request, prompt_len, max_tokens=request.output_limit,
                                      logprobs=request.num_logprobs)
        request_id = self.new_request_id("chatcmpl", request.request_id)
        (generator,) = await self.start_generation([prompt], params, request_id)
        thinking = (self.reasoning_parser is not None
                    and self.reasoning_parser.opens_in_prompt(prompt.text))
        if request.stream:
            return self._stream(request, request_id, generator, thinking)
        return await self._full(request, request_id, generator, thinking)

    def _message(self, request: ChatCompletionRequest, text: str,
                 thinking: bool) -> ChatMessage:
        if self.reasoning_parser is None:
            return ChatMessage(role="assistant", content=text)
        reasoning, content = self.reasoning_parser.split(text, thinking)
        return ChatMessage(role="assistant", content=content,
                           reasoning_content=reasoning if request.include_reasoning else None)

    async def _full(self, request: ChatCompletionRequest, request_id: str,
                    generator: OutputStream, thinking: bool) -> ChatCompletionResponse:
        final: RequestOutput | None = None
        try:
            async for output in generator:
                final = output
        except Exception as exc:
            raise to_serving_error(exc) from exc
        assert final is not None and final.finished, "a FINAL_ONLY request ends with its output"
        choices = [
            ChatCompletionResponseChoice(
                index=out.index, message=self._message(request, out.text, thinking),
                logprobs=self._logprobs(out, request.top_logprobs) if request.logprobs else None,
                finish_reason=out.finish_reason, stop_reason=out.stop_reason)
            for out in sorted(final.outputs, key=lambda o: o.index)]
        usage = self.usage([final], sum(len(out.token_ids) for out in final.outputs))
        return ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                      usage=usage)

    async def _stream(self, request: ChatCompletionRequest, request_id: str,
                      generator: OutputStream, thinking: bool) -> EventStream:
        """OpenAI's chunk sequence: a role chunk per choice, content (and reasoning) deltas,
        usage, [DONE]."""
        created = int(time.time())
        options = request.stream_options
        num_generated = [0] * request.n
        texts = [""] * request.n
        splits = ([StreamingSplit(self.reasoning_parser, thinking) for _ in range(request.n)]
                  if self.reasoning_parser is not None else None)

        def delta(index: int, text: str, final: bool) -> dict[str, str]:
            if splits is None:
                return {"content": text} if text else {}
            texts[index] += text
            reasoning, content = splits[index].feed(texts[index], final)
            fields = {"reasoning_content": reasoning if request.include_reasoning else "",
                      "content": content}
            return {key: value for key, value in fields.items() if value}

        def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse_event(ChatCompletionStreamResponse(
                id=request_id, created=created, model=self.model_name, choices=choices,
                usage=usage))

        try:
            for index in range(request.n):
                yield chunk([ChatCompletionStreamChoice(
                    index=index, delta={"role": "assistant", "content": ""})])
            latest: list[RequestOutput] = []
            async for output in generator:
                latest = [output]
                for out in output.outputs:
                    num_generated[out.index] += len(out.token_ids)
                    wants_logprobs = request.logprobs and out.token_ids
                    changes = delta(out.index, out.text, out.finish_reason is not None)
                    if not (changes or out.finish_reason or wants_logprobs):
                        continue  # e.g. text held back while it may still become a stop string
                    choice = ChatCompletionStreamChoice(
                        index=out.index, delta=changes,
                        logprobs=(self._logprobs(out, request.top_logprobs)
                                  if wants_logprobs else None),
                        finish_reason=out.finish_reason, stop_reason=out.stop_reason)
                    running = (self.usage(latest, sum(num_generated))
                               if options and options.continuous_usage_stats else None)
                    yield chunk([choice], running)
            if options and options.include_usage:
                yield chunk([], self.usage(latest, sum(num_generated)))
        except Exception as exc:  # e.g. the engine died mid-stream: tell the client in-band
            yield sse_event(to_serving_error(exc).to_response())
        finally:
            await generator.aclose()  # aborts it if unfinished
        yield SSE_DONE

    def _logprobs(self, out: CompletionOutput, top_logprobs: int | None) -> ChatCompletionLogprobs:
        """OpenAI's chat shape: per generated token, its logprob and the top alternatives."""
        content = []
        for token_id, position in zip(out.token_ids, out.logprobs or [], strict=False):
            content.append(ChatLogprobsContent(
                **self._entry(token_id, position.get(token_id)).model_dump(),
                top_logprobs=[self._entry(t, lp)
                              for t, lp in self.top_entries(position, top_logprobs or 0)]))
        return ChatCompletionLogprobs(content=content)

    def _entry(self, token_id: int, logprob: Logprob | None) -> ChatLogprob:
        text = self.token_text(token_id, logprob)
        return ChatLogprob(token=text, bytes=list(text.encode("utf-8")),
                           logprob=clamp_logprob(logprob.logprob) if logprob else -9999.0)
