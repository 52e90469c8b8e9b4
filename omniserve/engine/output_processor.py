"""OutputProcessor: engine-core outputs -> user-facing ``RequestOutput``s, in the front end.

It keeps one state per user request (the parent) and one per engine request (a child; ``n > 1``
runs ``n`` children with ``n=1``). Per step it detokenizes, matches stop strings (asking the engine
to abort a child that a stop string finished), turns logprobs into ``Logprob`` dicts, and emits one
``RequestOutput`` per changed parent, shaped by ``SamplingParams.output_kind``.
This is the only per-request Python loop of the front end, so it does no tensor work.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from omniserve.engine.detokenizer import IncrementalDetokenizer, TokenTexts
from omniserve.engine.exceptions import EngineGenerateError, UnsatisfiableRequestError
from omniserve.messages import EngineCoreOutput, FinishReason, LogprobsLists
from omniserve.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
)
from omniserve.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from omniserve.engine.processor import ProcessedRequest


class OutputSink(Protocol):
    """Where a streamed request's outputs go (AsyncLLM's per-request collector)."""

    def put(self, item: RequestOutput | BaseException) -> None: ...


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    """Outputs of requests registered without a queue."""
    reqs_to_abort: list[str] = field(default_factory=list)
    """Child ids a stop string finished while the engine still runs them."""


@dataclass(eq=False)
class _ChildState:
    """One engine request: its tokens, text, logprobs, and what was already sent."""

    request_id: str
    index: int
    parent: _ParentState
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # What earlier DELTA outputs already carried.
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    changed: bool = False
    audio_chunks: list[np.ndarray] | None = None
    """Audio output: the waveform pieces so far (None: a text-only request)."""
    num_sent_chunks: int = 0
    num_audio_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def due(self, stream_interval: int) -> bool:
        """Whether a streamed output should carry this child's news now: its first token, its
        end, new audio, or ``stream_interval`` tokens not yet sent."""
        return (
            self.finished
            or self.num_sent_tokens == 0
            or len(self.token_ids) - self.num_sent_tokens >= stream_interval
            or (self.audio_chunks is not None and len(self.audio_chunks) > self.num_sent_chunks)
        )

    def completion(self, delta: bool) -> CompletionOutput:
        """This child's output now: everything so far, or only what is new (``delta``)."""
        text = ""
        if self.detokenizer is not None:
            text = self.detokenizer.output_text[
                : self.detokenizer.visible_text_length(self.finished)
            ]
        chars_from, tokens_from = (self.num_sent_chars, self.num_sent_tokens) if delta else (0, 0)
        self.num_sent_chars, self.num_sent_tokens = len(text), len(self.token_ids)
        logprobs = None if self.logprobs is None else self.logprobs[tokens_from:]
        audio = None
        if self.audio_chunks is not None:
            chunks = self.audio_chunks[self.num_sent_chunks if delta else 0 :]
            self.num_sent_chunks = len(self.audio_chunks)
            audio = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        return CompletionOutput(
            index=self.index,
            text=text[chars_from:],
            token_ids=self.token_ids[tokens_from:],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=None if self.finish_reason is None else str(self.finish_reason),
            stop_reason=self.stop_reason,
            audio=audio,
            num_audio_tokens=self.num_audio_tokens,
        )


@dataclass(eq=False)
class _ParentState:
    """One user request and its children (a single child, same id, when n == 1)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    """None: the prompt was given as embeddings, ``num_prompt_embeds`` rows."""
    params: SamplingParams
    queue: OutputSink | None
    arrival_time: float
    children: list[_ChildState] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_ready: bool = False  # prefill done: the list is complete
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int = 0
    num_mm_tokens: dict[str, int] = field(default_factory=dict)
    num_prompt_embeds: int = 0
    pooled: np.ndarray | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(child.finished for child in self.children)

    def make_output(self, stream_interval: int = 1) -> RequestOutput | None:
        """The RequestOutput to emit after a change, or None when ``output_kind`` says wait
        (or, streaming, until a child is ``due``: the news stay marked until then)."""
        kind = self.params.output_kind
        finished = self.finished
        changed = [c for c in self.children if c.changed]
        if not changed or (kind == RequestOutputKind.FINAL_ONLY and not finished):
            return None
        if stream_interval > 1 and not any(c.due(stream_interval) for c in changed):
            return None
        delta = kind == RequestOutputKind.DELTA
        children = changed if delta else self.children
        for child in self.children:
            child.changed = False
        prompt_logprobs = None
        if self.prompt_logprobs_ready and not (delta and self.prompt_logprobs_sent):
            prompt_logprobs, self.prompt_logprobs_sent = self.prompt_logprobs, True
        metrics = {"arrival_time": self.arrival_time}
        if self.first_token_time is not None:
            metrics["first_token_time"] = self.first_token_time
        if self.last_token_time is not None:
            metrics["last_token_time"] = self.last_token_time
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[child.completion(delta) for child in children],
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            metrics=metrics,
            num_mm_tokens=self.num_mm_tokens,
            num_prompt_embeds=self.num_prompt_embeds,
            pooled=self.pooled,
        )


class OutputProcessor:
    """Front-end state of every unfinished request; see the module docstring."""

    def __init__(self, tokenizer: Any, stream_interval: int = 1) -> None:
        """``stream_interval``: ``SchedulerConfig.stream_interval``."""
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self._token_texts = TokenTexts(tokenizer) if tokenizer is not None else None
        self._parents: dict[str, _ParentState] = {}  # request_id -> parent
        self._children: dict[str, _ChildState] = {}  # engine request id -> unfinished child

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        sampling_params: SamplingParams,
        child_request_ids: list[str] | None = None,
        queue: OutputSink | None = None,
        arrival_time: float | None = None,
        num_mm_tokens: dict[str, int] | None = None,
        num_prompt_embeds: int = 0,
    ) -> None:
        """Register a request. ``child_request_ids``: the engine ids of its n children (n > 1);
        ``queue``: where its outputs go (else ``process_outputs`` returns them);
        ``prompt_token_ids`` None with ``num_prompt_embeds`` rows: a prompt of embeddings."""
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is in use by a running request.")
        child_ids = child_request_ids or [request_id]
        parent = _ParentState(
            request_id,
            prompt,
            None if prompt_token_ids is None else list(prompt_token_ids),
            sampling_params,
            queue,
            arrival_time if arrival_time is not None else time.time(),
            num_mm_tokens=dict(num_mm_tokens or {}),
            num_prompt_embeds=num_prompt_embeds,
        )
        if sampling_params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]  # the first prompt token has no context
        detokenize = self.tokenizer is not None and sampling_params.detokenize
        for index, child_id in enumerate(child_ids):
            detokenizer = (
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids or [], sampling_params)
                if detokenize
                else None
            )
            child = _ChildState(child_id, index, parent, detokenizer)
            if sampling_params.logprobs is not None:
                child.logprobs, child.cumulative_logprob = [], 0.0
            if sampling_params.wants_audio:
                child.audio_chunks = []
            parent.children.append(child)
            self._children[child_id] = child
        self._parents[request_id] = parent

    def add_processed_request(
        self,
        request_id: str,
        processed: ProcessedRequest,
        params: SamplingParams,
        queue: OutputSink | None = None,
    ) -> None:
        """Register what ``Processor.process_inputs`` produced (children when n > 1)."""
        children = [r.request_id for r in processed.engine_requests]
        self.add_request(
            request_id,
            processed.prompt,
            processed.prompt_token_ids,
            params,
            children if params.n > 1 else None,
            queue=queue,
            num_mm_tokens=processed.num_mm_tokens,
            num_prompt_embeds=0 if processed.prompt_token_ids else processed.num_prompt_tokens,
        )

    def process_outputs(
        self, outputs: list[EngineCoreOutput], now: float | None = None
    ) -> OutputProcessorOutput:
        """Apply one batch of engine outputs; outputs of unknown (aborted) ids are ignored."""
        now = time.time() if now is None else now
        result = OutputProcessorOutput()
        changed: dict[str, _ParentState] = {}  # request_id -> parent, in first-seen order
        for output in outputs:
            child = self._children.get(output.request_id)
            if child is None:
                continue
            if output.finish_reason == FinishReason.ERROR and child.parent.queue is not None:
                self._fail(child, result, output.error)
                changed.pop(child.parent.request_id, None)
                continue
            self._apply(child, output, now, result)
            changed[child.parent.request_id] = child.parent
        for parent in changed.values():
            self._emit(parent, result)
        return result

    def _fail(self, failed: _ChildState, result: OutputProcessorOutput, error: str | None) -> None:
        """The engine failed on ``failed``: its request's consumer gets the error and the other
        children are aborted (a queue-less request instead finishes with "error")."""
        parent = failed.parent
        assert parent.queue is not None
        self._children.pop(failed.request_id, None)
        for child in parent.children:
            if not child.finished and self._children.pop(child.request_id, None) is not None:
                result.reqs_to_abort.append(child.request_id)
        self._parents.pop(parent.request_id, None)
        parent.queue.put(
            EngineGenerateError(
                f"Request {parent.request_id} failed with an internal error in the engine (the "
                "server log has the cause); other requests are unaffected."
            )
            if error is None
            else UnsatisfiableRequestError(error)
        )

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Finish the given requests (parent or child ids) as aborted.

        Returns the child ids the engine may still be running. A request with a queue gets a
        final output so its consumer stops waiting.
        """
        to_abort: list[str] = []
        touched: dict[str, _ParentState] = {}
        for request_id in request_ids:
            parent = self._parents.get(request_id)
            if parent is not None:
                children = [c for c in parent.children if not c.finished]
            else:
                child = self._children.get(request_id)
                children = [child] if child is not None else []
            for child in children:
                self._finish(child, FinishReason.ABORT, None)
                to_abort.append(child.request_id)
                touched[child.parent.request_id] = child.parent
        for parent in touched.values():
            self._emit(parent, None)
        return to_abort

    def propagate_error(self, error: BaseException) -> list[str]:
        """End every request with ``error`` (the engine died, or is being stopped): hand it to
        each queued request and forget them all. Returns the child ids still unfinished."""
        for parent in self._parents.values():
            if parent.queue is not None:
                parent.queue.put(error)
        unfinished = [child_id for child_id, child in self._children.items() if not child.finished]
        self._parents.clear()
        self._children.clear()
        return unfinished

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def get_num_unfinished_requests(self) -> int:
        """Unfinished user requests (a request with n > 1 counts once)."""
        return len(self._parents)

    def _apply(
        self,
        child: _ChildState,
        output: EngineCoreOutput,
        now: float,
        result: OutputProcessorOutput,
    ) -> None:
        parent = child.parent
        new_ids = output.new_token_ids
        if child.index == 0:  # every child computes the same prompt; report the first's
            self._add_prompt_logprobs(parent, output.new_prompt_logprobs)
            parent.num_cached_tokens = max(parent.num_cached_tokens, output.num_cached_tokens)
            if output.pooled is not None:
                parent.pooled = output.pooled
            parent.prompt_logprobs_ready = parent.prompt_logprobs_ready or bool(
                new_ids or output.finished
            )
        finish_reason, stop_reason = output.finish_reason, output.stop_reason
        if new_ids:
            child.token_ids.extend(new_ids)
            if parent.first_token_time is None:
                parent.first_token_time = now
            parent.last_token_time = now
            child.changed = True
        if child.detokenizer is not None:
            stop_string = child.detokenizer.update(
                new_ids, finish_reason == FinishReason.STOP, finished=output.finished
            )
            # A speaking request is not cut here: the engine matched the same stop string
            # before its talker could speak past it, and ends the request once it has spoken.
            if stop_string is not None and (child.audio_chunks is None or output.finished):
                finish_reason, stop_reason = FinishReason.STOP, stop_string
                if not output.finished:
                    result.reqs_to_abort.append(child.request_id)
        if output.new_logprobs is not None and child.logprobs is not None:
            self._add_sample_logprobs(child, output.new_logprobs)
        if child.audio_chunks is not None and output.new_audio is not None:
            child.audio_chunks.append(output.new_audio)
            child.num_audio_tokens = output.num_audio_tokens
            child.changed = True
        if finish_reason is not None:
            self._finish(child, finish_reason, stop_reason)

    def _finish(
        self,
        child: _ChildState,
        reason: FinishReason,
        stop_reason: int | str | None,
    ) -> None:
        child.finish_reason, child.stop_reason = reason, stop_reason
        child.changed = True
        self._children.pop(child.request_id, None)

    def _emit(self, parent: _ParentState, result: OutputProcessorOutput | None) -> None:
        """Send (or collect into ``result``) the parent's output; drop it once finished."""
        request_output = parent.make_output(self.stream_interval)
        if parent.finished:
            self._parents.pop(parent.request_id, None)
        if request_output is None:
            return
        if parent.queue is not None:
            parent.queue.put(request_output)
        elif result is not None:
            result.request_outputs.append(request_output)

    def _logprob_dicts(self, lists: LogprobsLists) -> list[dict[int, Logprob]]:
        """One dict per position: the chosen token (with its rank), then the top-k (rank 1..k)."""
        texts = None
        if self._token_texts is not None:
            texts = iter(self._token_texts([t for ids in lists.token_ids for t in ids]))
        dicts: list[dict[int, Logprob]] = []
        for ids, logprobs, rank in zip(lists.token_ids, lists.logprobs, lists.ranks, strict=True):
            ranks = [rank, *range(1, len(ids))]
            dicts.append(
                {
                    token_id: Logprob(logprob, token_rank, None if texts is None else next(texts))
                    for token_id, logprob, token_rank in zip(ids, logprobs, ranks, strict=True)
                }
            )
        return dicts

    def _add_sample_logprobs(self, child: _ChildState, lists: LogprobsLists) -> None:
        assert child.logprobs is not None and child.cumulative_logprob is not None
        child.logprobs.extend(self._logprob_dicts(lists))
        child.cumulative_logprob += sum(logprobs[0] for logprobs in lists.logprobs)

    def _add_prompt_logprobs(self, parent: _ParentState, lists: LogprobsLists | None) -> None:
        # NOTE: a request preempted after its prefill recomputes the prompt; keep the first copy.
        if lists is None or parent.prompt_logprobs is None or parent.prompt_logprobs_ready:
            return
        parent.prompt_logprobs.extend(self._logprob_dicts(lists))
