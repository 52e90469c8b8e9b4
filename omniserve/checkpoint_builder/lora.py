"""A random LoRA adapter for a checkpoint, as PEFT saves one, for benchmarks.

It adapts every attention projection of the language model, and the MLP projections where they
are dense (not MoE experts), at the given rank: the adapter serving benchmarks measure (the
module names come from transformers' own class for the checkpoint, built on the meta device).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

_PROJECTION = re.compile(
    r"^(?P<prefix>(.*\.)?(model|language_model))\.layers\.\d+\."
    r"(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)$"
)
"""A decoder layer's projection (a tower's own ``layers`` sit under its name, e.g. ``visual``)."""
_TOWERS = ("visual", "audio_tower", "talker", "code2wav", "token2wav")


def is_decoder_projection(name: str) -> bool:
    """Whether module ``name`` is an attention or dense MLP projection of the language model."""
    return bool(_PROJECTION.match(name)) and not any(t in name.split(".") for t in _TOWERS)


def build_random_adapter(model_dir: str | Path, out_dir: str | Path, rank: int,
                         seed: int = 0) -> Path:  # fmt: skip
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` (bf16) into ``out_dir``:
    A ~ N(0, 1/in), B ~ N(0, 0.02^2), alpha = 2 * rank."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = getattr(transformers, config.architectures[0])._from_config(config)
    modules = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and is_decoder_projection(name)
    }
    if not modules:
        raise ValueError(f"{model_dir}: no decoder projections found to adapt.")
    prefixes = {m["prefix"] for m in map(_PROJECTION.match, modules) if m is not None}
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, module in modules.items():
        a = torch.randn(rank, module.in_features, generator=generator) / math.sqrt(
            module.in_features
        )
        b = torch.randn(module.out_features, rank, generator=generator) * 0.02
        tensors[f"base_model.model.{name}.lora_A.weight"] = a.to(torch.bfloat16)
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.to(torch.bfloat16)
    leaves = sorted({name.rsplit(".", 1)[1] for name in modules})
    # A regular expression (PEFT matches it whole): the leaf names alone would also take the
    # towers' projections of the same names.
    targets = (
        rf"({'|'.join(map(re.escape, sorted(prefixes)))})\.layers\.\d+\..*({'|'.join(leaves)})"
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "lora_dropout": 0.0, "target_modules": targets, "bias": "none", "use_rslora": False,
        "use_dora": False, "fan_in_fan_out": False, "inference_mode": True,
        "base_model_name_or_path": str(model_dir),
    }, indent=1))  # fmt: skip
    return out
