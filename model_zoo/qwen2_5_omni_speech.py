"""Qwen2.5-Omni's speech half: the talker (a Qwen2 decoder over codec tokens with M-RoPE, paged
like the thinker but with its own KV cache) and token2wav (a DiT that integrates mel frames from
noise, then BigVGAN).

How transformers' ``Qwen2_5OmniForConditionalGeneration.generate`` speaks, which this serves:
- Every talker input is ``thinker_to_talker_proj`` of a thinker-width row. A thinker position's
  row is its input embedding (zero at media placeholders) plus the thinker's final hidden state
  there; the talker's prompt is the rows of every prompt position, then the voice's text bos
  embedding plus the ``codec_pad`` embedding, then the first reply token's row plus the
  ``codec_bos`` embedding; positions are the thinker's M-RoPE positions of
  ``prompt + [bos, first reply token]``.
- Decode input ``j`` is the codec embedding of code ``j`` plus reply entry ``j + 1``: the row of
  the next reply token, then the embedding of ``tts_text_end`` after the last one (the thinker's
  final token, its end-of-turn, is never spoken), then ``tts_text_pad`` for ever.
- Sampling: ``codec_bos`` suppressed, repetition penalty over the prompt's codec ids
  (``codec_mask``, ``codec_pad``, ``codec_bos``) and the codes so far, end at ``codec_pad`` or
  ``codec_end`` (the reference hard-codes the 7B's ids; these are the config's).
- token2wav: ``repeats`` mel frames per code, integrated by a 4th-order Runge-Kutta solver from
  Gaussian noise with classifier-free guidance, conditioned on the voice's vector and reference
  mel; it runs in fp32 whatever the thinker's dtype, as the reference does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniToken2WavModel,
    RungeKutta4ODESolver,
)

from model_zoo.decoder import DecoderForCausalLM, DecoderMLP, DecoderModel, DecoderSpec
from omniserve.layers.linear import ReplicatedLinear
from omniserve.layers.rotary_embedding import MRotaryEmbedding
from omniserve.layers.vocab_embedding import VocabParallelEmbedding
from omniserve.layers.weight_utils import WeightRoute, route_stacked


class Qwen2_5OmniTalker(nn.Module):
    """``talker.*``: the codec decoder (paged attention with its own KV cache), its codec
    embedding (thinker-wide) and the projection into the talker's width."""

    has_own_kv_cache = True
    """The thinker's KV sizing skips these layers; the talker runner gives them their cache."""

    def __init__(self, config: PretrainedConfig, rope: MRotaryEmbedding) -> None:
        super().__init__()
        self.config = config
        spec = DecoderSpec(qkv_bias=True, o_bias=False)
        self.model = DecoderModel(
            config,
            spec,
            [DecoderMLP(config, config.intermediate_size) for _ in range(config.num_hidden_layers)],
            rope,
        )
        # The codec ids embed at the thinker's width (they are added to thinker rows).
        self.model.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.embedding_size)
        self.thinker_to_talker_proj = ReplicatedLinear(
            config.embedding_size, config.hidden_size, bias=True
        )
        self.codec_head = ReplicatedLinear(config.hidden_size, config.vocab_size)

    @property
    def codec_embedding(self) -> nn.Module:
        return self.model.embed_tokens

    def route_weight(self, name: str) -> WeightRoute | None:
        """A ``talker.``-less checkpoint key -> parameter (with shard)."""
        if name.endswith("rotary_emb.inv_freq"):
            return None
        if name.startswith("model."):
            return route_stacked(name, DecoderForCausalLM.stacked_params)
        return name, ()


@dataclass(frozen=True)
class Voice:
    bos_token: int
    """The thinker-vocabulary id whose embedding opens the talker's reply (per voice)."""
    cond: torch.Tensor
    """``[1, enc_emb_dim]`` the DiT's speaker vector."""
    ref_mel: torch.Tensor
    """``[1, frames, mel_dim]`` the DiT's reference mel."""


class Qwen2_5OmniSpeechConfig:
    """The ids the talker's inputs and stops are built from, and the voices (``spk_dict.pt``)."""

    def __init__(self, config: PretrainedConfig, voices: dict[str, Voice]) -> None:
        talker, thinker = config.talker_config, config.thinker_config
        self.mm_token_ids = frozenset(
            (thinker.audio_token_index, thinker.image_token_index, thinker.video_token_index)
        )
        self.codec_pad_id: int = talker.tts_codec_pad_token_id
        self.codec_bos_id: int = talker.tts_codec_start_token_id
        self.codec_eos_ids = frozenset(
            (talker.tts_codec_pad_token_id, talker.tts_codec_end_token_id)
        )
        self.prompt_codes = [
            talker.tts_codec_mask_token_id,
            talker.tts_codec_pad_token_id,
            talker.tts_codec_start_token_id,
        ]
        self.text_eos_id: int = talker.tts_text_end_token_id
        self.text_pad_id: int = talker.tts_text_pad_token_id
        self.voices = voices


def load_voices(model_dir: str | Path) -> dict[str, Voice]:
    path = Path(model_dir) / "spk_dict.pt"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: a Qwen2.5-Omni checkpoint keeps its voices "
            "there (or serve it with --disable-audio-output)."
        )
    return {
        name: Voice(int(v["bos_token"]), v["cond"].float(), v["ref_mel"].float())
        for name, v in torch.load(path, weights_only=True, map_location="cpu").items()
    }


@dataclass
class Token2WavState:
    voice: Voice
    seed: int


class Token2WavOnce:
    """token2wav over a whole answer's codes, with the starting noise drawn from the request's
    own generator (the reference draws it from the global RNG: a test seeds both alike)."""

    def __init__(
        self,
        token2wav: Qwen2_5OmniToken2WavModel,
        voices: dict[str, Voice],
        num_steps: int = 10,
        guidance_scale: float = 0.5,
        sway_coefficient: float = -1.0,
    ) -> None:
        self.token2wav = token2wav
        self.voices = voices
        self.num_steps, self.guidance_scale = num_steps, guidance_scale
        self.sway_coefficient = sway_coefficient

    def new_state(self, voice: str, seed: int) -> Token2WavState:
        return Token2WavState(self.voices[voice], seed)

    def decode(self, chunks: list[tuple[Token2WavState, torch.Tensor]]) -> list[np.ndarray]:
        """Each ``(state, whole answer's codes [1, n])`` -> its waveform (one at a time: lengths
        differ and each starts from its own noise)."""
        return [self._wave(state, codes).float().cpu().numpy() for state, codes in chunks]

    def _wave(self, state: Token2WavState, codes: torch.Tensor) -> torch.Tensor:
        dit = self.token2wav.code2wav_dit_model
        device = dit.proj_out.weight.device
        duration = codes.shape[1] * dit.repeats
        if duration > dit.config.max_position_embeddings:
            raise ValueError(
                f"{codes.shape[1]} codes exceed token2wav's "
                f"{dit.config.max_position_embeddings // dit.repeats}."
            )
        generator = torch.Generator(device=device).manual_seed(state.seed)
        noise = torch.randn(1, duration, dit.mel_dim, generator=generator, device=device)
        cond = state.voice.cond.to(device)[:, None].expand(1, duration, -1)
        ref_mel = state.voice.ref_mel.to(device)
        codes = codes.to(device)

        def velocity(time: torch.Tensor, mel: torch.Tensor) -> torch.Tensor:
            out = dit(
                hidden_states=mel,
                quantized_code=codes,
                speaker_embedding=cond,
                condition_vector=ref_mel,
                time_step=time,
                apply_cfg=True,
            )
            guided, unconditioned = out.chunk(2)
            return guided + (guided - unconditioned) * self.guidance_scale

        times = torch.linspace(0, 1, self.num_steps, device=device)
        times += self.sway_coefficient * (torch.cos(math.pi / 2 * times) - 1 + times)
        mel = RungeKutta4ODESolver(velocity, noise).integrate(times)[-1]
        return self.token2wav.code2wav_bigvgan_model(mel.permute(0, 2, 1)).reshape(-1)
