"""The types that cross stage and process boundaries, in one neutral module that the engine, the
scheduler, the workers and the layers all import (none of them imports another for these).

Front end <-> engine core: msgspec structs (`EngineCoreRequest`, `EngineCoreOutput(s)`), so the
same shapes cross a process boundary (ZMQ) without pickling. Worker -> scheduler: the plain
dataclasses of what a step produced (`ModelRunnerOutput`, `LogprobsLists`, `SpeechStepOutput`).
`SpeechRequest` is the talker's part of a request, made by the front end and read by the
scheduler and the workers. Pure Python.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from omniserve.lora.request import LoRARequest
from omniserve.multimodal.inputs import MultiModalFeatureSpec, PromptEmbeds
from omniserve.sampling_params import SamplingParams


@dataclass
class SpeechRequest:
    """What the talker stage needs of one request, resolved by the front end."""

    voice: str
    sampling_params: SamplingParams
    """The talker's (and its code predictor's) sampling; ``max_tokens`` caps talker tokens."""
    prompt_positions: list[int]
    """Thinker prompt positions the talker's prompt is built from, in order (Qwen3-Omni: the
    user turns' tokens; Qwen2.5-Omni: everything before the reply)."""
    text_start: int
    """Thinker position of the first reply token (after the last ``<|im_start|>assistant\\n``)."""
    prompt_len: int
    """Talker prompt length: the prompt positions plus the assistant prefix."""
    reply_in_prompt: bool = False
    """Speak the prompt's reply (everything after the assistant header), not generated text."""
    reads_prompt_hidden: bool = False
    """The talker reads the thinker's hidden states at prompt positions, which a prefix-cache
    hit would skip: the thinker computes the whole prompt."""
    reads_reply_hidden: bool = False
    """The talker reads the thinker's hidden state at each reply token too, so a reply entry is
    usable only once the thinker has computed (been fed) that token."""

    @property
    def max_tokens(self) -> int:
        """The talker's token cap, which the front end always resolves."""
        cap = self.sampling_params.max_tokens
        assert cap is not None
        return cap


@dataclass
class LogprobsLists:
    """Logprobs of a run of positions: per position, the chosen token first, then the top-k.

    ``token_ids[i][0]`` is the sampled (or, for prompts, the actual next) token; ``ranks[i]`` is its
    rank in the distribution (1 = most likely).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def head(self, num_positions: int) -> LogprobsLists:
        """The first ``num_positions`` positions (those whose tokens were kept)."""
        if num_positions >= len(self.ranks):
            return self
        n = num_positions
        return LogprobsLists(self.token_ids[:n], self.logprobs[:n], self.ranks[:n])


@dataclass
class ModelRunnerOutput:
    """What a step produced, per scheduled request."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    """Per request in ``req_ids``: the tokens sampled (empty while a prefill is still partial)."""
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    """req_id -> logprobs of the sampled tokens (only requests that asked)."""
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    """req_id -> logprobs of the prompt positions computed this step (only requests that asked)."""
    pooled: dict[str, Any] = field(default_factory=dict)
    """req_id -> the embedding (a float32 numpy array) of an embedding request whose prompt this
    step ended."""
    speech: dict[str, SpeechStepOutput] = field(default_factory=dict)
    """req_id -> the talker's progress, for talker requests scheduled this step."""
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """req_id -> draft tokens proposed for its next step (speculative decoding)."""


class PendingOutput(Protocol):
    """A launched step's output, read back from the device on ``result()`` (async scheduling
    launches the next step first)."""

    def result(self) -> ModelRunnerOutput: ...

    def done(self) -> bool:
        """Whether ``result()`` would return without waiting for the device."""
        ...


@dataclass
class ReadyOutput:
    """A step's output already on the host."""

    output: ModelRunnerOutput

    def result(self) -> ModelRunnerOutput:
        return self.output

    def done(self) -> bool:
        return True


@dataclass
class SpeechStepOutput:
    """A talker request's progress after a step (from the worker)."""

    num_frames: int
    done: bool
    audio: object = None
    """Newly final waveform samples (a float32 numpy array), or None."""


class FinishReason(enum.IntEnum):
    """Compact on the wire; ``str()`` gives the OpenAI finish_reason."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    """The engine failed on this request (an internal error); the engine itself lives on."""

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A tokenized, validated request, ready for the scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    max_tokens: int
    """Resolved output cap (never None here)."""
    mm_features: list[MultiModalFeatureSpec] = []
    """Multimodal items in prompt order, with their placeholder ranges and encoder inputs."""
    cache_salt: str | None = None
    """Mixed into the prefix-cache hashes: only requests with the same salt share KV blocks."""
    priority: int = 0
    """Lower is served first under the priority scheduling policy."""
    speech: SpeechRequest | None = None
    """Audio output: the talker stage's part of the request (None: text only)."""
    lora_request: LoRARequest | None = None
    """The LoRA adapter it runs with (the engine core has added it: ``add_lora``)."""
    prompt_embeds: list[PromptEmbeds] = []
    """Runs of the prompt given as embeddings, in prompt order (their ids are placeholders)."""


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    pooled: Any = None
    """An embedding request's embedding (a float32 numpy array), with its one output."""
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    new_audio: Any = None
    """Waveform samples finalised this step (a float32 numpy array), for audio output."""
    num_audio_tokens: int = 0
    """Codec frames spoken so far."""
    error: str | None = None
    """With finish reason ERROR: the request's own cause, for its client (an HTTP 400); None:
    the engine failed on it (the log has why)."""
    queued_time: float = 0.0
    scheduled_time: float = 0.0
    """On a request's last output: when the engine core received it and first scheduled it
    (wall-clock seconds; 0: not known), for the queue, prefill and decode times."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestTimes:
    """An engine request's timeline as the front end's stat loggers see it (wall-clock seconds):
    its arrival, its prompt's length, when its first and last tokens came, how many."""

    arrival_time: float
    num_prompt_tokens: int
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generated: int = 0

    def add_tokens(self, count: int, now: float) -> float | None:
        """``count`` tokens came ``now``; returns when the previous ones did (None: first)."""
        previous = self.last_token_time
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        self.num_generated += count
        return previous

    def phases(self, last: EngineCoreOutput) -> dict[str, float]:
        """The finished request's phases, vLLM's, from ``last`` (its last output, with the
        engine core's times): queue (received to first scheduled), prefill (to its first
        token), decode (first to last token), inference (scheduled to last token); only those
        its times allow (none for a request never scheduled)."""
        if not (last.queued_time and last.scheduled_time):
            return {}
        phases = {"queue": last.scheduled_time - last.queued_time}
        first, final = self.first_token_time, self.last_token_time
        if first is not None and final is not None:
            phases["prefill"] = first - last.scheduled_time
            phases["decode"] = final - first
            phases["inference"] = final - last.scheduled_time
        return {phase: max(seconds, 0.0) for phase, seconds in phases.items()}


ACCEPTED_AT_KEY = "spec_decode_accepted_at:"
"""Stats key prefix: drafts kept at each draft position (the position follows it)."""


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One batch of outputs from the engine core (one step, or abort acknowledgements)."""

    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    scheduler_stats: dict[str, float] | None = None
    """Gauges and cumulative counters by name (``Scheduler.make_stats``); a name may carry a
    label value after a prefix, e.g. ``ACCEPTED_AT_KEY`` + the draft position."""
    engine_index: int = 0
    """The data-parallel rank of the engine core that sent these."""
