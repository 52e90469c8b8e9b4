"""omniserve's built-in models, one module per family; ``register`` is the built-in plugin.

Every class is importable as ``model_zoo.<family>:<HF architecture name>`` (e.g.
``model_zoo.qwen2:Qwen2ForCausalLM``), so a plugin can subclass a built-in model.
"""

from __future__ import annotations

_VISION = ("image", "video")
_OMNI = ("image", "video", "audio")

# architecture -> (lazy class path, input modalities besides text). The modalities are stated
# here so that `omniserve models` lists them without importing torch; a test checks them
# against each processor's get_supported_mm_limits.
_MODELS: dict[str, tuple[str, tuple[str, ...]]] = {
    "LlamaForCausalLM": ("model_zoo.llama:LlamaForCausalLM", ()),
    "Qwen2ForCausalLM": ("model_zoo.qwen2:Qwen2ForCausalLM", ()),
    "Qwen2VLForConditionalGeneration": (
        "model_zoo.qwen2_vl:Qwen2VLForConditionalGeneration",
        _VISION,
    ),
    "Qwen2_5_VLForConditionalGeneration": (
        "model_zoo.qwen2_5_vl:Qwen2_5_VLForConditionalGeneration",
        _VISION,
    ),
    "Qwen3VLForConditionalGeneration": (
        "model_zoo.qwen3_vl:Qwen3VLForConditionalGeneration",
        _VISION,
    ),
    "Qwen3VLMoeForConditionalGeneration": (
        "model_zoo.qwen3_vl:Qwen3VLMoeForConditionalGeneration",
        _VISION,
    ),
    "Qwen2AudioForConditionalGeneration": (
        "model_zoo.qwen2_audio:Qwen2AudioForConditionalGeneration",
        ("audio",),
    ),
    "Qwen3ForCausalLM": ("model_zoo.qwen3:Qwen3ForCausalLM", ()),
    "Qwen3MoeForCausalLM": ("model_zoo.qwen3_moe:Qwen3MoeForCausalLM", ()),
    "Qwen2ForSequenceClassification": (
        "model_zoo.classification:Qwen2ForSequenceClassification",
        (),
    ),
    "Qwen3ForSequenceClassification": (
        "model_zoo.classification:Qwen3ForSequenceClassification",
        (),
    ),
    "LlamaForSequenceClassification": (
        "model_zoo.classification:LlamaForSequenceClassification",
        (),
    ),
    "Qwen2_5OmniThinkerForConditionalGeneration": (
        "model_zoo.qwen2_5_omni_thinker:Qwen2_5OmniThinkerForConditionalGeneration",
        _OMNI,
    ),
    "Qwen2_5OmniForConditionalGeneration": (
        "model_zoo.qwen2_5_omni_thinker:Qwen2_5OmniForConditionalGeneration",
        _OMNI,
    ),
    "Qwen3OmniMoeThinkerForConditionalGeneration": (
        "model_zoo.qwen3_omni_moe_thinker:Qwen3OmniMoeThinkerForConditionalGeneration",
        _OMNI,
    ),
    "Qwen3OmniMoeForConditionalGeneration": (
        "model_zoo.qwen3_omni_moe_thinker:Qwen3OmniMoeForConditionalGeneration",
        _OMNI,
    ),
}


def register() -> None:
    """The "omniserve.plugins" entry point: map each architecture to its lazy class path."""
    from omniserve.registry import ModelRegistry

    for architecture, (target, modalities) in _MODELS.items():
        ModelRegistry.register_model(architecture, target, modalities=modalities)
