"""The decoder shared by the Llama / Qwen2 / Qwen3 (incl. MoE) family.

Members differ only in biases, a per-head q/k RMSNorm and the MLP of a layer, so a model file is a
``DecoderSpec`` plus, for MoE, a ``make_mlp`` override. Module and parameter names follow the
Hugging Face checkpoints (``model.layers.N.self_attn...``, ``lm_head``), except the fused
``qkv_proj`` / ``gate_up_proj``, which ``load_weights`` fills from the separate checkpoint matrices.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from omniserve.attention import Attention
from omniserve.layers.activation import get_act_and_mul
from omniserve.layers.layernorm import RMSNorm
from omniserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from omniserve.layers.rotary_embedding import QKRotary, get_rope
from omniserve.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from omniserve.layers.weight_utils import (
    StackedParams,
    WeightRoute,
    load_weights_by_route,
    route_stacked,
)


@dataclass(frozen=True)
class DecoderSpec:
    """What distinguishes the members of the family."""

    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool = False
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before RoPE (Qwen3)."""


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config: PretrainedConfig, layer_idx: int) -> int | None:
    """The window of one layer, with transformers' rules: per ``layer_types`` when the config has
    them (Qwen2/Qwen3), else the global ``sliding_window`` (None unless enabled)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return config.sliding_window if layer_types[layer_idx] == "sliding_attention" else None
    return getattr(config, "sliding_window", None)


class DecoderAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, spec: DecoderSpec, layer_idx: int) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=spec.qkv_bias,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim, config.hidden_size, bias=spec.o_bias
        )
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if spec.qk_norm else None
        self.rotary = QKRotary()
        self.attn = Attention(
            self.num_heads,
            head_dim,
            head_dim**-0.5,
            self.num_kv_heads,
            sliding_window=sliding_window_of(config, layer_idx),
        )

    def forward(
        self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = self.qkv_proj(hidden_states).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        q, k = self.rotary(q, k, cos, sin, self.q_norm, self.k_norm)
        out = self.attn(q.flatten(1), k.flatten(1), v)  # [num_tokens, num_heads * head_dim]
        return self.o_proj(out)


class DecoderMLP(nn.Module):
    def __init__(
        self, config: PretrainedConfig, intermediate_size: int, bias: bool = False
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [intermediate_size, intermediate_size], bias=bias
        )
        self.down_proj = RowParallelLinear(intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = get_act_and_mul(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self, config: PretrainedConfig, spec: DecoderSpec, layer_idx: int, mlp: nn.Module
    ) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, spec, layer_idx)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        # transformers' rounding points: each residual add rounds before the norm that reads it
        # (add_forward may fuse the two; it rounds in the same place).
        attn_out = self.self_attn(self.input_layernorm(hidden_states), cos, sin)
        hidden_states, normed = self.post_attention_layernorm.add_forward(attn_out, hidden_states)
        return hidden_states + self.mlp(normed)


AfterLayer = Callable[[int, torch.Tensor], torch.Tensor]
"""(layer index, that layer's output) -> the hidden state the next layer gets."""


class DecoderModel(nn.Module):
    """Embeddings, the layer stack and the final norm (``model.*`` in the checkpoint)."""

    def __init__(
        self,
        config: PretrainedConfig,
        spec: DecoderSpec,
        mlps: list[nn.Module],
        rotary: nn.Module | None = None,
    ) -> None:
        """``rotary``: positions -> (cos, sin); None takes the one ``config`` describes (a
        model whose rotary the config does not spell out, e.g. an omni thinker, passes its own)."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, spec, i, mlp) for i, mlp in enumerate(mlps)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = rotary if rotary is not None else get_rope(config, head_dim_of(config))

    def embed(
        self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None
    ) -> torch.Tensor:
        """``inputs_embeds`` as given, else the embeddings of ``input_ids``."""
        if inputs_embeds is not None:
            return inputs_embeds
        if input_ids is None:
            raise ValueError("Pass input_ids or inputs_embeds.")
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
        after_layer: AfterLayer | None = None,
    ) -> torch.Tensor:
        """The normed last hidden state; ``after_layer(i, hidden)`` (a model's per-layer step,
        e.g. Qwen3-Omni's DeepStack) replaces layer i's output."""
        hidden_states = self.embed(input_ids, inputs_embeds)  # [num_tokens, hidden_size]
        cos, sin = self.rotary_emb(positions, hidden_states.dtype)  # [num_tokens, rotary_dim]
        for i, layer in enumerate(self.layers):
            hidden_states = layer(hidden_states, cos, sin)
            if after_layer is not None:
                hidden_states = after_layer(i, hidden_states)
        return self.norm(hidden_states)


class LanguageModel(nn.Module):
    """``model.*`` (a ``DecoderModel``) and ``lm_head``: what text and multimodal models share."""

    model: DecoderModel
    lm_head: ParallelLMHead

    def init_language_model(
        self,
        family: type[DecoderForCausalLM],
        config: PretrainedConfig,
        *,
        tie_word_embeddings: bool,
        rotary: nn.Module | None = None,
        lm_head: bool = True,
    ) -> None:
        """Build the decoder of text family ``family`` for ``config``, and its LM head unless
        the model has another head."""
        spec = family.decoder_spec(config)
        mlps = [family.make_mlp(config, spec, i) for i in range(config.num_hidden_layers)]
        self.model = DecoderModel(config, spec, mlps, rotary)
        if not lm_head:
            return
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """positions ``[num_tokens]``, or ``[3, num_tokens]`` for M-RoPE models."""
        return self.model(input_ids, positions, inputs_embeds)  # [num_tokens, hidden_size]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()  # [num_tokens, vocab_size]


class DecoderForCausalLM(LanguageModel, ABC):
    """Base of the family's ``*ForCausalLM`` classes; subclasses give ``decoder_spec``."""

    stacked_params: ClassVar[StackedParams] = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.init_language_model(type(self), config, tie_word_embeddings=config.tie_word_embeddings)

    @staticmethod
    @abstractmethod
    def decoder_spec(config: PretrainedConfig) -> DecoderSpec:
        """The family's variations (qkv bias, q/k norms, ...) read from its config."""

    @staticmethod
    def make_mlp(config: PretrainedConfig, spec: DecoderSpec, layer_idx: int) -> nn.Module:
        return DecoderMLP(config, config.intermediate_size, bias=spec.mlp_bias)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)  # [num_tokens, hidden_size]

    def route_weight(self, name: str) -> WeightRoute | None:
        """Checkpoint key -> (parameter, shard); None skips keys that carry no parameter."""
        if name.endswith("rotary_emb.inv_freq"):
            return None
        if self.config.tie_word_embeddings and name == "lm_head.weight":
            return None
        return route_stacked(name, self.stacked_params)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights_by_route(self, weights, self.route_weight)
