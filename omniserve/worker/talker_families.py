"""What the speech stage does differently per model family: how the talker's prompt and decode
inputs are built from the thinker's side, how a frame is sampled, and which thinker hidden
states it reads. ``create_talker_runner`` picks the family the model names (``speech_family``).
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch
from torch import nn

from omniserve.core.sched_output import TEXT_END
from omniserve.layers.sampler import SamplingMetadata
from omniserve.worker.sampling_inputs import build_sampling_metadata
from omniserve.worker.talker_runner import TalkerRunner, TalkerState, ThinkerSide

# The code predictor's sampling when the talker samples (transformers hard-codes these).
PREDICTOR_TOP_K, PREDICTOR_TOP_P = 50, 0.8


class Qwen3OmniTalkerRunner(TalkerRunner):
    """Qwen3-Omni-MoE (see ``model_zoo.qwen3_omni_moe_speech`` for the reference's rules): the
    talker's prompt is the user turns (text projections of their embeddings, and at media
    positions projections of the hidden state tapped at ``accept_hidden_layer``) plus a fixed
    assistant prefix; a frame is a group-0 code completed by the code predictor; code2wav
    streams in chunks."""

    def wants_hidden(self, has_media: bool) -> bool:
        return has_media

    def keeps(self, side: ThinkerSide, position: int) -> bool:
        ids = side.prompt_token_ids
        return position < len(ids) and ids[position] in self.config.mm_token_ids

    def decode_row(self, state: TalkerState, j: int) -> torch.Tensor:
        frame = state.codes[j].to(self.device)
        row = self.talker.embed_codes(frame[:1], frame[None, 1:])
        return row + self._text_row(state, j + 1)

    def _project_text(self, token_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(token_ids, device=self.device)
        return self.talker.text_projection(self.model.model.embed_tokens(ids))

    def _text_row(self, state: TalkerState, entry: int) -> torch.Tensor:
        if entry < len(state.text) and state.text[entry] != TEXT_END:
            return self._project_text([state.text[entry]])
        bos, eos, pad = self.config.tts_ids
        return self._project_text([eos if entry < len(state.text) else pad])

    def build_prompt(self, state: TalkerState) -> torch.Tensor:
        config, speech, side = self.config, state.speech, state.thinker
        ids = side.prompt_token_ids
        user_ids = [ids[p] for p in speech.prompt_positions]
        is_mm = torch.tensor([t in config.mm_token_ids for t in user_ids], dtype=torch.bool)
        hidden_size = self.talker.config.text_config.hidden_size
        dtype = self.model.model.embed_tokens.activation_dtype
        user = torch.empty(len(user_ids), hidden_size, dtype=dtype, device=self.device)
        if (~is_mm).any():
            user[~is_mm] = self._project_text(
                [t for t, m in zip(user_ids, is_mm.tolist(), strict=True) if not m]
            )
        if is_mm.any():
            rows = [
                side.hidden[p]
                for p, m in zip(speech.prompt_positions, is_mm.tolist(), strict=True)
                if m
            ]
            user[is_mm] = self.talker.hidden_projection(torch.stack(rows).to(self.device))
        start = speech.text_start - 3
        bos, eos, pad = config.tts_ids
        text_side = self._project_text(
            [*ids[start : start + 3], pad, pad, pad, pad, bos, state.text[0]]
        )
        voice_id = config.speaker_ids[speech.voice]
        codec_ids = [*config.codec_prefix, voice_id, config.codec_pad_id, config.codec_bos_id]
        codec = self.talker.model.embed_tokens(torch.tensor(codec_ids, device=self.device))
        codec = torch.cat([codec.new_zeros(3, hidden_size), codec])
        self._prompt_positions(state, user_ids)
        return torch.cat([user, text_side + codec])

    def _prompt_positions(self, state: TalkerState, user_ids: list[int]) -> None:
        """transformers' talker positions: M-RoPE over ``user ids + tts_pad x 9`` when the
        thinker had multimodal input, else sequential."""
        speech = state.speech
        talker_ids = [*user_ids, *[self.config.tts_pad_id] * (speech.prompt_len - len(user_ids))]
        where = {p: i for i, p in enumerate(speech.prompt_positions)}
        features = [
            msgspec.structs.replace(
                f,
                mm_position=msgspec.structs.replace(
                    f.mm_position, offset=where[f.mm_position.offset]
                ),
            )
            for f in state.thinker.mm_features
            if f.mm_position.offset in where
        ]
        if state.thinker.mm_features:
            state.positions, state.delta = self.model.get_mrope_input_positions(
                talker_ids, features
            )
        else:
            state.positions = torch.arange(speech.prompt_len).expand(3, -1)
            state.delta = 0

    def sample_frames(self, states: list[TalkerState], hidden: torch.Tensor) -> None:
        logits = self.talker.codec_head(hidden).float()
        code0 = self.sampler(
            logits, self.sampling_metadata(states, banned=self.config.suppressed_ids)
        ).sampled_token_ids
        speaking = [i for i, code in enumerate(code0.tolist()) if code != self.config.codec_eos_id]
        for state, code in zip(states, code0.tolist(), strict=True):
            state.history.append(code)
            if code == self.config.codec_eos_id:
                state.done = True
        if not speaking:
            return
        index = torch.tensor(speaking, device=hidden.device)
        rows_state = [states[i] for i in speaking]
        first = code0[index]
        metadata = self._predictor_metadata(rows_state)

        def pick(group_logits: torch.Tensor, group: int) -> torch.Tensor:
            return self.sampler(group_logits, metadata).sampled_token_ids

        rest = self.talker.code_predictor.predict(
            hidden[index], self.talker.model.embed_tokens(first), pick
        )
        for state, frame in zip(
            rows_state, torch.cat([first[:, None], rest], 1).cpu(), strict=True
        ):
            state.codes.append(frame)
            # transformers' cap: max_tokens talker tokens, the last of which gets no frame.
            if len(state.codes) >= state.speech.max_tokens - 1:
                state.done = True

    def _predictor_metadata(self, states: list[TalkerState]) -> SamplingMetadata:
        """The code predictor's sampling: greedy, or top-k 50 / top-p 0.8 at temperature 1, with
        no penalties or suppressed ids."""
        greedy = np.array([s.speech.sampling_params.greedy for s in states])
        return build_sampling_metadata(
            self.device,
            temperature=np.where(greedy, 0.0, 1.0),
            top_p=np.where(greedy, 1.0, PREDICTOR_TOP_P),
            top_k=np.where(greedy, 0, PREDICTOR_TOP_K),
            min_p=np.zeros(len(states)),
            generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
        )


class Qwen2_5OmniTalkerRunner(TalkerRunner):
    """Qwen2.5-Omni (see ``model_zoo.qwen2_5_omni_speech``): the talker reads the thinker's
    input embedding plus final hidden state at every position before the reply and at each reply
    token; a frame is one codec token; token2wav decodes the whole answer at once (its DiT
    integrates an ODE over the whole mel sequence, so a chunk would not equal the one-shot
    decode), so audio arrives when the talker is done."""

    first_chunk_frames = None
    taps_output = True

    def wants_hidden(self, has_media: bool) -> bool:
        return True

    def keeps(self, side: ThinkerSide, position: int) -> bool:
        return True

    def _thinker_rows(
        self, side: ThinkerSide, token_ids: list[int], positions: list[int]
    ) -> torch.Tensor:
        """Embedding (zero at media placeholders, as the reference's talker input) plus the
        final hidden state at each thinker position, ``[n, thinker hidden]``; the hidden states
        read are dropped (each is read once)."""
        ids = torch.tensor(token_ids, device=self.device)
        embeds = self.model.model.embed_tokens(ids)
        is_mm = torch.tensor([t in self.config.mm_token_ids for t in token_ids], device=self.device)
        embeds = embeds.masked_fill(is_mm[:, None], 0)
        hidden = torch.stack([side.hidden.pop(p) for p in positions]).to(self.device)
        return embeds + hidden.to(embeds.dtype)

    def build_prompt(self, state: TalkerState) -> torch.Tensor:
        config, speech, side = self.config, state.speech, state.thinker
        ids = side.prompt_token_ids
        positions = list(speech.prompt_positions)
        text_ids = [ids[p] for p in positions]
        rows = self._thinker_rows(side, text_ids, positions)
        bos_id = config.voices[speech.voice].bos_token
        bos = self.model.model.embed_tokens(torch.tensor([bos_id], device=self.device))
        first = self._thinker_rows(side, [state.text[0]], [speech.text_start])
        codec = self.talker.codec_embedding(
            torch.tensor([config.codec_pad_id, config.codec_bos_id], device=self.device)
        )
        tail = torch.cat([bos.to(rows.dtype), first]) + codec.to(rows.dtype)
        talker_ids = [*text_ids, bos_id, state.text[0]]
        features = [f for f in side.mm_features if f.mm_position.offset < speech.text_start]
        if features:
            state.positions, state.delta = self.model.get_mrope_input_positions(
                talker_ids, features
            )
        else:
            state.positions = torch.arange(speech.prompt_len).expand(3, -1)
            state.delta = 0
        return self.talker.thinker_to_talker_proj(torch.cat([rows, tail]))

    def decode_row(self, state: TalkerState, j: int) -> torch.Tensor:
        entry = j + 1
        if entry < len(state.text) and state.text[entry] != TEXT_END:
            text = self._thinker_rows(
                state.thinker, [state.text[entry]], [state.speech.text_start + entry]
            )
        else:
            marker = self.config.text_eos_id if entry < len(state.text) else self.config.text_pad_id
            text = self.model.model.embed_tokens(torch.tensor([marker], device=self.device))
        code = self.talker.codec_embedding(state.codes[j].to(self.device))
        return self.talker.thinker_to_talker_proj(text + code.to(text.dtype))

    def sample_frames(self, states: list[TalkerState], hidden: torch.Tensor) -> None:
        config = self.config
        logits = self.talker.codec_head(hidden).float()
        metadata = self.sampling_metadata(
            states, banned=[config.codec_bos_id], prompt_codes=config.prompt_codes
        )
        codes = self.sampler(logits, metadata).sampled_token_ids.tolist()
        for state, code in zip(states, codes, strict=True):
            state.history.append(code)
            if code in config.codec_eos_ids:
                state.done = True
                continue
            state.codes.append(torch.tensor([code]))
            if len(state.codes) >= state.speech.max_tokens:
                state.done = True

    def new_vocoder_state(self, state: TalkerState) -> object:
        """The DiT's starting noise comes from the request's seed (the talker's, else a draw
        from the engine's RNG), so a seeded request speaks the same waveform every time."""
        seed = state.speech.sampling_params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        return self.vocoder.new_state(state.speech.voice, seed)


_FAMILIES: dict[str, type[TalkerRunner]] = {
    "qwen3_omni": Qwen3OmniTalkerRunner,
    "qwen2_5_omni": Qwen2_5OmniTalkerRunner,
}


def create_talker_runner(model: nn.Module, block_size: int, device: torch.device) -> TalkerRunner:
    return _FAMILIES[model.speech_family](model, block_size, device)
