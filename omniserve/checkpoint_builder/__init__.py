"""Offline builder of tiny random-weight Hugging Face checkpoints for tests and benchmarks.

`build_tiny_checkpoint("Qwen3ForCausalLM")` writes config, safetensors weights (names as in real
checkpoints, via transformers' own `save_pretrained`), generation config and a locally trained
byte-level BPE tokenizer with the family's special tokens and chat template (design.md §6).
Multimodal models (Qwen2-VL, Qwen2.5-VL, Qwen2-Audio, the Qwen2.5-Omni / Qwen3-Omni-MoE thinkers
and their full speech-output models) also get their HF processor, so
`AutoProcessor.from_pretrained(dir)` works offline.

`build_realsize_checkpoint("qwen2.5-1.5b")` builds the same files at the published shapes of a real
checkpoint (`REALSIZE_MODELS`), streaming its weights shard by shard, for benchmarks.
"""

from __future__ import annotations

from omniserve.checkpoint_builder.builder import build_tiny_checkpoint
from omniserve.checkpoint_builder.realsize import (
    REALSIZE_MODELS,
    RealSizeSpec,
    build_realsize_checkpoint,
)
from omniserve.checkpoint_builder.table import SUPPORTED_ARCHITECTURES

__all__ = [
    "REALSIZE_MODELS",
    "SUPPORTED_ARCHITECTURES",
    "RealSizeSpec",
    "build_realsize_checkpoint",
    "build_tiny_checkpoint",
]
