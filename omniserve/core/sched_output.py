"""The two messages between the scheduler and the workers. Pure Python, serialisable.

``SchedulerOutput`` goes to the workers each step: the full data of newly scheduled requests once,
then only deltas, because workers keep their own copy of each running request.
``ModelRunnerOutput`` comes back with what was sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omniserve.lora.request import LoRARequest
from omniserve.messages import SpeechRequest
from omniserve.multimodal.inputs import MultiModalFeatureSpec, PromptEmbeds
from omniserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the workers have not seen (or must rebuild after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Tokens generated before a preemption (empty for a fresh request)."""
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None = None
    """Needed by the sampler to hold eos back until min_tokens."""
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)
    """The request's multimodal items (the worker needs their encoder inputs and positions)."""
    lora_request: LoRARequest | None = None
    prompt_embeds: list[PromptEmbeds] = field(default_factory=list)
    """Runs of the prompt given as embeddings: the rows the workers feed at their positions."""


@dataclass
class CachedRequestData:
    """Deltas for requests the workers already hold; parallel lists indexed alike."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    """Blocks appended to each request's block table this step (often empty)."""
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


TEXT_END = -1
"""Reply entry after the last spoken token (the talker's ``tts_eos`` input)."""


@dataclass
class NewTalkerRequestData:
    req_id: str
    speech: SpeechRequest
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class TalkerSchedulerOutput:
    new_reqs: list[NewTalkerRequestData] = field(default_factory=list)
    """Requests whose talker the workers start (or restart after preemption: a worker keeps
    what was spoken and recomputes the KV)."""
    cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_text: dict[str, list[int]] = field(default_factory=dict)
    """req_id -> reply entries the worker has not been sent yet."""
    finished_req_ids: set[str] = field(default_factory=set)
    """Talker requests done or aborted since the last step: workers drop their state."""
    preempted_req_ids: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class SchedulerOutput:
    """What one step computes."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    """req_id -> number of tokens computed for it this step."""
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    """req_ids finished or aborted since the last step: workers drop their state."""
    preempted_req_ids: set[str] = field(default_factory=set)
    """req_ids preempted this step: workers drop their state; they return as new requests."""
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    """req_id -> indices of the multimodal items to encode this step."""
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    """Encoder outputs (by item hash) the workers may drop."""
    newly_cached_block_ids: list[int] = field(default_factory=list)
    """KV blocks this step completes, offered to the prefix cache before it runs (uncached
    again if it fails)."""
    kv_block_copies: dict[str, tuple[int, int]] = field(default_factory=dict)
    """req_id -> (source, destination) KV block copied before the step runs: the request's
    prefix hit ends in a cached partial block, which it continues in a block of its own."""
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    """req_id -> draft tokens fed after its last token (speculative decoding); the step samples
    each of those positions too."""
    grammar_bitmask: dict[str, bytes] = field(default_factory=dict)
    """req_id -> the tokens its structured output allows next, as packed int32 bit words; only
    for constrained requests that sample this step."""
    talker: TalkerSchedulerOutput | None = None
    """The speech stage's part of the step (None: the model does not speak)."""

    @staticmethod
    def make_empty() -> SchedulerOutput:
        return SchedulerOutput([], CachedRequestData(), {}, 0)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0 and (
            self.talker is None or self.talker.is_empty
        )
