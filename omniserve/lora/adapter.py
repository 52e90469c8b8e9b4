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
from typing import Any, TypeVar

import torch
from safetensors.torch import load_file

from omniserve.lora.request import LoRARequest

_T = TypeVar("_T")
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")
_Patterns = list[tuple[re.Pattern[str], float]]
"""A ``rank_pattern`` / ``alpha_pattern``: (module path pattern, value), in PEFT's order."""


@dataclass(frozen=True)
class LoRAPair:
    """One adapted module: ``scaling * B @ A`` is what the adapter adds to its weight."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


def _number(value: Any, field: str, name: str, *, rank: bool = False) -> float:
    """``value`` of ``adapter_config.json``'s ``field`` as a finite number (a rank: an integer
    >= 1): JSON allows any value there, and a wrong one would fail deep in the arithmetic."""
    kinds = (int,) if rank else (int, float)
    number = isinstance(value, kinds) and not isinstance(value, bool) and math.isfinite(value)
    if not number or (rank and value < 1):
        kind = "an integer >= 1" if rank else "a finite number"
        raise ValueError(
            f"LoRA adapter {name!r}: adapter_config.json {field} must be {kind}, got {value!r}."
        )
    return value


def _patterns(config: dict[str, Any], field: str, name: str, *, rank: bool = False) -> _Patterns:
    """PEFT's ``rank_pattern`` / ``alpha_pattern``, checked whole: a key matches a module whose
    path ends with it (as a regular expression) at a dot boundary."""
    patterns = config.get(field)
    if patterns is None:
        return []
    if not isinstance(patterns, dict):
        raise ValueError(
            f"LoRA adapter {name!r}: adapter_config.json {field} must be an object "
            f"(module pattern -> value), got {patterns!r}."
        )
    compiled = []
    for key, value in patterns.items():
        try:
            pattern = re.compile(rf"(.*\.)?({key})$")
        except re.error as exc:
            raise ValueError(
                f"LoRA adapter {name!r}: adapter_config.json {field} key {key!r} is not a "
                f"regular expression: {exc}"
            ) from exc
        compiled.append((pattern, _number(value, f"{field}[{key!r}]", name, rank=rank)))
    return compiled


def _pattern_value(patterns: _Patterns, module: str, default: _T) -> float | _T:
    """The value of the first pattern matching ``module`` (PEFT's lookup), else ``default``."""
    return next((value for pattern, value in patterns if pattern.match(module)), default)


def _tensor_problem(tensor: torch.Tensor, part: str) -> str | None:
    """What makes a lora_A / lora_B tensor unusable: caught here, since such a tensor would
    load and then fail, or quietly change, every request that uses it."""
    if tensor.dim() != 2:
        return "is not a matrix"
    if not tensor.is_floating_point():
        dtype = str(tensor.dtype).removeprefix("torch.")
        return f"is {dtype}; LoRA weights must be floating point"
    if tensor.shape[0 if part == "A" else 1] == 0:
        return "has rank 0"
    values = tensor if tensor.element_size() > 1 else tensor.float()  # float8: no isfinite
    if not torch.isfinite(values).all():
        return "holds non-finite values (NaN/Inf)"
    return None


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
        "modules_to_save": (
            bool(config.get("modules_to_save")),
            "omniserve applies only low-rank deltas, not fully replaced modules",
        ),
    }
    for field, (bad, why) in unsupported.items():
        if bad:
            raise ValueError(
                f"LoRA adapter {name!r}: adapter_config.json {field}={config.get(field)!r} is "
                f"not supported ({why})."
            )
    return config


def read_adapter(lora: LoRARequest, max_rank: int) -> dict[str, LoRAPair]:
    """HF module path (e.g. ``model.layers.0.self_attn.q_proj``) -> its pair, on the CPU.

    Raises ValueError naming the adapter and what is wrong with it.
    """
    name, path = lora.lora_name, Path(lora.lora_path)
    config = _read_config(path, name)
    alpha = _number(config.get("lora_alpha", 8), "lora_alpha", name)
    alpha_pattern = _patterns(config, "alpha_pattern", name)
    # PEFT sizes each module from r / rank_pattern (and cannot load tensors of other ranks)
    r = _number(config["r"], "r", name, rank=True) if "r" in config else None
    rank_pattern = _patterns(config, "rank_pattern", name, rank=True)
    rslora = bool(config.get("use_rslora"))
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
        problem = _tensor_problem(tensor, match["part"])
        if problem is not None:
            raise ValueError(f"LoRA adapter {name!r}: {weights_file.name} tensor {key} {problem}.")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
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
        configured = _pattern_value(rank_pattern, module, r)
        if configured is not None and configured != rank:
            raise ValueError(
                f"LoRA adapter {name!r}: {module} has rank {rank}, but adapter_config.json "
                f"gives it r={configured}."
            )
        module_alpha = _pattern_value(alpha_pattern, module, alpha)
        scaling = module_alpha / (math.sqrt(rank) if rslora else rank)
        pairs[module] = LoRAPair(a, b, float(scaling))
    if not pairs:
        raise ValueError(f"LoRA adapter {name!r}: adapter_model.safetensors holds no weights.")
    return pairs
