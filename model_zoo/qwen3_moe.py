"""Qwen3-MoE: the Qwen3 decoder with sparse MoE MLPs (softmax top-k router, no shared expert)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from model_zoo.decoder import DecoderMLP, DecoderSpec
from model_zoo.qwen3 import Qwen3ForCausalLM
from omniserve.layers.fused_moe import FusedMoE, select_experts
from omniserve.layers.linear import ReplicatedLinear
from omniserve.layers.weight_utils import WeightRoute


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        # Qwen3-VL-MoE's config has no switch: its router always renormalises.
        self.norm_topk_prob = getattr(config, "norm_topk_prob", True)
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedMoE(
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(hidden_states)  # [num_tokens, num_experts]
        topk_weights, topk_ids = select_experts(
            router_logits, self.experts.top_k, self.norm_topk_prob
        )
        return self.experts(hidden_states, topk_weights, topk_ids)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @staticmethod
    def make_mlp(config: PretrainedConfig, spec: DecoderSpec, layer_idx: int) -> nn.Module:
        # transformers' rule: sparse unless listed in mlp_only_layers or off the sparse step.
        sparse = (
            layer_idx not in config.mlp_only_layers
            and config.num_experts > 0
            and (layer_idx + 1) % config.decoder_sparse_step == 0
        )
        if sparse:
            return Qwen3MoeSparseMoeBlock(config)
        return DecoderMLP(config, config.intermediate_size)

    def route_weight(self, name: str) -> WeightRoute | None:
        return FusedMoE.route_expert_weight(name) or super().route_weight(name)
