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


# Waveform standard deviation the tiny vocoders are calibrated to: loud enough that any change
# of codes shows, far from the [-1, 1] clamp.
VOCODER_OUTPUT_STD = 0.2


def tune_speech_weights(model: torch.nn.Module) -> None:
    """Make a random full omni model's speech half behave like a trained one where tests look.

    - The talker's end-of-speech row of its codec head is zeroed: its logit is 0 while the codes'
      spread both ways, so a greedy talker never ends at step 0 (with random rows it did about as
      often as any code won; transformers' Qwen3-Omni then crashes on an empty code sequence).
    - Qwen3-Omni's speaker rows of the talker's codec embedding are drawn at unit scale: at
      transformers' 0.02 the voice, one prompt position among dozens, changed no greedy code, so
      every voice spoke the same waveform. (Qwen2.5-Omni's voices differ through spk_dict.pt.)
    - The vocoder's convolutions and projections (Qwen3-Omni's code2wav; Qwen2.5-Omni's DiT and
      BigVGAN) are drawn variance-preserving (std 1/sqrt(fan_in), biases 0, embeddings unit)
      instead of transformers' 0.02, whose product over dozens of layers left a change of codes
      1e-4 (Qwen3) to 1e-7 (Qwen2.5) of the waveform's spread; then the last convolution is
      scaled so a probe input comes out at ``VOCODER_OUTPUT_STD``. Measured after: a change of
      half the codes moves the waveform by 74% (Qwen3) and 19% (Qwen2.5, through the DiT's mel)
      of its spread, nothing clipped. Draws use the global RNG (the builder seeds it), so builds
      stay deterministic.
    """
    import torch

    talker, config = model.talker, model.config.talker_config
    eos = getattr(config, "codec_eos_token_id", None)
    if eos is None:  # Qwen2.5-Omni's name for it
        eos = config.tts_codec_end_token_id
    with torch.no_grad():
        talker.codec_head.weight[eos] = 0.0
        speakers = sorted(getattr(config, "speaker_id", None) or {})
        if speakers:  # Qwen3-Omni: a voice is one codec row of the talker's prompt
            rows = [config.speaker_id[name] for name in speakers]
            talker.model.codec_embedding.weight[rows] = torch.randn(
                len(rows), talker.model.codec_embedding.weight.shape[1]
            )
    if hasattr(model, "code2wav"):  # Qwen3-Omni: codes -> waveform
        codec = model.config.code2wav_config
        vocoder = model.code2wav
        probe = torch.randint(0, codec.codebook_size, (1, codec.num_quantizers, 16))
        _variance_preserving(vocoder)
        _calibrate_output(vocoder, lambda: vocoder(probe))
    else:  # Qwen2.5-Omni: codes -> mel (DiT) -> waveform (BigVGAN)
        dit, bigvgan = model.token2wav.code2wav_dit_model, model.token2wav.code2wav_bigvgan_model
        mel = torch.randn(1, model.config.token2wav_config.dit_config.mel_dim, 40)
        _variance_preserving(dit)
        _variance_preserving(bigvgan)
        _calibrate_output(bigvgan, lambda: bigvgan(mel))


def _variance_preserving(module: torch.nn.Module) -> None:
    import torch
    from torch import nn

    with torch.no_grad():
        for _, layer in sorted(module.named_modules()):
            if isinstance(layer, nn.Embedding):
                layer.weight.normal_(0.0, 1.0)
            elif isinstance(layer, nn.Conv1d | nn.ConvTranspose1d | nn.Linear):
                weight = layer.weight
                fan_in = weight[0].numel()
                if isinstance(layer, nn.ConvTranspose1d):  # each output sees in/stride taps
                    fan_in = weight.shape[0] * weight.shape[2] / layer.stride[0]
                weight.normal_(0.0, fan_in**-0.5)
                if layer.bias is not None:
                    layer.bias.zero_()


def _calibrate_output(module: torch.nn.Module, run: Any) -> None:
    """Scale ``module``'s last Conv1d until ``run()`` has VOCODER_OUTPUT_STD (a clamped output
    reads low, so an output near the clamp is first cut by 10)."""
    import torch
    from torch import nn

    last = [layer for layer in module.modules() if isinstance(layer, nn.Conv1d)][-1]
    with torch.no_grad():
        for _ in range(8):
            std = float(run().std())
            if abs(std - VOCODER_OUTPUT_STD) < 0.01 * VOCODER_OUTPUT_STD:
                return
            last.weight.mul_(0.1 if std > 0.9 else VOCODER_OUTPUT_STD / max(std, 1e-12))
