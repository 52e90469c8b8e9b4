"""Qwen2 / Qwen2.5 text models: biased q/k/v projections, unbiased o_proj and MLP."""

from __future__ import annotations

from transformers import PretrainedConfig

from model_zoo.decoder import DecoderForCausalLM, DecoderSpec


class Qwen2ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def decoder_spec(config: PretrainedConfig) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True, o_bias=False)
