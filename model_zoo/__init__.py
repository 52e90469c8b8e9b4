"""omniserve's built-in models, one module per family; ``register`` is the built-in plugin."""

from __future__ import annotations

_MODELS = {
    "LlamaForCausalLM": "model_zoo.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "model_zoo.qwen2:Qwen2ForCausalLM",
    "Qwen2VLForConditionalGeneration": "model_zoo.qwen2_vl:Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": "model_zoo.qwen2_5_vl:Qwen2_5_VLForConditionalGeneration",
    "Qwen2AudioForConditionalGeneration": (
        "model_zoo.qwen2_audio:Qwen2AudioForConditionalGeneration"
    ),
    "Qwen3ForCausalLM": "model_zoo.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "model_zoo.qwen3_moe:Qwen3MoeForCausalLM",
    "Qwen2_5OmniThinkerForConditionalGeneration": (
        "model_zoo.qwen2_5_omni_thinker:Qwen2_5OmniThinkerForConditionalGeneration"
    ),
    "Qwen2_5OmniForConditionalGeneration": (
        "model_zoo.qwen2_5_omni_thinker:Qwen2_5OmniForConditionalGeneration"
    ),
    "Qwen3OmniMoeThinkerForConditionalGeneration": (
        "model_zoo.qwen3_omni_moe_thinker:Qwen3OmniMoeThinkerForConditionalGeneration"
    ),
    "Qwen3OmniMoeForConditionalGeneration": (
        "model_zoo.qwen3_omni_moe_thinker:Qwen3OmniMoeForConditionalGeneration"
    ),
}


def register() -> None:
    """The "omniserve.plugins" entry point: map each architecture to its lazy class path."""
    from omniserve.registry import ModelRegistry

    for architecture, target in _MODELS.items():
        ModelRegistry.register_model(architecture, target)
