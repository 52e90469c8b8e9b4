"""POST /v1/completions: one or more prompts (text or token ids) -> OpenAI text completions.

Choice ``index`` is ``prompt_index * n + sample_index``, as in OpenAI's API, so a batch of prompts
comes back in one response (or one stream) with every choice addressable.
"""

from __future__ import annotations

import time

from omniserve.entrypoints.beam_search import BeamSearchParams
from omniserve.entrypoints.openai.completion_protocol import (
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
)
from omniserve.entrypoints.openai.engine_prompt import EnginePrompt
from omniserve.entrypoints.openai.protocol import UsageInfo
from omniserve.entrypoints.openai.serving_engine import (
    SSE_DONE,
    EventStream,
    OpenAIServing,
    OutputStream,
    ServingError,
    clamp_logprob,
    merge_async_iterators,
    split_prompts,
    sse_event,
    to_serving_error,
)
from omniserve.inputs.preprocess import PROMPT_EMBEDS_PLACEHOLDER_ID
from omniserve.lora.request import LoRARequest
from omniserve.multimodal.media_io import load_tensor
from omniserve.outputs import Logprob, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(
        self, request: CompletionRequest
    ) -> CompletionResponse | EventStream:
        """A full response, or (``stream=true``) the SSE events of one.

        Raises ``ServingError`` for anything wrong with the request, before any output is sent.
        """
        lora = self.check_model(request.model)
        self.check_engine()
        given = [*self._embeds_prompts(request)]
        if request.prompt is not None:
            given += [await self.prompt_of(p, request.add_special_tokens)
                      for p in split_prompts(request.prompt)]  # fmt: skip
        prompts = [self.apply_prompt_options(p, request) for p in given]
        # Every prompt gets the same params (the processor fits max_tokens to each); echo with
        # logprobs reports the prompt's logprobs too (as OpenAI does).
        params = self.sampling_params(
            request,
            max_tokens=request.output_limit,
            logprobs=request.num_logprobs,
            prompt_logprobs=request.num_logprobs if request.echo else None,
        )
        request_id = self.new_request_id("cmpl", request.request_id)
        if request.use_beam_search:
            return await self._beam_search(request, request_id, prompts, lora)
        generators = await self.start_generation(
            prompts, params, request_id, request.priority, lora
        )
        if request.stream:
            return self._stream(request, request_id, prompts, generators)
        return await self._full(request, request_id, prompts, generators)

    async def _beam_search(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: list[EnginePrompt],
        lora: LoRARequest | None,
    ) -> CompletionResponse:
        """Each prompt's n best beams as its n choices (``use_beam_search``)."""
        if request.echo:
            raise ServingError("echo is not available with use_beam_search.", param="echo")
        params = BeamSearchParams(
            beam_width=request.n,
            max_tokens=request.output_limit or self.max_model_len,
            ignore_eos=request.ignore_eos,
            length_penalty=request.length_penalty,
        )
        searches = await self.beam_search(prompts, params, request_id, request.priority, lora)
        choices = [
            CompletionResponseChoice(
                index=i * request.n + j,
                text=beam.text,
                finish_reason=beam.finish_reason,
                **_token_ids(request, first, beam.tokens, first=True),
            )
            for i, (beams, first) in enumerate(searches)
            for j, beam in enumerate(beams)
        ]
        return CompletionResponse(
            id=request_id,
            model=self.models.response_name(request.model),
            choices=choices,
            usage=self.usage(
                [first for _, first in searches],
                sum(len(beam.tokens) for beams, _ in searches for beam in beams),
            ),
        )

    def _embeds_prompts(self, request: CompletionRequest) -> list[EnginePrompt]:
        """``prompt_embeds``, each decoded to a tensor (base64 of ``torch.save``; loaded with
        ``weights_only``, so nothing in it runs); the engine checks its shape and values."""
        encoded = request.prompt_embeds
        if not encoded:
            return []
        if not self.engine.model_config.enable_prompt_embeds:
            raise ServingError(
                "prompt_embeds needs the server started with --enable-prompt-embeds.",
                param="prompt_embeds",
            )
        if request.echo:
            raise ServingError(
                "echo returns the prompt's text and tokens, which prompt_embeds does not have.",
                param="echo",
            )
        prompts = []
        for i, item in enumerate([encoded] if isinstance(encoded, str) else encoded):
            where = "prompt_embeds" if isinstance(encoded, str) else f"prompt_embeds[{i}]"
            try:
                tensor = load_tensor(item)
            except ValueError as exc:
                raise ServingError(f"{where} {exc}.", param="prompt_embeds") from None
            rows = tensor.shape[-2] if tensor.ndim >= 2 else 0
            prompts.append(EnginePrompt(None, [PROMPT_EMBEDS_PLACEHOLDER_ID] * rows, embeds=tensor))
        return prompts

    async def _full(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: list[EnginePrompt],
        generators: list[OutputStream],
    ) -> CompletionResponse:
        finals: list[RequestOutput | None] = [None] * len(prompts)
        try:
            async for i, output in merge_async_iterators(*generators):
                finals[i] = output
        except Exception as exc:
            raise to_serving_error(exc) from exc
        choices: list[CompletionResponseChoice] = []
        num_generated = 0
        for i, final in enumerate(finals):
            assert final is not None and final.finished, "a FINAL_ONLY request ends with its output"
            for out in sorted(final.outputs, key=lambda o: o.index):
                num_generated += len(out.token_ids)
                text, logprobs = out.text, None
                if request.echo:
                    text = self._prompt_text(prompts[i]) + text
                if request.logprobs is not None:
                    logprobs = self._logprobs(
                        request,
                        final,
                        out.token_ids,
                        out.logprobs or [],
                        echo=request.echo,
                        offset=0,
                    )
                choices.append(
                    CompletionResponseChoice(
                        index=i * request.n + out.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=out.finish_reason,
                        stop_reason=out.stop_reason,
                        prompt_logprobs=self.prompt_logprobs_json(request, final),
                        **_token_ids(request, final, out.token_ids, first=True),
                    )
                )
        usage = self.usage([f for f in finals if f is not None], num_generated)
        return CompletionResponse(
            id=request_id,
            model=self.models.response_name(request.model),
            choices=choices,
            usage=usage,
        )

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: list[EnginePrompt],
        generators: list[OutputStream],
    ) -> EventStream:
        created = int(time.time())
        options = request.stream_options
        latest: dict[int, RequestOutput] = {}  # prompt index -> its latest output (for usage)
        num_generated = 0
        echoed: set[int] = set()  # choice indices whose prompt was already echoed
        started: set[int] = set()  # choice indices that sent a chunk
        offsets: dict[int, int] = {}  # choice index -> text offset of its next logprobs token

        def chunk(choices: list[CompletionResponseChoice], usage: UsageInfo | None = None) -> str:
            return sse_event(
                CompletionStreamResponse(
                    id=request_id,
                    created=created,
                    model=self.models.response_name(request.model),
                    choices=choices,
                    usage=usage,
                )
            )

        outputs = merge_async_iterators(*generators)
        try:
            async for i, output in outputs:
                latest[i] = output
                for out in output.outputs:
                    index = i * request.n + out.index
                    num_generated += len(out.token_ids)
                    text, echo = out.text, request.echo and index not in echoed
                    if echo:
                        echoed.add(index)
                        text = self._prompt_text(prompts[i]) + text
                    logprobs = None
                    if request.logprobs is not None and (out.token_ids or echo):
                        logprobs = self._logprobs(
                            request,
                            output,
                            out.token_ids,
                            out.logprobs or [],
                            echo=echo,
                            offset=offsets.get(index, 0),
                        )
                        offsets[index] = _end_offset(logprobs, offsets.get(index, 0))
                    if not (text or out.finish_reason or logprobs):
                        continue
                    running = (
                        self.usage(list(latest.values()), num_generated)
                        if options and options.continuous_usage_stats
                        else None
                    )
                    yield chunk(
                        [
                            CompletionResponseChoice(
                                index=index,
                                text=text,
                                logprobs=logprobs,
                                finish_reason=out.finish_reason,
                                stop_reason=out.stop_reason,
                                **_token_ids(
                                    request, output, out.token_ids, first=index not in started
                                ),
                            )
                        ],
                        running,
                    )
                    started.add(index)
            if self.force_include_usage or (options and options.include_usage):
                yield chunk([], self.usage(list(latest.values()), num_generated))
        except Exception as exc:  # e.g. the engine died mid-stream: tell the client in-band
            yield sse_event(to_serving_error(exc).to_response())
        finally:
            await outputs.aclose()  # aborts every unfinished prompt
        yield SSE_DONE

    def _prompt_text(self, prompt: EnginePrompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.text_tokenizer("echo (the prompt's text)", "echo").decode(prompt.token_ids)

    def _logprobs(
        self,
        request: CompletionRequest,
        output: RequestOutput,
        token_ids: list[int],
        logprobs: list[dict[int, Logprob]],
        *,
        echo: bool,
        offset: int,
    ) -> CompletionLogprobs:
        """OpenAI's completions shape; with echo the prompt's tokens come first."""
        k = request.logprobs or 0
        as_ids = request.return_tokens_as_token_ids or self.return_tokens_as_token_ids
        positions: list[tuple[int, dict[int, Logprob] | None]] = []
        if echo:
            prompt_ids = output.prompt_token_ids or []  # (echo is refused for embeddings)
            prompt_logprobs = output.prompt_logprobs or [None] * len(prompt_ids)
            positions += zip(prompt_ids, prompt_logprobs, strict=False)
        positions += zip(token_ids, logprobs, strict=False)
        result = CompletionLogprobs()
        for token_id, position in positions:
            chosen = position.get(token_id) if position else None
            text = self.token_text(token_id, chosen, as_ids)
            result.tokens.append(text)
            result.text_offset.append(offset)
            offset += len(text)
            result.token_logprobs.append(clamp_logprob(chosen.logprob) if chosen else None)
            if position is None:
                result.top_logprobs.append(None)
                continue
            # vLLM's shape: the top k plus the chosen token, keyed by text.
            top = {
                self.token_text(t, lp, as_ids): clamp_logprob(lp.logprob)
                for t, lp in self.top_entries(position, k)
            }
            if chosen is not None:
                top.setdefault(text, clamp_logprob(chosen.logprob))
            result.top_logprobs.append(top)
        return result


def _end_offset(logprobs: CompletionLogprobs, start: int) -> int:
    if not logprobs.tokens:
        return start
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1])


def _token_ids(
    request: CompletionRequest, output: RequestOutput, token_ids: list[int], *, first: bool
) -> dict[str, list[int] | None]:
    """A choice's ``return_token_ids`` fields: its new token ids, and on its first chunk (or in
    a whole response) its prompt's."""
    if not request.return_token_ids:
        return {}
    return {
        "token_ids": list(token_ids),
        "prompt_token_ids": output.prompt_token_ids if first else None,
    }
