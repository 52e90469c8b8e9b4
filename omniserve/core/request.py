"""The scheduler's view of a request. Pure Python (no torch)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from omniserve.lora.request import LoRARequest
from omniserve.messages import SpeechRequest
from omniserve.multimodal.inputs import MultiModalFeatureSpec, PromptEmbeds
from omniserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered so that every status after PREEMPTED is a finished one."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6
    """A step raised while the request ran alone (it caused the failure), or its rules left no
    token to sample."""

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    Progress is one counter, ``num_computed_tokens``, against ``num_tokens``: a request is "in
    prefill" only in the sense that the gap is large. That covers chunked prefill, prefix-cache hits
    and resumption after preemption with no phase flags.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float = 0.0
    max_tokens: int = 0
    """Resolved cap on output tokens (sampling max_tokens or what max_model_len leaves)."""
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)
    """Multimodal items in prompt order (placeholder ranges and identifiers)."""
    cache_salt: str | None = None
    """Only requests with the same salt share prefix-cache blocks (vLLM's cache_salt)."""
    priority: int = 0
    """Lower is served first under the priority policy."""
    speech: SpeechRequest | None = None
    """Audio output: what the talker stage needs (None: text only)."""
    lora_request: LoRARequest | None = None
    """The adapter it runs with (its id is mixed into the prefix-cache hashes)."""
    prompt_embeds: list[PromptEmbeds] = field(default_factory=list)
    """Runs of the prompt given as embeddings, for the workers (their identifiers are mixed
    into the hashes of the blocks they cover)."""
    text_stop: Any = None
    """A speaking request's stop-string matcher (made by the scheduler's ``make_text_stop``):
    the engine ends its text at a stop string before the talker could speak past it."""

    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    """Tokens sampled by scheduled steps whose output has not come back yet: scheduling counts
    them as known (async scheduling schedules a request's next token before the last is back)."""
    num_cached_tokens: int = -1
    """Prompt tokens served from the prefix cache at first schedule (-1: not scheduled yet)."""
    num_preemptions: int = 0
    suspect: bool = False
    """In a step that raised together with others: runs alone until it samples a token."""
    stop_reason: int | str | None = None
    error: str | None = None
    """Why the request ended in error, when its own sampling rules caused it (the client is
    told); None for an engine failure."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Draft tokens (speculative decoding) for its next step: proposed by the workers from its
    tokens so far, verified by that step, never its tokens until then."""
    block_hashes: list[int] = field(default_factory=list)
    """Chained hashes of this request's full blocks, extended as tokens arrive."""
    _output_token_ids: list[int] = field(default_factory=list)
    _all_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._all_token_ids = list(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return tuple(self._output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output ids. Read only: change them through ``append_output_token_ids``."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
