"""Qwen3-Omni-MoE's speech half: the talker (an MoE decoder over codec tokens, paged like the
thinker but with its own KV cache), its code predictor and the code2wav vocoder.

How transformers' ``Qwen3OmniMoeForConditionalGeneration.generate`` speaks, which this serves:
- The talker's prompt: the *user turns* of the thinker's prompt (system and earlier assistant
  turns dropped), each token as ``text_projection(embedding)``, except multimodal positions,
  which take ``hidden_projection`` of the thinker's hidden state after layer
  ``accept_hidden_layer``; then 9 assistant positions: the text projections of
  ``<|im_start|>assistant\\n``, ``tts_pad`` x4, ``tts_bos`` and the first reply token, added to the
  codec embeddings ``[0, 0, 0, nothink, think_bos, think_eos, speaker, codec_pad, codec_bos]``.
- Each decode step feeds the sum of the 16 (``num_code_groups``) codebook embeddings of the frame
  just spoken plus one "trailing text" entry: the text projection of the next reply token, then
  ``tts_eos`` after the last one (the thinker's final token, its end-of-turn, is never spoken),
  then ``tts_pad`` for ever.
- Each sampled group-0 code is completed into a frame by the code predictor: a small dense decoder
  run ``num_code_groups - 1`` times on ``[talker's last hidden state, embedding of code 0]``, head
  ``g`` predicting group ``g + 1``. It has no KV cache across frames (every frame starts afresh),
  so here it runs batched over all rows with a dense per-call cache.
- code2wav turns ``[groups, frames]`` codes into 24 kHz samples (1920 per frame, less a fixed
  shortfall per call: ``Code2WavStream`` streams it exactly).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PretrainedConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from model_zoo.decoder import (
    DecoderForCausalLM,
    DecoderMLP,
    DecoderModel,
    DecoderSpec,
    head_dim_of,
)
from omniserve.layers.fused_moe import FusedMoE, select_experts
from omniserve.layers.layernorm import RMSNorm
from omniserve.layers.linear import ReplicatedLinear
from omniserve.layers.rotary_embedding import MRotaryEmbedding, get_rope, rotate_qk
from omniserve.layers.weight_utils import WeightRoute, route_stacked


class TalkerSparseMoeBlock(nn.Module):
    """Top-k experts plus a shared expert scaled by a sigmoid gate (transformers' talker MoE)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedMoE(
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
        )
        self.shared_expert = DecoderMLP(config, config.shared_expert_intermediate_size)
        self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert(hidden_states)
        topk_weights, topk_ids = select_experts(
            self.gate(hidden_states), self.experts.top_k, self.norm_topk_prob
        )
        out = self.experts(hidden_states, topk_weights, topk_ids)
        return out + torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared


class ResizeMLP(nn.Module):
    """Thinker width -> talker width (``text_projection`` / ``hidden_projection``)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        inner = config.text_config.intermediate_size
        self.linear_fc1 = ReplicatedLinear(config.thinker_hidden_size, inner, bias=True)
        self.linear_fc2 = ReplicatedLinear(inner, config.text_config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class CodePredictorLayer(nn.Module):
    """A Qwen3 decoder layer attending over a dense cache ``[B, kv_heads, T, head_dim]``."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        hidden, bias = config.hidden_size, config.attention_bias
        self.self_attn = nn.Module()
        attn = self.self_attn
        attn.q_proj = ReplicatedLinear(hidden, self.num_heads * self.head_dim, bias=bias)
        attn.k_proj = ReplicatedLinear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        attn.v_proj = ReplicatedLinear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        attn.o_proj = ReplicatedLinear(self.num_heads * self.head_dim, hidden, bias=bias)
        attn.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        attn.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = ReplicatedLinear(hidden, config.intermediate_size)
        self.mlp.up_proj = ReplicatedLinear(hidden, config.intermediate_size)
        self.mlp.down_proj = ReplicatedLinear(config.intermediate_size, hidden)
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: list[torch.Tensor],
        start: int,
    ) -> torch.Tensor:
        """x ``[B, T, H]`` at positions ``start..start+T``; ``cache`` ``[k, v]`` grows in place."""
        attn, (b, t, _) = self.self_attn, x.shape
        h = self.input_layernorm(x)
        q = attn.q_proj(h).view(b * t, self.num_heads, self.head_dim)
        k = attn.k_proj(h).view(b * t, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(h).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate_qk(q, k, cos, sin, attn.q_norm, attn.k_norm)
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if start:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        cache[:] = [k, v]
        # Rows of the batch are independent frames; within one, the new tokens are causal.
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=start == 0 and t > 1, enable_gqa=self.num_heads != self.num_kv_heads
        )
        x = x + attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        h = self.post_attention_layernorm(x)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


class CodePredictor(nn.Module):
    """``talker.code_predictor``: groups 1..G-1 of a frame from the talker's hidden state and the
    group-0 code, one group per pass, batched over frames (rows)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.num_groups = config.num_code_groups
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(
            CodePredictorLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.model.codec_embedding = nn.ModuleList(
            nn.Embedding(config.vocab_size, config.hidden_size) for _ in range(self.num_groups - 1)
        )
        self.lm_head = nn.ModuleList(
            ReplicatedLinear(config.hidden_size, config.vocab_size)
            for _ in range(self.num_groups - 1)
        )
        self.rotary_emb = get_rope(config, head_dim_of(config))

    def predict(
        self,
        talker_hidden: torch.Tensor,
        code0_embeds: torch.Tensor,
        pick: Callable[[torch.Tensor, int], torch.Tensor],
    ) -> torch.Tensor:
        """``[B, H]`` hidden + ``[B, H]`` group-0 embeddings -> codes ``[B, G-1]``; ``pick(logits
        [B, V], group)`` chooses each group's codes (greedy or sampled, per row)."""
        x = torch.stack([talker_hidden, code0_embeds], dim=1)  # [B, 2, H]
        caches: list[list[torch.Tensor]] = [[] for _ in self.model.layers]
        codes, start = [], 0
        for group in range(self.num_groups - 1):
            t = x.shape[1]
            positions = torch.arange(start, start + t, device=x.device)
            cos, sin = self.rotary_emb(positions, x.dtype)
            cos, sin = cos.repeat(x.shape[0], 1), sin.repeat(x.shape[0], 1)
            h = x
            for layer, cache in zip(self.model.layers, caches, strict=True):
                h = layer(h, cos, sin, cache, start)
            logits = self.lm_head[group](self.model.norm(h[:, -1])).float()  # [B, V]
            code = pick(logits, group)
            codes.append(code)
            start += t
            x = self.model.codec_embedding[group](code)[:, None]  # [B, 1, H]
        return torch.stack(codes, dim=1)

    def embed_frame(self, codes: torch.Tensor) -> torch.Tensor:
        """Sum of the embeddings of groups 1..G-1, ``codes [B, G-1]`` -> ``[B, H]``."""
        return sum(emb(codes[:, g]) for g, emb in enumerate(self.model.codec_embedding))


class Qwen3OmniMoeTalker(nn.Module):
    """``talker.*``: the codec decoder (paged attention with its own KV cache), the code predictor
    and the two projections from the thinker's width."""

    has_own_kv_cache = True
    """The thinker's KV sizing skips these layers; the talker runner gives them their cache."""

    stacked_params = DecoderForCausalLM.stacked_params

    def __init__(self, config: PretrainedConfig, rope: MRotaryEmbedding) -> None:
        """``rope``: the thinker family's M-RoPE, built from the talker's text config."""
        super().__init__()
        self.config = config
        text = config.text_config
        spec = DecoderSpec(qkv_bias=text.attention_bias, o_bias=text.attention_bias, qk_norm=True)
        self.model = DecoderModel(
            text, spec, [TalkerSparseMoeBlock(text) for _ in range(text.num_hidden_layers)], rope
        )
        self.codec_head = ReplicatedLinear(text.hidden_size, text.vocab_size)
        self.text_projection = ResizeMLP(config)
        self.hidden_projection = ResizeMLP(config)
        self.code_predictor = CodePredictor(config.code_predictor_config)
        self.num_groups = config.num_code_groups
        self.vocab_size = text.vocab_size

    def route_weight(self, name: str) -> WeightRoute | None:
        """A ``talker.``-less checkpoint key -> parameter (with shard)."""
        if name.endswith("rotary_emb.inv_freq"):
            return None
        if name == "model.codec_embedding.weight":
            return "model.embed_tokens.weight", ()
        if name.startswith("model."):
            return FusedMoE.route_expert_weight(name) or route_stacked(name, self.stacked_params)
        return name, ()

    def embed_codes(self, code0: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
        """A frame's next talker input: the sum of its groups' embeddings ``[B, H]``."""
        return self.model.embed_tokens(code0) + self.code_predictor.embed_frame(rest)


class Qwen3OmniMoeSpeechConfig:
    """The ids the talker's prompt is built from, read once from the full config."""

    def __init__(self, config: PretrainedConfig) -> None:
        talker = config.talker_config
        self.accept_hidden_layer: int = talker.accept_hidden_layer
        self.mm_token_ids = frozenset(
            (
                config.thinker_config.audio_token_id,
                config.thinker_config.image_token_id,
                config.thinker_config.video_token_id,
            )
        )
        self.tts_ids = (config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id)
        self.codec_prefix = (
            talker.codec_nothink_id,
            talker.codec_think_bos_id,
            talker.codec_think_eos_id,
        )
        self.codec_pad_id: int = talker.codec_pad_id
        self.codec_bos_id: int = talker.codec_bos_id
        self.codec_eos_id: int = talker.codec_eos_token_id
        self.tts_pad_id: int = config.tts_pad_token_id
        self.speaker_ids: dict[str, int] = dict(talker.speaker_id)
        vocab = talker.text_config.vocab_size
        # generate suppresses the last 1024 ids (control codes, speakers) except end-of-speech.
        self.suppressed_ids = [
            i for i in range(max(vocab - 1024, 0), vocab) if i != self.codec_eos_id
        ]


@dataclass
class Code2WavState:
    """One answer's place in the vocoder stream."""

    cache: DynamicCache
    """The code2wav transformer's keys and values (its sliding window)."""
    frames: int = 0
    """Frames through the transformer so far."""
    tail: torch.Tensor | None = None
    """``[1, <= context, hidden]`` the last transformer outputs: the convolutions' left context."""
    emitted: int = 0
    """Samples handed out so far."""


class Code2WavStream:
    """Streams code2wav exactly, in O(new frames) per chunk.

    The transformer runs incrementally over a KV cache (positions and the sliding window as in
    one pass over all frames). The convolutions after it see only a few frames back, so each
    chunk convolves its new transformer outputs with ``conv_context`` frames before them and
    hands out only samples that are final: one pass over ``n`` frames yields ``n * upsample -
    shortfall`` samples (the causal transposed convolutions trim their tails), so the last
    ``shortfall`` samples wait for the next frames. transformers' ``chunked_decode`` instead
    cuts every chunk at ``n * upsample`` and drops them at each boundary.
    """

    def __init__(self, code2wav: Qwen3OmniMoeCode2Wav, conv_context: int = 16) -> None:
        self.code2wav = code2wav
        self.upsample = int(code2wav.total_upsample)
        self.conv_context = conv_context
        device = code2wav.code_embedding.weight.device
        probe = torch.zeros(1, code2wav.config.num_quantizers, 2, dtype=torch.long, device=device)
        with torch.no_grad():
            self.shortfall = 2 * self.upsample - code2wav(probe).shape[-1]
        if conv_context * self.upsample <= self.shortfall:
            raise ValueError(
                f"conv_context={conv_context} frames is shorter than one chunk's "
                f"unfinished tail ({self.shortfall} samples)."
            )

    def new_state(self) -> Code2WavState:
        return Code2WavState(DynamicCache(config=self.code2wav.config))

    def decode(self, chunks: list[tuple[Code2WavState, torch.Tensor]]) -> list[np.ndarray]:
        """Each ``(state, new codes [groups, n])`` -> the samples that became final (batched
        through the convolutions, right-padded: they are causal)."""
        if not chunks:
            return []
        c2w, windows = self.code2wav, []
        for state, codes in chunks:
            embeds = c2w.code_embedding(codes[None] + c2w.code_offset).mean(1)  # [1, n, hidden]
            positions = torch.arange(
                state.frames, state.frames + codes.shape[1], device=codes.device
            )[None]
            hidden = c2w.pre_transformer(
                inputs_embeds=embeds, cache=state.cache, use_cache=True, position_ids=positions
            ).last_hidden_state
            window = hidden if state.tail is None else torch.cat([state.tail, hidden], dim=1)
            windows.append((window, state.frames + codes.shape[1] - window.shape[1]))
            state.frames += codes.shape[1]
            state.tail = window[:, -self.conv_context :]
        width = max(window.shape[1] for window, _ in windows)
        batch = torch.cat(
            [F.pad(window, (0, 0, 0, width - window.shape[1])) for window, _ in windows]
        )
        wave = self._convolve(batch)  # [B, width * upsample - shortfall]
        out = []
        for row, ((state, _), (_, first_frame)) in enumerate(zip(chunks, windows, strict=True)):
            first = first_frame * self.upsample
            end = state.frames * self.upsample - self.shortfall
            out.append(wave[row, state.emitted - first : end - first].float().cpu().numpy())
            state.emitted = end
        return out

    def _convolve(self, hidden: torch.Tensor) -> torch.Tensor:
        """code2wav's layers after its transformer (transformers' forward, from there on)."""
        hidden = hidden.permute(0, 2, 1)
        for blocks in self.code2wav.upsample:
            for block in blocks:
                hidden = block(hidden)
        for block in self.code2wav.decoder:
            hidden = block(hidden)
        return hidden.clamp(min=-1, max=1)[:, 0]
