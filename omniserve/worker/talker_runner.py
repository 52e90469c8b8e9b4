"""TalkerRunner: the speech stage of a step, after the thinker's forward.

It keeps each speaking request's worker-side state (the thinker's tapped hidden states, the
talker's inputs, the frames spoken, the vocoder's progress), runs the talker over its own paged
KV cache, samples each frame, and streams the vocoder: a first chunk after
``first_chunk_frames`` frames (short time to first audio), then chunks as long as what was
already vocoded (the audio out stays ahead of playback while calls get fewer) up to
``max_chunk_frames``, and the rest when the talker is done. Which requests compute what comes
from the scheduler (``TalkerSchedulerOutput``); the model supplies the modules (``talker``, the
vocoder, ``speech_config``, the thinker's embeddings and M-RoPE positions). What differs between
model families (how the talker's prompt and decode inputs are built from the thinker's side, how
a frame is sampled, what the thinker must tap) is each family's subclass
(``worker/talker_families.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from omniserve.attention.layer import (
    allocate_kv_caches,
    kv_cache_bytes_per_block,
    release_kv_caches,
)
from omniserve.attention.metadata import AttentionMetadata
from omniserve.config import blocks_for
from omniserve.core.sched_output import TEXT_END, TalkerSchedulerOutput
from omniserve.forward_context import set_forward_context
from omniserve.layers.sampler import Sampler, SamplingMetadata
from omniserve.messages import SpeechRequest, SpeechStepOutput
from omniserve.multimodal.inputs import MultiModalFeatureSpec
from omniserve.transfers import host_to_device
from omniserve.worker.encoder_runner import mrope_positions
from omniserve.worker.sampling_inputs import build_sampling_metadata, padded


@dataclass
class ThinkerSide:
    """What the thinker leaves for a speaking request (registered when it is scheduled)."""

    prompt_token_ids: list[int]
    mm_features: list[MultiModalFeatureSpec]
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    """Thinker position -> the thinker's tapped hidden state there (the positions the family
    keeps)."""


@dataclass
class TalkerState:
    speech: SpeechRequest
    thinker: ThinkerSide
    generator: torch.Generator | None
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    text: list[int] = field(default_factory=list)
    prompt: torch.Tensor | None = None  # [prompt_len, hidden] talker prompt rows
    decode_rows: list[torch.Tensor] = field(default_factory=list)  # [1, hidden] per frame
    positions: torch.Tensor | None = None  # [3, prompt_len] M-RoPE positions of the prompt
    delta: int = 0
    codes: list[torch.Tensor] = field(default_factory=list)  # per frame [num_groups]
    history: list[int] = field(default_factory=list)  # sampled talker tokens (the repetition set)
    done: bool = False
    vocoded_frames: int = 0
    vocoder: Any = None  # the vocoder stream's per-answer state

    def buildable_inputs(self) -> int:
        """Inputs that can exist now: the prompt, then decode input j once frame j and reply
        entry j + 1 (or the end of the text) are known."""
        text_ended = TEXT_END in self.text
        decodes = len(self.codes) if text_ended else min(len(self.codes), len(self.text) - 1)
        return self.speech.prompt_len + max(decodes, 0)


class TalkerRunner(ABC):
    first_chunk_frames: ClassVar[int | None] = 2
    """Frames before the first vocoder chunk; None: vocode once, when the talker is done."""
    max_chunk_frames: ClassVar[int] = 25
    taps_output: ClassVar[bool] = False
    """The talker reads the thinker's final hidden states (its forward's output), not a tapped
    intermediate layer (``model.tapped``)."""

    def __init__(self, model: nn.Module, block_size: int, device: torch.device) -> None:
        self.model = model
        self.talker = model.talker
        self.config = model.speech_config
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.thinker_sides: dict[str, ThinkerSide] = {}
        self.states: dict[str, TalkerState] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.vocoder = model.vocoder_stream()

    # ---- family hooks ----------------------------------------------------------------------
    @abstractmethod
    def wants_hidden(self, has_media: bool) -> bool:
        """Whether a speaking request's thinker steps must hand over hidden states at all."""

    @abstractmethod
    def keeps(self, side: ThinkerSide, position: int) -> bool:
        """Whether the talker reads the thinker's hidden state at ``position``."""

    @abstractmethod
    def build_prompt(self, state: TalkerState) -> torch.Tensor:
        """The talker's prompt rows ``[prompt_len, hidden]``; sets ``state.positions/delta``."""

    @abstractmethod
    def decode_row(self, state: TalkerState, j: int) -> torch.Tensor:
        """Decode input ``j`` ``[1, hidden]``: from frame ``j`` and reply entry ``j + 1``."""

    @abstractmethod
    def sample_frames(self, states: list[TalkerState], hidden: torch.Tensor) -> None:
        """Sample each state's next frame from the talker's last hidden state (appending to
        ``codes``, or setting ``done``)."""

    def new_vocoder_state(self, state: TalkerState) -> Any:
        return self.vocoder.new_state()

    # ---- KV cache --------------------------------------------------------------------------
    def kv_cache_bytes_per_block(self, dtype: torch.dtype) -> int:
        return kv_cache_bytes_per_block(self.talker, self.block_size, dtype)

    def initialize_kv_cache(self, num_blocks: int, dtype: torch.dtype) -> None:
        self.kv_caches = allocate_kv_caches(
            self.talker, num_blocks, self.block_size, dtype, self.device
        )

    def release_kv_cache(self) -> None:
        release_kv_caches(self.talker)
        self.kv_caches = []

    # ---- from the thinker --------------------------------------------------------------------
    def register(
        self, req_id: str, prompt_token_ids: list[int], mm_features: list[MultiModalFeatureSpec]
    ) -> None:
        """A speaking request reached the thinker (again, after a preemption: its taps stay)."""
        if req_id not in self.thinker_sides:
            self.thinker_sides[req_id] = ThinkerSide(list(prompt_token_ids), list(mm_features))

    def keep_hidden(self, req_id: str, positions: np.ndarray, rows: torch.Tensor) -> None:
        """The thinker's tapped hidden states ``rows [n, H]`` at ``positions``; the family says
        which it keeps."""
        side = self.thinker_sides.get(req_id)
        if side is None:
            return
        kept = [i for i, position in enumerate(positions.tolist()) if self.keeps(side, position)]
        if kept:
            copy = rows[kept].clone()  # the step's buffers are reused
            for row, i in enumerate(kept):
                side.hidden[int(positions[i])] = copy[row]

    # ---- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, so: TalkerSchedulerOutput) -> dict[str, SpeechStepOutput]:
        self._update_states(so)
        if so.is_empty:
            return {}
        req_ids = list(so.num_scheduled_tokens)
        states = [self.states[r] for r in req_ids]
        embeds, positions, slots, query_lens, seq_lens = [], [], [], [], []
        for state, req_id in zip(states, req_ids, strict=True):
            start, count = state.num_computed, so.num_scheduled_tokens[req_id]
            embeds.append(self._inputs(state, start, start + count))  # sets state.positions
            positions.append(np.arange(start, start + count))
            table = np.asarray(state.block_ids, dtype=np.int64)
            pos = np.arange(start, start + count)
            slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            query_lens.append(count)
            seq_lens.append(start + count)
            state.num_computed = start + count
        max_blocks = max(blocks_for(n, self.block_size) for n in seq_lens)
        tables = np.zeros((len(states), max_blocks), dtype=np.int64)
        for row, state in enumerate(states):
            used = state.block_ids[:max_blocks]
            tables[row, : len(used)] = used
        dev = self.device
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor(
                np.concatenate(([0], np.cumsum(query_lens))), dtype=torch.int32, device=dev
            ),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_table=host_to_device(tables, dev, torch.int32),
            slot_mapping=host_to_device(np.concatenate(slots), dev),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        rope = mrope_positions(
            np.concatenate(positions),
            np.asarray(query_lens),
            np.asarray([int(s.delta) for s in states]),
            np.asarray([s.speech.prompt_len for s in states]),
            [s.positions for s in states],
        )
        with set_forward_context(metadata):
            hidden = self.talker.model(None, rope.to(dev), inputs_embeds=torch.cat(embeds))
        ends = np.cumsum(query_lens) - 1
        sampling = [
            i
            for i, state in enumerate(states)
            if state.num_computed == state.buildable_inputs() and not state.done
        ]
        if sampling:
            self.sample_frames(
                [states[i] for i in sampling], hidden[torch.from_numpy(ends[sampling])]
            )
        return self._stream(req_ids, states)

    def _update_states(self, so: TalkerSchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.states.pop(req_id, None)
            self.thinker_sides.pop(req_id, None)
        for req_id in so.preempted_req_ids:
            state = self.states.get(req_id)
            if state is not None:
                state.block_ids, state.num_computed = [], 0
        for new in so.new_reqs:
            state = self.states.get(new.req_id)
            if state is None:
                params = new.speech.sampling_params
                generator = None
                if params.seed is not None and not params.greedy:
                    generator = torch.Generator(device=self.device).manual_seed(params.seed)
                state = TalkerState(new.speech, self.thinker_sides[new.req_id], generator)
                self.states[new.req_id] = state
            state.block_ids, state.num_computed = list(new.block_ids), new.num_computed_tokens
        cached = so.cached_reqs
        for req_id, block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            state = self.states[req_id]
            state.block_ids.extend(block_ids)
            state.num_computed = num_computed
        for req_id, entries in so.new_text.items():
            self.states[req_id].text.extend(entries)

    # ---- inputs --------------------------------------------------------------------------------
    def _inputs(self, state: TalkerState, start: int, end: int) -> torch.Tensor:
        """Talker input rows ``[start, end)``, building the prompt and decode rows on first use."""
        if state.prompt is None:
            state.prompt = self.build_prompt(state)
        prompt_len = state.speech.prompt_len
        while prompt_len + len(state.decode_rows) < end:
            state.decode_rows.append(self.decode_row(state, len(state.decode_rows)))
        parts = [state.prompt[start:end]] if start < prompt_len else []
        parts += state.decode_rows[max(start - prompt_len, 0) : max(end - prompt_len, 0)]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    # ---- sampling --------------------------------------------------------------------------------
    def sampling_metadata(
        self, states: list[TalkerState], *, banned: list[int], prompt_codes: list[int] | None = None
    ) -> SamplingMetadata:
        """The talker's sampling: each request's settings, repetition over its own sampled
        codes (and ``prompt_codes``, where the reference penalises its prompt's too), ``banned``
        control ids suppressed."""
        params = [s.speech.sampling_params for s in states]
        codes = np.array(prompt_codes or [], np.int64)
        return build_sampling_metadata(
            self.device,
            temperature=np.array([0.0 if p.greedy else p.temperature for p in params]),
            top_p=np.array([p.top_p for p in params]),
            top_k=np.array([p.top_k for p in params]),
            min_p=np.zeros(len(params)),
            generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
            repetition=np.array([p.repetition_penalty for p in params]),
            seen_tokens=lambda rows: (
                np.broadcast_to(codes, (len(rows), len(codes))),
                padded([states[r].history for r in rows]),
            ),
            banned={i: banned for i in range(len(states))},
        )

    # ---- vocoder ---------------------------------------------------------------------------------
    def _stream(self, req_ids: list[str], states: list[TalkerState]) -> dict[str, SpeechStepOutput]:
        chunks, owners = [], []
        for req_id, state in zip(req_ids, states, strict=True):
            pending = len(state.codes) - state.vocoded_frames
            first = self.first_chunk_frames
            chunk = (
                None
                if first is None
                else min(max(first, state.vocoded_frames), self.max_chunk_frames)
            )
            if pending and (state.done or (chunk is not None and pending >= chunk)):
                if state.vocoder is None:
                    state.vocoder = self.new_vocoder_state(state)
                codes = torch.stack(state.codes[state.vocoded_frames :], dim=1)  # [groups, n]
                chunks.append((state.vocoder, codes.to(self.device)))
                owners.append(req_id)
                state.vocoded_frames = len(state.codes)
        audio = dict(zip(owners, self.vocoder.decode(chunks), strict=True))
        return {
            req_id: SpeechStepOutput(len(state.codes), state.done, audio.get(req_id))
            for req_id, state in zip(req_ids, states, strict=True)
        }
