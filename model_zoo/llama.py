"""Llama 2/3 (and Llama-architecture) models: biases per ``attention_bias`` / ``mlp_bias``."""

from __future__ import annotations

from transformers import PretrainedConfig

from model_zoo.decoder import DecoderForCausalLM, DecoderSpec


class LlamaForCausalLM(DecoderForCausalLM):
    @staticmethod
    def decoder_spec(config: PretrainedConfig) -> DecoderSpec:
        return DecoderSpec(
            qkv_bias=config.attention_bias, o_bias=config.attention_bias, mlp_bias=config.mlp_bias
        )
