"""A LoRA adapter as PEFT saves it: ``adapter_config.json`` and ``adapter_model.safetensors``.

PEFT names each pair ``base_model.model.<module path>.lora_{A,B}.weight`` (A: ``[rank, in]``,
B: ``[out, rank]``) and computes ``base(x) + scaling * B(A(x))`` with ``scaling = alpha / rank``
(``alpha / sqrt(rank)`` for rsLoRA). Reading checks everything that does not depend on the model;
``layers.LoRAManager`` places the pairs on the model's layers.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from omniserve.lora.request import LoRARequest

_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")


@dataclass(frozen=True)
class LoRAPair:
    """One adapted module: ``scaling * B @ A`` is what the adapter adds to its weight."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup: a key matches a module whose path
    ends with it (as a regular expression) at a dot boundary."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_config(path: Path, name: str) -> dict[str, Any]:
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(
            f"LoRA adapter {name!r}: {path} has no adapter_config.json (a PEFT LoRA "
            "directory is expected)."
        )
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"LoRA adapter {name!r}: adapter_config.json is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {name!r}: adapter_config.json is not an object.")
    unsupported = {
        "peft_type": (config.get("peft_type", "LORA") != "LORA", "only LORA adapters load"),
        "use_dora": (bool(config.get("use_dora")), "DoRA adapters do not load"),
        "bias": (config.get("bias", "none") != "none", "adapters with biases do not load"),
        "fan_in_fan_out": (bool(config.get("fan_in_fan_out")), "only nn.Linear layouts load"),
    }
    for field, (bad, why) in unsupported.items():
        if bad:
            raise ValueError(
                f"LoRA adapter {name!r}: {field}={config.get(field)!r} is not supported ({why})."
            )
    return config


def read_adapter(lora: LoRARequest, max_rank: int) -> dict[str, LoRAPair]:
    """HF module path (e.g. ``model.layers.0.self_attn.q_proj``) -> its pair, on the CPU.

    Raises ValueError naming the adapter and what is wrong with it.
    """
    name, path = lora.lora_name, Path(lora.lora_path)
    config = _read_config(path, name)
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        hint = " (convert adapter_model.bin to safetensors)" if (
            path / "adapter_model.bin").is_file() else ""  # fmt: skip
        raise ValueError(f"LoRA adapter {name!r}: {path} has no adapter_model.safetensors{hint}.")
    try:
        tensors = load_file(weights_file)
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"LoRA adapter {name!r}: cannot read {weights_file}: {exc}") from exc
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(
                f"LoRA adapter {name!r}: tensor {key!r} is not a lora_A/lora_B weight "
                "(modules_to_save, embedding LoRA and DoRA magnitudes are not supported)."
            )
        if tensor.dim() != 2:
            raise ValueError(f"LoRA adapter {name!r}: {key} is not a matrix.")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    alpha = config.get("lora_alpha", 8)
    alpha_pattern = config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora"))
    pairs: dict[str, LoRAPair] = {}
    for module, ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: {module} lacks its lora_A or lora_B.")
        a, b = ab["A"], ab["B"]
        rank = a.shape[0]
        if b.shape[1] != rank:
            raise ValueError(
                f"LoRA adapter {name!r}: {module}'s lora_B has rank {b.shape[1]}, "
                f"its lora_A {rank}."
            )
        if rank > max_rank:
            raise ValueError(
                f"LoRA adapter {name!r}: {module} has rank {rank}, above --max-lora-rank "
                f"{max_rank}."
            )
        module_alpha = _pattern_value(alpha_pattern, module, alpha)
        scaling = module_alpha / (math.sqrt(rank) if rslora else rank)
        pairs[module] = LoRAPair(a, b, float(scaling))
    if not pairs:
        raise ValueError(f"LoRA adapter {name!r}: adapter_model.safetensors holds no weights.")
    return pairs
