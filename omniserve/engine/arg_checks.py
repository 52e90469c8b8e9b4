"""Checks of user-given settings before anything is built from them: the command line's ranges
(argparse types) and vLLM's settings that mean nothing here, so a mistake is an error naming the
setting instead of a traceback in whatever first uses it (the Python API's types:
``omniserve.field_types``)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import typing
from typing import Any

logger = logging.getLogger(__name__)


def number_in(
    kind: type, low: float | None = None, high: float | None = None
) -> typing.Callable[[str], Any]:
    """An argparse ``type``: an int (or float) within [low, high]; argparse reports a
    miss as "argument --flag: <why>" and exits 2."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {_article(kind)}") from None
        lowest = -math.inf if low is None else low
        highest = math.inf if high is None else high
        if not lowest <= value <= highest:  # NaN too; inf where there is no upper bound
            raise argparse.ArgumentTypeError(f"{text} is not in [{lowest:g}, {highest:g}]")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def token_count(text: str) -> int:
    """An argparse ``type`` for a number of tokens in vLLM's forms: 32768, 32k (x 1000), 32K
    (x 1024), 1.5m, 1M."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of tokens (e.g. 32768, 32k)")
    unit = match.group(2)
    scale = (1024 if unit.isupper() else 1000) ** (" kmg".index(unit.lower()) if unit else 0)
    value = float(match.group(1)) * scale
    if value != int(value) or value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens >= 1")
    return int(value)


def _article(kind: type) -> str:
    return "an integer" if kind is int else "a number"


def json_str_list(text: str) -> list[str]:
    """An argparse ``type``: a JSON list of strings (a bare string would reach Starlette's CORS
    check as a string, which tests substrings)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f'{text} is not a JSON list of strings, e.g. ["*"]')
    return value


NO_EFFECT_FLAGS: dict[str, tuple[dict, str]] = {
    "--trust-remote-code": (
        {"action": "store_true"},
        "no code from checkpoints runs: omniserve's model classes load them",
    ),
    "--disable-log-requests": (
        {"action": "store_true"},
        "requests are logged only with --enable-log-requests",
    ),
    "--swap-space": ({"type": float}, "preempted requests are recomputed, never swapped"),
    "--disable-custom-all-reduce": (
        {"action": "store_true"},
        "tensor parallelism uses torch.distributed's all-reduce",
    ),
    "--tokenizer-mode": ({"choices": ["auto", "hf"]}, "the Hugging Face tokenizer is used"),
    "--load-format": ({"choices": ["auto", "safetensors"]}, "safetensors is the only format"),
    "--download-dir": ({}, "nothing is downloaded: models are local directories"),
    "--revision": ({}, "models are local directories, read as they are"),
    "--tokenizer-revision": ({}, "tokenizers are read from local directories as they are"),
    "--code-revision": ({}, "no code from checkpoints runs"),
    "--hf-token": ({}, "nothing is downloaded from the Hugging Face hub"),
    "--disable-frontend-multiprocessing": (
        {"action": "store_true"},
        "the API server and the engine's front end share one process already",
    ),
    "--enable-prompt-tokens-details": (
        {"action": "store_true"},
        "usage always carries prompt_tokens_details",
    ),
    "--max-parallel-loading-workers": (
        {"type": int},
        "each worker reads its checkpoint with parallel threads already",
    ),
    "--safetensors-load-strategy": ({}, "tensors are read as the loader asks for them"),
    "--model-impl": ({"choices": ["auto", "vllm"]}, "omniserve's own model classes run"),
    "--show-hidden-metrics-for-version": ({}, "every metric is shown"),
    "--guided-decoding-backend": (
        {"choices": ["auto", "xgrammar"]},
        "xgrammar is the one structured-output backend",
    ),
    "--response-role": ({"choices": ["assistant"]}, "answers are the assistant's"),
    "--mm-processor-cache-type": (
        {"choices": ["lru"]},
        "the processor cache is an LRU in the API server's process",
    ),
    "--interleave-mm-strings": (
        {"action": "store_true"},
        "'string'-format chat content always keeps its parts' order (each media placeholder "
        "where its part sits)",
    ),
    "--api-server-count": ({"type": int, "choices": [1]}, "one API server process serves"),
    "--max-seq-len-to-capture": (
        {"type": int},
        "decode graphs are captured per batch size, for any sequence length",
    ),
    "--preemption-mode": ({"choices": ["recompute"]}, "preempted requests are recomputed"),
    "--disable-cascade-attn": ({"action": "store_true"}, "there is no cascade attention"),
    "--disable-hybrid-kv-cache-manager": (
        {"action": "store_true"},
        "one KV cache manager serves every layer",
    ),
    "--ignore-patterns": ({"nargs": "+"}, "nothing is downloaded: models are local directories"),
    "--config-format": (
        {"choices": ["auto", "hf"]},
        "config.json is read as transformers reads it",
    ),
    "--pt-load-map-location": ({}, "safetensors is the only format"),
    "--tokenizer-pool-size": (
        {"type": int},
        "prompts are tokenized in the front end's input threads",
    ),
    "--lora-dtype": ({"choices": ["auto"]}, "LoRA slots are in the model's dtype"),
    "--mamba-cache-dtype": ({"choices": ["auto"]}, "no model here has Mamba layers"),
    "--mamba-ssm-cache-dtype": ({"choices": ["auto"]}, "no model here has Mamba layers"),
    "--mm-shm-cache-max-object-size-mb": (
        {"type": int},
        "the processor cache is an LRU in the API server's process",
    ),
    "--num-lookahead-slots": ({"type": int}, "speculative decoding sizes its own KV slots"),
}
"""vLLM's flags that mean nothing here: accepted, each logged once with why."""
MISSING_FEATURE_FLAGS: dict[str, tuple[dict, str]] = {
    "--cpu-offload-gb": ({"type": float}, "weight offloading"),
    "--kv-transfer-config": ({}, "KV transfer between instances"),
    "--collect-detailed-traces": (
        {},
        "detailed (model forward and execute) trace spans; --otlp-traces-endpoint traces requests",
    ),
    "--headless": ({"action": "store_true"}, "an engine without an API server (multi-node)"),
    "--data-parallel-address": ({}, "multi-node data parallelism"),
    "--data-parallel-rpc-port": ({"type": int}, "multi-node data parallelism"),
    "--data-parallel-start-rank": ({"type": int}, "multi-node data parallelism"),
    "--data-parallel-hybrid-lb": ({"action": "store_true"}, "multi-node data parallelism"),
    "--enable-eplb": ({"action": "store_true"}, "expert-parallel load balancing"),
    "--enable-dbo": ({"action": "store_true"}, "dual batch overlap"),
    "--enable-lora-bias": ({"action": "store_true"}, "LoRA adapters with biases"),
    "--fully-sharded-loras": ({"action": "store_true"}, "fully sharded LoRA layers"),
    "--model-loader-extra-config": ({}, "model loader settings"),
    "--kv-sharing-fast-prefill": ({"action": "store_true"}, "KV-sharing fast prefill"),
    "--tool-server": ({}, "tool servers for the Responses API"),
    "--tokens-only": ({"action": "store_true"}, "a tokens-only server"),
    "--rope-scaling": ({}, "the older rope flags (--hf-overrides sets rope_scaling)"),
    "--rope-theta": ({"type": float}, "the older rope flags (--hf-overrides sets rope_theta)"),
    "--logits-processor-pattern": ({}, "per-request logits processors"),
    "--override-attention-dtype": ({}, "an attention dtype of its own"),
    "--io-processor-plugin": ({}, "input/output processor plugins"),
    "--decode-context-parallel-size": ({"type": int}, "decode context parallelism"),
    "--data-parallel-rank": ({"type": int}, "multi-node data parallelism"),
    "--data-parallel-size-local": ({"type": int}, "multi-node data parallelism"),
    "--data-parallel-backend": ({}, "multi-node data parallelism"),
    "--dbo-decode-token-threshold": ({"type": int}, "dual batch overlap"),
    "--eplb-config": ({}, "expert-parallel load balancing"),
    "--ray-workers-use-nsight": ({"action": "store_true"}, "Nsight profiling of Ray workers"),
    "--lora-extra-vocab-size": ({"type": int}, "LoRA adapters with extra vocabulary"),
    "--additional-config": ({}, "platform-specific settings"),
}
"""vLLM's flags for features omniserve does not have: start-up fails naming the feature."""


def check_vllm_only(values: dict[str, Any]) -> None:
    """vLLM's settings among ``values`` (keyed as ``EngineArgs``' fields are): those of
    ``MISSING_FEATURE_FLAGS`` fail naming the feature, those of ``NO_EFFECT_FLAGS`` are logged
    with why they change nothing (the CLI and ``LLM(**kwargs)`` alike)."""
    for flags, missing in ((MISSING_FEATURE_FLAGS, True), (NO_EFFECT_FLAGS, False)):
        for flag, (spec, why) in flags.items():
            value = values.get(_dest(flag))
            if _asks_nothing(value):
                continue
            if missing:
                raise ValueError(f"{flag}: {why} is not implemented in omniserve.")
            if "choices" in spec and value not in spec["choices"]:
                raise ValueError(f"{flag} must be one of {spec['choices']}, not {value!r}.")
            logger.info("%s has no effect here: %s.", flag, why)


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def _asks_nothing(value: object) -> bool:
    """A setting's value that turns its feature off: unset, false or 0."""
    return value is None or value is False or value == 0


TASK_RUNNERS = {"auto": "auto", "generate": "generate", "transcription": "generate",
                "embed": "pooling", "embedding": "pooling", "classify": "pooling",
                "score": "pooling", "reward": "pooling"}  # fmt: skip
"""vLLM's older ``--task`` values and the ``--runner`` each is."""


RENAMED_SETTINGS = {"kv_cache_memory_bytes": "kv_cache_memory",
                    "override_pooler_config": "pooler_config"}  # fmt: skip
"""vLLM's names of settings ``EngineArgs`` has under another name (offline and as flags)."""


def vllm_flags(name: str) -> list[str]:
    """vLLM's flags for the ``EngineArgs`` field ``name`` (``RENAMED_SETTINGS``)."""
    return ["--" + old.replace("_", "-") for old, new in RENAMED_SETTINGS.items() if new == name]


def without_vllm_only(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` (``LLM``'s) checked by ``check_vllm_only``, rid of vLLM's settings, which
    ``EngineArgs`` has no fields for, and with vLLM's names of its own settings renamed."""
    check_vllm_only(kwargs)
    names = {_dest(flag) for flag in (*NO_EFFECT_FLAGS, *MISSING_FEATURE_FLAGS)}
    kept = {name: value for name, value in kwargs.items() if name not in names}
    for vllm_name, name in RENAMED_SETTINGS.items():
        if vllm_name in kept:
            if name in kept:
                raise ValueError(f"{vllm_name} and {name} are one setting: give one of them.")
            kept[name] = kept.pop(vllm_name)
    return kept
