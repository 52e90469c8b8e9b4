"""The media towers alone: transformers' own tower modules (what HF runs) against omniserve's
(the same modules on our layers, ``model_zoo.towers``, with the device backend's kernels), on
random weights in a real checkpoint's shapes, alternating in one process, in bf16.

Inputs: a 448 x 448 image (1,024 patches, 256 tokens) for vision towers, a 10 s clip (1,000 mel
frames) for the Qwen2.5-Omni audio tower. Prints each tower's times and the pairwise ratios, and
the relative difference of the two outputs (bf16 sums in other orders).

    python scripts/bench_towers.py --models qwen2.5-omni-3b-thinker,qwen3-vl-2b
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from model_zoo.multimodal import run_vision_tower
from model_zoo.towers import adopt_tower


def _vision_classes() -> dict[str, type[nn.Module]]:
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniVisionEncoder
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeVisionEncoder,
    )
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    return {
        "Qwen2_5OmniThinkerForConditionalGeneration": Qwen2_5OmniVisionEncoder,
        "Qwen3OmniMoeThinkerForConditionalGeneration": Qwen3OmniMoeVisionEncoder,
        "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VisionTransformerPretrainedModel,
        "Qwen3VLForConditionalGeneration": Qwen3VLVisionModel,
    }


def vision_run(tower: nn.Module, device: torch.device) -> Callable[[nn.Module], torch.Tensor]:
    """A 448 x 448 image through ``tower``, as the processors lay its patches out."""
    patch = tower.config.patch_size
    grid = torch.tensor([[1, 448 // patch, 448 // patch]])
    width = tower.config.in_channels * tower.config.temporal_patch_size * patch * patch
    pixels = torch.randn(int(grid.prod()), width, dtype=torch.bfloat16, device=device)
    return lambda t: run_vision_tower(t, pixels, grid).pooler_output


def audio_run(tower: nn.Module, device: torch.device) -> Callable[[nn.Module], torch.Tensor]:
    """A 10 s clip through Qwen2.5-Omni's audio tower, as the thinker runs it."""
    from model_zoo.qwen2_5_omni_thinker import run_audio_tower

    features = torch.randn(tower.config.num_mel_bins, 1000, dtype=torch.bfloat16, device=device)
    return lambda t: run_audio_tower(t, features, [1000])


def towers(arch: str, config: Any, device: torch.device) -> list[tuple[str, nn.Module, Callable]]:
    """(name, transformers' tower with random weights, its input) of each tower a config has."""
    out = []
    vision_cls = _vision_classes().get(arch)
    if vision_cls is None:
        raise SystemExit(f"{arch}: no vision tower here to time (see _vision_classes).")
    found = [("vision", vision_cls, config.vision_config, vision_run)]
    if arch == "Qwen2_5OmniThinkerForConditionalGeneration":
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
            Qwen2_5OmniAudioEncoder,
        )

        found.append(("audio", Qwen2_5OmniAudioEncoder, config.audio_config, audio_run))
    for name, cls, sub_config, make_input in found:
        sub_config._attn_implementation = "sdpa"
        tower = cls(sub_config).to(device, torch.bfloat16).eval()
        generator = torch.Generator(device).manual_seed(0)
        for param in tower.parameters():
            param.data.normal_(0, 0.02, generator=generator)
        out.append((name, tower, make_input(tower, device)))
    return out


def main() -> None:
    from transformers import AutoConfig

    from omniserve.checkpoint_builder import build_realsize_checkpoint, build_tiny_checkpoint
    from omniserve.checkpoint_builder.realsize import REALSIZE_MODELS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen2.5-omni-3b-thinker")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda.")
    parser.add_argument(
        "--tiny", action="store_true", help="The builder's tiny checkpoints of these "
        "architectures instead (--models then names architectures): a smoke run."
    )  # fmt: skip
    args = parser.parse_args()
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    if device.type == "cpu":
        from omniserve.cpu.backend import apply_cpu_backend as backend
    else:
        from omniserve.cuda.backend import apply_cuda_backend as backend
    for model in args.models.split(","):
        if args.tiny:
            model_dir = build_tiny_checkpoint(model)
        elif model in REALSIZE_MODELS:
            model_dir = build_realsize_checkpoint(model)  # once; only its config is read
        else:
            raise SystemExit(f"{model}: not one of {', '.join(REALSIZE_MODELS)}.")
        config = AutoConfig.from_pretrained(model_dir)
        arch = config.architectures[0]
        config = getattr(config, "thinker_config", config)
        for name, theirs, run in towers(arch, config, device):
            ours = adopt_tower(copy.deepcopy(theirs))
            with torch.inference_mode():
                print(f"{model} {name}: {backend(ours, torch.bfloat16).summary()}")
                want, got = run(theirs).float(), run(ours).float()
                times: dict[str, list[float]] = {"transformers": [], "omniserve": []}
                for _ in range(args.repeats):
                    for label, tower in (("transformers", theirs), ("omniserve", ours)):
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                        start = time.perf_counter()
                        run(tower)
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                        times[label].append(time.perf_counter() - start)
            difference = ((got - want).norm() / want.norm()).item()
            ratios = " ".join(f"{a / b:.2f}x" for a, b in zip(*times.values(), strict=True))
            print(f"{model} {name}: transformers {min(times['transformers']) * 1e3:.0f} ms, "
                  f"omniserve {min(times['omniserve']) * 1e3:.0f} ms (best of "
                  f"{args.repeats}); pairwise {ratios}; relative difference "
                  f"{difference:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
