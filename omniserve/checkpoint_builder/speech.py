"""The speech half of a full omni checkpoint: talker / vocoder sub-configs, speakers, fixes.

The thinker half is an ordinary multimodal row (builder.py builds it and hands it in here).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omniserve.checkpoint_builder.specs import SpeechSpec

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedConfig


def speech_submodels(
    speech: SpeechSpec,
    size: str,
    thinker: PreTrainedConfig,
    overrides: dict[str, dict[str, Any]],
) -> dict[str, dict[str, Any]]:
    """Outer-config kwargs for the talker / vocoder: the size's sub-configs, the caller's
    overrides merged in, then the values linked from the thinker config."""
    outer = {
        name: _merged(copy.deepcopy(dict(sizes[size])), overrides.get(name, {}))
        for name, sizes in speech.submodels.items()
    }
    thinker_dict = thinker.to_dict()
    for path, thinker_path in speech.thinker_links.items():
        *parents, leaf = path.split(".")
        node = outer
        for parent in parents:
            node = node.setdefault(parent, {})
        value: Any = thinker_dict
        for part in thinker_path.split("."):
            value = value[part]
        node[leaf] = value
    return outer


def _merged(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """`base` with `update` merged in, recursing into nested sub-config dicts."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merged(base[key], value)
        else:
            base[key] = value
    return base


def write_speakers(
    path: Path, speech: SpeechSpec, config: PreTrainedConfig, *, num_tokens: int, seed: int
) -> None:
    """spk_dict.pt: per speaker its text bos id, DiT conditioning vector and reference mel."""
    import torch

    vocab_size = config.get_text_config().vocab_size
    dit = config.token2wav_config.dit_config
    speakers = {}
    generator = torch.Generator().manual_seed(seed)
    for name, bos_id in speech.speakers.items():
        if not num_tokens <= bos_id < vocab_size:
            raise ValueError(f"speaker bos id {bos_id} is not a padding row of the vocabulary")
        speakers[name] = {
            "bos_token": bos_id,
            "cond": torch.randn(1, dit.enc_emb_dim, generator=generator),  # [1, enc_emb_dim]
            "ref_mel": torch.randn(1, 32, dit.mel_dim, generator=generator),  # [1, frames, mels]
        }
    torch.save(speakers, path / "spk_dict.pt")


def init_fused_experts(model: torch.nn.Module) -> None:
    """Draw fused expert weights that transformers leaves as `torch.empty` (Qwen3-Omni's talker).

    Its _init_weights covers the thinker's expert class but not the talker's, so their bytes would
    be whatever memory held: non-deterministic checkpoints.
    """
    import torch

    std = model.config.get_text_config().initializer_range
    with torch.no_grad():
        for _, module in sorted(model.named_modules()):
            for name in ("gate_up_proj", "down_proj"):
                param = getattr(module, name, None)
                if isinstance(param, torch.nn.Parameter) and param.ndim == 3:
                    param.normal_(0.0, std)  # [num_experts, out_features, in_features]
