"""omniserve's built-in models, one module per family; ``register`` is the built-in plugin."""

from __future__ import annotations

_MODELS = {
    "LlamaForCausalLM": "model_zoo.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "model_zoo.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "model_zoo.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "model_zoo.qwen3_moe:Qwen3MoeForCausalLM",
}


def register() -> None:
    """The "omniserve.plugins" entry point: map each architecture to its lazy class path."""
    from omniserve.registry import ModelRegistry

    for architecture, target in _MODELS.items():
        ModelRegistry.register_model(architecture, target)
