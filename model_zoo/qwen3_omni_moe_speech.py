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

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from model_zoo.decoder import DecoderMLP, DecoderModel, DecoderSpec, head_dim_of
from omniserve.layers.fused_moe import FusedMoE, select_experts
from omniserve.layers.layernorm import RMSNorm
from omniserve.layers.linear import ReplicatedLinear
from omniserve.layers.rotary_embedding import get_rope, rotate_qk
from omniserve.layers.weight_utils import WeightRoute, route_stacked


class TalkerSparseMoeBlock(nn.Module):
    """Top-k experts plus a shared expert scaled by a sigmoid gate (transformers' talker MoE)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedMoE(config.num_experts, config.hidden_size,
                                config.moe_intermediate_size)
        self.shared_expert = DecoderMLP(config, config.shared_expert_intermediate_size)
        self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert(hidden_states)
        topk_weights, topk_ids = select_experts(self.gate(hidden_states), self.top_k,
                                                self.norm_topk_prob)
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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: list[torch.Tensor], start: int) -> torch.Tensor:
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
        out = F.scaled_dot_product_attention(q, k, v, is_causal=start == 0 and t > 1,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
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
        self.model.layers = nn.ModuleList(CodePredictorLayer(config)
                                          for _ in range(config.num_hidden_layers))
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.model.codec_embedding = nn.ModuleList(
            nn.Embedding(config.vocab_size, config.hidden_size)
            for _ in range(self.num_groups - 1))
        self.lm_head = nn.ModuleList(ReplicatedLinear(config.hidden_size, config.vocab_size)
                                     for _ in range(self.num_groups - 1))
        self.rotary_emb = get_rope(config, head_dim_of(config))

    def predict(self, talker_hidden: torch.Tensor, code0_embeds: torch.Tensor,
                pick: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
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

    stacked_params = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, config: PretrainedConfig) -> None:
        from model_zoo.qwen2_5_omni_thinker import thinker_rope
        from model_zoo.qwen3_omni_moe_thinker import InterleavedMRotaryEmbedding

        super().__init__()
        self.config = config
        text = config.text_config
        spec = DecoderSpec(qkv_bias=text.attention_bias, o_bias=text.attention_bias,
                           qk_norm=True)
        self.model = DecoderModel(
            text, spec, [TalkerSparseMoeBlock(text) for _ in range(text.num_hidden_layers)])
        self.model.rotary_emb = thinker_rope(text, [24, 20, 20], InterleavedMRotaryEmbedding)
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
            (config.thinker_config.audio_token_id, config.thinker_config.image_token_id,
             config.thinker_config.video_token_id))
        self.tts_ids = (config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id)
        self.codec_prefix = (talker.codec_nothink_id, talker.codec_think_bos_id,
                             talker.codec_think_eos_id)
        self.codec_pad_id: int = talker.codec_pad_id
        self.codec_bos_id: int = talker.codec_bos_id
        self.codec_eos_id: int = talker.codec_eos_token_id
        self.tts_pad_id: int = config.tts_pad_token_id
        self.speaker_ids: dict[str, int] = dict(talker.speaker_id)
        vocab = talker.text_config.vocab_size
        # generate suppresses the last 1024 ids (control codes, speakers) except end-of-speech.
        self.suppressed_ids = [i for i in range(max(vocab - 1024, 0), vocab)
                               if i != self.codec_eos_id]


class Code2WavStream:
    """Streams code2wav exactly: a chunk decodes its new frames with ``left_context`` frames before
    them and emits only samples that are final.

    One code2wav call on ``n`` frames returns ``n * upsample - shortfall`` samples (its causal
    transposed convolutions trim their tails), so the last ``shortfall`` samples of a window are
    not final until more frames arrive; cutting every chunk at ``n * upsample`` (what transformers'
    ``chunked_decode`` does) drops them at each boundary. With a left context at least the
    vocoder's receptive field, the concatenated stream equals a one-shot decode.
    """

    def __init__(self, code2wav: Qwen3OmniMoeCode2Wav, left_context: int) -> None:
        self.code2wav = code2wav
        self.upsample = int(code2wav.total_upsample)
        self.left_context = left_context
        probe = torch.zeros(1, code2wav.config.num_quantizers, 2, dtype=torch.long,
                            device=code2wav.code_embedding.weight.device)
        with torch.no_grad():
            self.shortfall = 2 * self.upsample - code2wav(probe).shape[-1]

    def decode(self, windows: list[tuple[torch.Tensor, int, int, bool]]) -> list[np.ndarray]:
        """Each ``(codes [G, frames], emitted, start_frame, final)``: decode
        ``codes[:, start_frame:]`` (batched, right-padded: the vocoder is causal) and return the
        samples from ``emitted`` up to what is final (all of it when ``final``)."""
        if not windows:
            return []
        lengths = [codes.shape[1] - start for codes, _, start, _ in windows]
        width = max(lengths)
        batch = torch.stack([F.pad(codes[:, start:], (0, width - codes.shape[1] + start))
                             for codes, _, start, _ in windows])
        wave = self.code2wav(batch)[:, 0].float()  # [B, width * up - shortfall]
        out = []
        for row, (codes, emitted, start, _final) in enumerate(windows):
            end = codes.shape[1] * self.upsample - self.shortfall  # final samples, all frames
            first = start * self.upsample
            out.append(wave[row, emitted - first:end - first].cpu().numpy())
        return out

    def window_start(self, emitted_frames: int) -> int:
        """First frame to decode when frames before ``emitted_frames`` were already streamed."""
        return max(emitted_frames - self.left_context, 0)


def code2wav_receptive_context(config: PretrainedConfig) -> int:
    """Left context (frames) for ``Code2WavStream``: the transformer's attention window per layer
    plus the convolutions' few frames. Exact for one layer; deeper stacks see further in
    principle, but attention weight that far back is negligible (measured in the tests)."""
    return config.sliding_window * max(config.num_hidden_layers, 1) + 8
