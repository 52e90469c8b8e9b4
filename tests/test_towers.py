"""transformers' towers on our layers (``model_zoo.towers``): the same outputs as the towers left
untouched, bit for bit in fp32 through torch, and within bf16's rounding on the CPU's kernels."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from model_zoo.multimodal import run_vision_tower
from model_zoo.towers import GatedMLP, PatchLinear, VisionAttention, _gelu_form
from omniserve.cpu.backend import apply_cpu_backend, keep_bf16_weights
from omniserve.layers.linear import ReplicatedLinear
from tests.test_models_mm import VL_ARCHS, load_ours
from tests.test_models_omni import QWEN2_5, QWEN3

VISION_ARCHS = [*VL_ARCHS, "Qwen3VLForConditionalGeneration", QWEN2_5, QWEN3]


def _towers(model_dir: Path) -> tuple[nn.Module, nn.Module]:
    """(our tower, transformers' tower of the same class untouched, with the same weights)."""
    ours = load_ours(model_dir).visual
    theirs = type(ours)(ours.config).eval()
    shapes = {name: t.shape for name, t in theirs.state_dict().items()}
    theirs.load_state_dict({n: t.view(shapes[n]) for n, t in ours.state_dict().items()})
    return ours, theirs


def _inputs(tower: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Random patches of two images (one of two frames), as the processors lay them out."""
    embed = next(m for m in tower.modules() if isinstance(m, PatchLinear))
    grid = torch.tensor([[1, 8, 12], [2, 4, 4]])
    gen = torch.Generator().manual_seed(0)
    pixels = torch.randn(int(grid.prod(-1).sum()), embed.input_size, generator=gen)
    return pixels, grid


@pytest.mark.parametrize("arch", VISION_ARCHS)
def test_adopted_tower_is_transformers_in_fp32_and_close_on_the_kernels(
    arch: str, tiny_checkpoint: Callable[..., Path]
) -> None:
    ours, theirs = _towers(tiny_checkpoint(arch))
    assert not any(type(m) is nn.Linear or type(m) is nn.Conv3d for m in ours.modules())
    assert not any(_gelu_form(m) for m in ours.modules())  # transformers' GELUs became ours
    attentions = [m for m in ours.modules() if isinstance(m, VisionAttention)]
    assert len(attentions) == ours.config.depth
    gated = [m for m in ours.modules() if isinstance(m, GatedMLP)]  # Qwen2.5's SwiGLU MLPs
    assert len(gated) == (ours.config.depth if "2_5" in arch else 0)
    pixels, grid = _inputs(ours)
    with torch.inference_mode():
        want = run_vision_tower(theirs, pixels, grid).pooler_output
        assert torch.equal(run_vision_tower(ours, pixels, grid).pooler_output, want)

        ours, theirs = ours.bfloat16(), theirs.bfloat16()
        report = apply_cpu_backend(ours, torch.bfloat16)
        assert report.placements["q/k norm + RoPE: C"] == len(attentions)
        assert all(m.kernel is not None for m in ours.modules() if isinstance(m, PatchLinear))
        got = run_vision_tower(ours, pixels.bfloat16(), grid).pooler_output.float()
        want = run_vision_tower(theirs, pixels.bfloat16(), grid).pooler_output.float()
    # bf16 sums in another order, through a few blocks: a few of bf16's units, relative
    assert (got - want).norm() / want.norm() < 2e-2


def test_patch_linear_computes_the_convolution_and_loads_its_filters() -> None:
    gen = torch.Generator().manual_seed(0)
    conv = nn.Conv3d(3, 16, kernel_size=(2, 4, 4), stride=(2, 4, 4), bias=True)
    layer = PatchLinear(conv)
    assert layer.weight.shape == (16, 96) and layer.keeps_dtype
    assert not PatchLinear.covers(nn.Conv3d(3, 16, kernel_size=3, stride=1))
    filters = torch.randn(16, 3, 2, 4, 4, generator=gen)
    layer.weight.weight_loader(layer.weight, filters)
    with torch.no_grad():
        conv.weight.copy_(filters)
    patches = torch.randn(10, 3, 2, 4, 4, generator=gen)
    with torch.no_grad():
        want = conv(patches).flatten(1)
        assert torch.equal(layer(patches), want)  # no kernel: the convolution itself
        layer.kernel = lambda x, bias: torch.nn.functional.linear(x, layer.weight, bias)
        torch.testing.assert_close(layer(patches), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"patch filters \(16, 3, 2, 4, 4\)"):
        layer.weight.weight_loader(layer.weight, torch.zeros(16, 96))


def test_tower_weights_keep_the_models_dtype_under_fp32() -> None:
    """bf16 checkpoints computed in fp32 keep the decoder's matrices bf16, not the towers':
    transformers' towers cast their inputs to their layers' weight dtype."""
    model = nn.ModuleDict({"decoder": ReplicatedLinear(32, 32), "tower": ReplicatedLinear(32, 32)})
    model["tower"].keeps_dtype = True
    stored = {"decoder.weight": (torch.Size([32, 32]), torch.bfloat16)}
    kept = keep_bf16_weights(model, torch.float32, stored)
    assert model["tower"].weight.dtype == torch.float32
    if kept:
        assert model["decoder"].weight.dtype == torch.bfloat16
