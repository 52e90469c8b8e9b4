"""Messages between the front end (LLMEngine / AsyncLLM) and the engine core.

msgspec structs, so the same shapes cross a process boundary (ZMQ) without pickling. Pure Python.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from omniserve.core.request import SpeechRequest
from omniserve.core.sched_output import LogprobsLists
from omniserve.multimodal.inputs import MultiModalFeatureSpec
from omniserve.sampling_params import SamplingParams


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


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    new_audio: Any = None
    """Waveform samples finalised this step (a float32 numpy array), for audio output."""
    num_audio_tokens: int = 0
    """Codec frames spoken so far."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One batch of outputs from the engine core (one step, or abort acknowledgements)."""

    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    scheduler_stats: dict[str, float] | None = None
    engine_index: int = 0
    """The data-parallel rank of the engine core that sent these."""
