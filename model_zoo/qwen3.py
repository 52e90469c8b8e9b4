"""Qwen3 dense text models: per-head RMSNorm on q and k, biases per ``attention_bias``."""

from __future__ import annotations

from transformers import PretrainedConfig

from model_zoo.decoder import DecoderForCausalLM, DecoderSpec


class Qwen3ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def decoder_spec(config: PretrainedConfig) -> DecoderSpec:
        return DecoderSpec(
            qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=True
        )
