"""TalkerRunner: the speech stage of a step, after the thinker's forward.

It keeps each speaking request's worker-side state (the thinker's tapped hidden states at the
prompt's multimodal positions, the talker's inputs, the frames spoken, the vocoder's progress),
runs the talker over its own paged KV cache, completes each sampled code into a frame with the
code predictor (batched over rows), and streams the vocoder: a first chunk after
``FIRST_CHUNK_FRAMES`` frames (short time to first audio), then every ``CHUNK_FRAMES``, and the
rest when the talker is done. Which requests compute what comes from the scheduler
(``TalkerSchedulerOutput``); the model supplies the modules (``talker``, ``code2wav``,
``speech_config``, the thinker's embeddings and M-RoPE positions).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import torch
from torch import nn

from omniserve.attention.layer import get_attention_layers
from omniserve.attention.metadata import AttentionMetadata
from omniserve.core.request import SpeechRequest
from omniserve.core.sched_output import TEXT_END, SpeechStepOutput, TalkerSchedulerOutput
from omniserve.forward_context import set_forward_context
from omniserve.layers.sampler import Sampler, SamplingMetadata
from omniserve.multimodal.inputs import MultiModalFeatureSpec
from omniserve.worker.encoder_runner import mrope_positions

if TYPE_CHECKING:
    from model_zoo.qwen3_omni_moe_speech import Code2WavState

FIRST_CHUNK_FRAMES = 4
CHUNK_FRAMES = 25
# The code predictor's sampling when the talker samples (transformers hard-codes these).
PREDICTOR_TOP_K, PREDICTOR_TOP_P = 50, 0.8


@dataclass
class _ThinkerSide:
    """What the thinker leaves for a speaking request (registered when it is scheduled)."""

    prompt_token_ids: list[int]
    mm_features: list[MultiModalFeatureSpec]
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    """Prompt position -> the thinker's tapped hidden state there (multimodal positions)."""


@dataclass
class _TalkerState:
    speech: SpeechRequest
    thinker: _ThinkerSide
    generator: torch.Generator | None
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    text: list[int] = field(default_factory=list)
    prompt: torch.Tensor | None = None  # [prompt_len, hidden] talker prompt rows
    decode_rows: list[torch.Tensor] = field(default_factory=list)  # [1, hidden] per frame
    positions: torch.Tensor | None = None  # [3, prompt_len] M-RoPE positions of the prompt
    delta: int | float = 0
    codes: list[torch.Tensor] = field(default_factory=list)  # per frame [num_groups]
    code0: list[int] = field(default_factory=list)  # group-0 codes (the repetition history)
    done: bool = False
    vocoded_frames: int = 0
    vocoder: Code2WavState | None = None

    def buildable_inputs(self) -> int:
        """Inputs that can exist now: the prompt, then decode input j once frame j and reply
        entry j + 1 (or the end of the text) are known."""
        text_ended = TEXT_END in self.text
        decodes = len(self.codes) if text_ended else min(len(self.codes), len(self.text) - 1)
        return self.speech.prompt_len + max(decodes, 0)


class TalkerRunner:
    def __init__(self, model: nn.Module, block_size: int, device: torch.device) -> None:
        self.model = model
        self.talker = model.talker
        self.config = model.speech_config
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.thinker_sides: dict[str, _ThinkerSide] = {}
        self.states: dict[str, _TalkerState] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.vocoder = model.vocoder_stream()

    # ---- KV cache --------------------------------------------------------------------------
    def kv_cache_bytes_per_block(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return sum(2 * self.block_size * layer.num_kv_heads * layer.head_size * elem
                   for layer in get_attention_layers(self.talker))

    def initialize_kv_cache(self, num_blocks: int, dtype: torch.dtype) -> None:
        self.kv_caches = []
        for layer in get_attention_layers(self.talker):
            cache = torch.empty(2, num_blocks, self.block_size, layer.num_kv_heads,
                                layer.head_size, dtype=dtype, device=self.device)
            layer.kv_cache = cache
            self.kv_caches.append(cache)

    # ---- from the thinker --------------------------------------------------------------------
    def register(self, req_id: str, prompt_token_ids: list[int],
                 mm_features: list[MultiModalFeatureSpec]) -> None:
        """A speaking request reached the thinker (again, after a preemption: its taps stay)."""
        side = self.thinker_sides.get(req_id)
        if side is None:
            self.thinker_sides[req_id] = _ThinkerSide(list(prompt_token_ids), list(mm_features))

    def keep_hidden(self, req_id: str, positions: np.ndarray, rows: torch.Tensor) -> None:
        """Tapped thinker hidden states ``rows [n, H]`` at prompt ``positions``; only the
        multimodal ones are kept (text positions are read from the embeddings instead)."""
        side = self.thinker_sides.get(req_id)
        if side is None:
            return
        ids = side.prompt_token_ids
        for i, position in enumerate(positions.tolist()):
            if position >= len(ids):
                break  # generated tokens follow the prompt
            if ids[position] in self.config.mm_token_ids:
                side.hidden[position] = rows[i].clone()

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
            embeds.append(self._inputs(state, start, start + count))
            positions.append(mrope_positions(state.positions, state.delta, start, start + count,
                                             state.speech.prompt_len))
            table = np.asarray(state.block_ids, dtype=np.int64)
            pos = np.arange(start, start + count)
            slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            query_lens.append(count)
            seq_lens.append(start + count)
            state.num_computed = start + count
        max_blocks = max(-(-n // self.block_size) for n in seq_lens)
        tables = np.zeros((len(states), max_blocks), dtype=np.int64)
        for row, state in enumerate(states):
            used = state.block_ids[:max_blocks]
            tables[row, :len(used)] = used
        dev = self.device
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor(np.concatenate(([0], np.cumsum(query_lens))),
                                         dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_table=torch.from_numpy(tables).to(dev, torch.int32),
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)
        with set_forward_context(metadata):
            hidden = self.talker.model(None, torch.cat(positions, dim=1).to(dev),
                                       inputs_embeds=torch.cat(embeds))
        ends = np.cumsum(query_lens) - 1
        sampling = [i for i, state in enumerate(states)
                    if state.num_computed == state.buildable_inputs() and not state.done]
        if sampling:
            self._sample(req_ids, states, sampling, hidden[torch.from_numpy(ends[sampling])])
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
                state = _TalkerState(new.speech, self.thinker_sides[new.req_id], generator)
                self.states[new.req_id] = state
            state.block_ids, state.num_computed = list(new.block_ids), new.num_computed_tokens
        cached = so.cached_reqs
        for req_id, block_ids, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                   cached.num_computed_tokens, strict=True):
            state = self.states[req_id]
            state.block_ids.extend(block_ids)
            state.num_computed = num_computed
        for req_id, entries in so.new_text.items():
            self.states[req_id].text.extend(entries)

    # ---- inputs --------------------------------------------------------------------------------
    def _inputs(self, state: _TalkerState, start: int, end: int) -> torch.Tensor:
        """Talker input rows ``[start, end)``, building the prompt and decode rows on first use."""
        if state.prompt is None:
            state.prompt = self._prompt(state)
        prompt_len = state.speech.prompt_len
        while prompt_len + len(state.decode_rows) < end:
            j = len(state.decode_rows)  # decode input j: frame j plus reply entry j + 1
            frame = state.codes[j].to(self.device)
            row = self.talker.embed_codes(frame[:1], frame[None, 1:])
            state.decode_rows.append(row + self._text_row(state, j + 1))
        parts = [state.prompt[start:end]] if start < prompt_len else []
        parts += state.decode_rows[max(start - prompt_len, 0):max(end - prompt_len, 0)]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _project_text(self, token_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(token_ids, device=self.device)
        return self.talker.text_projection(self.model.model.embed_tokens(ids))

    def _text_row(self, state: _TalkerState, entry: int) -> torch.Tensor:
        if entry < len(state.text) and state.text[entry] != TEXT_END:
            return self._project_text([state.text[entry]])
        bos, eos, pad = self.config.tts_ids
        return self._project_text([eos if entry < len(state.text) else pad])

    def _prompt(self, state: _TalkerState) -> torch.Tensor:
        """The talker's prompt rows (see ``model_zoo.qwen3_omni_moe_speech``) and positions."""
        config, speech, side = self.config, state.speech, state.thinker
        ids = side.prompt_token_ids
        user_ids = [ids[p] for p in speech.user_positions]
        is_mm = torch.tensor([t in config.mm_token_ids for t in user_ids], dtype=torch.bool)
        hidden_size = self.talker.config.text_config.hidden_size
        dtype = self.talker.codec_head.weight.dtype
        user = torch.empty(len(user_ids), hidden_size, dtype=dtype, device=self.device)
        if (~is_mm).any():
            user[~is_mm] = self._project_text([t for t, m in zip(user_ids, is_mm.tolist(),
                                                                 strict=True) if not m])
        if is_mm.any():
            rows = [side.hidden[p] for p, m in zip(speech.user_positions, is_mm.tolist(),
                                                   strict=True) if m]
            user[is_mm] = self.talker.hidden_projection(torch.stack(rows).to(self.device))
        start = speech.text_start - 3
        bos, eos, pad = config.tts_ids
        text_side = self._project_text([*ids[start:start + 3], pad, pad, pad, pad, bos,
                                        state.text[0]])
        voice_id = config.speaker_ids[speech.voice]
        codec_ids = [*config.codec_prefix, voice_id, config.codec_pad_id, config.codec_bos_id]
        codec = self.talker.model.embed_tokens(torch.tensor(codec_ids, device=self.device))
        codec = torch.cat([codec.new_zeros(3, hidden_size), codec])
        self._prompt_positions(state, user_ids)
        return torch.cat([user, text_side + codec])

    def _prompt_positions(self, state: _TalkerState, user_ids: list[int]) -> None:
        """transformers' talker positions: M-RoPE over ``user ids + tts_pad x 9`` when the
        thinker had multimodal input, else sequential."""
        speech = state.speech
        talker_ids = [*user_ids, *[self.config.tts_pad_id] * (speech.prompt_len - len(user_ids))]
        where = {p: i for i, p in enumerate(speech.user_positions)}
        features = [msgspec.structs.replace(f, mm_position=msgspec.structs.replace(
                        f.mm_position, offset=where[f.mm_position.offset]))
                    for f in state.thinker.mm_features if f.mm_position.offset in where]
        if state.thinker.mm_features:
            state.positions, state.delta = self.model.get_mrope_input_positions(talker_ids,
                                                                                features)
        else:
            state.positions = torch.arange(speech.prompt_len).expand(3, -1)
            state.delta = 0

    # ---- sampling --------------------------------------------------------------------------------
    def _sample(self, req_ids: list[str], states: list[_TalkerState], rows: list[int],
                hidden: torch.Tensor) -> None:
        picked = [states[i] for i in rows]
        logits = self.talker.codec_head(hidden).float()
        code0 = self.sampler(logits, self._metadata(picked, talker=True)).sampled_token_ids
        speaking = [i for i, (state, code) in enumerate(zip(picked, code0.tolist(), strict=True))
                    if code != self.config.codec_eos_id]
        for state, code in zip(picked, code0.tolist(), strict=True):
            state.code0.append(code)
            if code == self.config.codec_eos_id:
                state.done = True
        if not speaking:
            return
        index = torch.tensor(speaking, device=hidden.device)
        rows_state = [picked[i] for i in speaking]
        first = code0[index]
        metadata = self._metadata(rows_state, talker=False)

        def pick(group_logits: torch.Tensor, group: int) -> torch.Tensor:
            return self.sampler(group_logits, metadata).sampled_token_ids

        rest = self.talker.code_predictor.predict(
            hidden[index], self.talker.model.embed_tokens(first), pick)
        for state, frame in zip(rows_state, torch.cat([first[:, None], rest], 1).cpu(),
                                strict=True):
            state.codes.append(frame)
            # transformers' cap: max_tokens talker tokens, the last of which gets no frame.
            if len(state.codes) >= state.speech.sampling_params.max_tokens - 1:
                state.done = True

    def _metadata(self, states: list[_TalkerState], talker: bool) -> SamplingMetadata:
        """The talker's sampling (its settings, repetition over its own codes, control ids
        suppressed) or the code predictor's (greedy, or top-k 50 / top-p 0.8, no penalties)."""
        n, dev = len(states), self.device
        params = [s.speech.sampling_params for s in states]
        greedy = [p.greedy for p in params]
        temperature = [0.0 if g else (p.temperature if talker else 1.0)
                       for g, p in zip(greedy, params, strict=True)]
        top_k = [p.top_k if talker else (0 if g else PREDICTOR_TOP_K)
                 for g, p in zip(greedy, params, strict=True)]
        top_p = [p.top_p if talker else (1.0 if g else PREDICTOR_TOP_P)
                 for g, p in zip(greedy, params, strict=True)]
        repetition = [p.repetition_penalty if talker else 1.0 for p in params]
        return SamplingMetadata(
            temperature=torch.tensor(temperature, device=dev),
            all_greedy=all(greedy), all_random=not any(greedy),
            top_p=None if all(p >= 1.0 for p in top_p) else torch.tensor(top_p, device=dev),
            top_k=None if not any(top_k) else torch.tensor(top_k, device=dev),
            min_p=None,
            generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
            max_num_logprobs=None,
            no_penalties=all(r == 1.0 for r in repetition),
            presence_penalties=torch.zeros(n, device=dev),
            frequency_penalties=torch.zeros(n, device=dev),
            repetition_penalties=torch.tensor(repetition, device=dev),
            prompt_token_ids=None,  # transformers penalises the talker's generated codes only
            output_token_ids=[s.code0 for s in states],
            min_tokens={},
            banned_token_ids={i: self.config.suppressed_ids for i in range(n)} if talker else {},
        )

    # ---- vocoder ---------------------------------------------------------------------------------
    def _stream(self, req_ids: list[str], states: list[_TalkerState]
                ) -> dict[str, SpeechStepOutput]:
        chunks, owners = [], []
        for req_id, state in zip(req_ids, states, strict=True):
            pending = len(state.codes) - state.vocoded_frames
            chunk = FIRST_CHUNK_FRAMES if state.vocoded_frames == 0 else CHUNK_FRAMES
            if pending and (state.done or pending >= chunk):
                if state.vocoder is None:
                    state.vocoder = self.vocoder.new_state()
                codes = torch.stack(state.codes[state.vocoded_frames:], dim=1)  # [groups, n]
                chunks.append((state.vocoder, codes.to(self.device)))
                owners.append(req_id)
                state.vocoded_frames = len(state.codes)
        audio = dict(zip(owners, self.vocoder.decode(chunks), strict=True))
        return {req_id: SpeechStepOutput(len(state.codes), state.done, audio.get(req_id))
                for req_id, state in zip(req_ids, states, strict=True)}
