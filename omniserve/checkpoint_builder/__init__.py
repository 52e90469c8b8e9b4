"""Offline builder of tiny random-weight Hugging Face checkpoints for tests and benchmarks.

`build_tiny_checkpoint("Qwen3ForCausalLM")` writes config, safetensors weights (names as in real
checkpoints, via transformers' own `save_pretrained`), generation config and a locally trained
byte-level BPE tokenizer with the family's special tokens and chat template (design.md §6).
Multimodal models (Qwen2-VL, Qwen2.5-VL, Qwen2-Audio, the Qwen2.5-Omni / Qwen3-Omni-MoE thinkers
and their full speech-output models) also get their HF processor, so
`AutoProcessor.from_pretrained(dir)` works offline.
"""

from __future__ import annotations

from omniserve.checkpoint_builder.builder import build_tiny_checkpoint
from omniserve.checkpoint_builder.table import SUPPORTED_ARCHITECTURES

__all__ = ["SUPPORTED_ARCHITECTURES", "build_tiny_checkpoint"]
