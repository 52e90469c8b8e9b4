"""MoE experts kept quantized (4-bit and FP8): the CPU kernel, the torch path, tensor-parallel
shards and loading, against the products of the dequantized experts."""

from __future__ import annotations

import pytest
import torch

from omniserve.checkpoint_builder.quantized import quantized_matrix
from omniserve.config import QuantizationConfig
from omniserve.cpu import moe as cpu_moe
from omniserve.cpu.backend import apply_cpu_backend
from omniserve.cpu.build import load_library
from omniserve.cpu.moe import CpuMoE
from omniserve.layers import fused_moe
from omniserve.layers.fused_moe import FusedMoE, select_experts, torch_fused_experts
from omniserve.layers.quantization import QuantizedMatrix
from omniserve.layers.quantized_loading import QuantizedExpertsKernel, quantize_experts
from tests.test_cpu_backend import DTYPES, _close
from tests.test_layers import as_rank

CONFIGS = {
    "int4": QuantizationConfig("awq", 32),
    "int4-128": QuantizationConfig("awq", 128),  # fp32: decoded in the interleaved order
    "fp8": QuantizationConfig("fp8", 32, row_block=32),
    "fp8-channel": QuantizationConfig("fp8", 0, scale_name="weight_scale"),
}


@pytest.fixture(autouse=True)
def _kernels_built(kernel_threads: None) -> None:
    for source in ("moe.c", "linear_int4.c", "linear_fp8.c"):
        assert load_library(source) is not None, f"{source} must build on this machine"


def quantized_experts(
    config: QuantizationConfig, experts: int = 8, hidden: int = 128, inter: int = 96, seed: int = 0
) -> tuple[dict[tuple[int, str], QuantizedMatrix], torch.Tensor, torch.Tensor]:
    """Each expert's projections quantized, and the stacked dequantized weights (fp32)."""
    gen = torch.Generator().manual_seed(seed)
    matrices, gate_up, down = {}, [], []
    for e in range(experts):
        for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                            ("down_proj", (hidden, inter))):  # fmt: skip
            weight = torch.randn(shape, generator=gen) * 0.05
            matrices[e, proj] = quantized_matrix(weight, config)
        gate_up.append(torch.cat([matrices[e, p].dequantize(torch.float32)
                                  for p in ("gate_proj", "up_proj")]))  # fmt: skip
        down.append(matrices[e, "down_proj"].dequantize(torch.float32))
    return matrices, torch.stack(gate_up), torch.stack(down)


def load_experts(
    layer: FusedMoE, config: QuantizationConfig, matrices: dict[tuple[int, str], QuantizedMatrix]
) -> FusedMoE:
    quantize_experts(layer, config)
    for (e, proj), matrix in matrices.items():
        param = layer.down_proj if proj == "down_proj" else layer.gate_up_proj
        param.weight_loader(param, matrix, e, proj)
    return layer


def _reference(x, gate_up, down, weights, ids) -> torch.Tensor:
    """The fp32 products of the experts dequantized in x's dtype (rounded once, as the kernels
    decode them)."""
    gate_up, down = (w.to(x.dtype).float() for w in (gate_up, down))
    return torch_fused_experts(x.float(), gate_up, down, weights.float(), ids)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", list(CONFIGS))
@pytest.mark.parametrize("tokens", [1, 3, 33, 300])
def test_quantized_experts_match_their_dequantized_weights(tokens, fmt, dtype, monkeypatch):
    """The C kernel (every batch size, tile tails included), torch's per-expert products on
    experts decoded in C (a prefill's path) and the torch path that runs anywhere all give the
    dequantized experts' products."""
    config = CONFIGS[fmt]
    hidden, inter = (256, 128) if fmt == "int4-128" else (128, 96)
    matrices, gate_up, down = quantized_experts(config, hidden=hidden, inter=inter)
    layer = load_experts(FusedMoE(8, 2, hidden, inter), config, matrices)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    x[0] *= 40  # large gate values: silu's exp at both ends of its range
    weights, ids = select_experts(torch.randn(tokens, 8, generator=gen).to(dtype), 2, True)
    expected = _reference(x, gate_up, down, weights, ids)
    assert isinstance(layer.kernel, QuantizedExpertsKernel)
    with torch.inference_mode():
        _close(layer(x, weights, ids), expected, dtype)
        moe = CpuMoE(layer, dtype)
        assert CpuMoE.supports(layer, dtype)
        _close(moe(x, weights, ids), expected, dtype)  # 300 tokens: the per-expert products
        monkeypatch.setattr(cpu_moe, "MAX_ROUTED_PER_EXPERT", 1 << 30)
        _close(moe(x, weights, ids), expected, dtype)


@pytest.mark.parametrize("fmt", ["int4", "fp8", "fp8-channel"])
def test_quantized_experts_shard_for_tensor_parallelism(fmt, monkeypatch):
    """Each of two ranks keeps its half of every expert's intermediate features (the groups of
    the down projection's input with them; a whole-input scale on both): their partial outputs
    add up to the whole product."""
    config = CONFIGS[fmt]
    matrices, gate_up, down = quantized_experts(config, inter=128)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 128, generator=gen)
    weights, ids = select_experts(torch.randn(5, 8, generator=gen), 2, True)
    total = torch.zeros(5, 128)
    for rank in range(2):
        as_rank(monkeypatch, rank, 2, fused_moe)
        layer = load_experts(FusedMoE(8, 2, 128, 128), config, matrices)
        assert layer.gate_up_proj.shape[1] == 128 and layer.down_proj_scales.shape[2] in (1, 2)
        with torch.inference_mode():
            part = CpuMoE(layer, torch.float32)(x, weights, ids)
            _close(layer.kernel(x, weights, ids), part, torch.float32)
        total += part
    _close(total, _reference(x, gate_up, down, weights, ids), torch.float32)


def test_quantized_experts_are_placed_and_named() -> None:
    config = CONFIGS["int4"]
    layer = load_experts(FusedMoE(8, 2, 128, 96), config, quantized_experts(config)[0])
    report = apply_cpu_backend(layer, torch.bfloat16)
    assert report.placements == {"MoE: C 4-bit, bfloat16 activations": 1}
    config = QuantizationConfig("awq", 16)  # groups of 16: the kernels decode 32 at a time
    layer = load_experts(FusedMoE(8, 2, 128, 96), config, quantized_experts(config)[0])
    report = apply_cpu_backend(layer, torch.float32)
    assert report.placements == {"MoE: torch 4-bit (dequantized per call)": 1}
    assert isinstance(layer.kernel, QuantizedExpertsKernel)


def test_quantized_experts_refuse_what_they_cannot_hold() -> None:
    config = CONFIGS["int4"]
    matrices, _, _ = quantized_experts(config, experts=1)
    layer = load_experts(FusedMoE(1, 1, 128, 96), config, matrices)
    param = layer.gate_up_proj
    with pytest.raises(ValueError, match="expert 0 up_proj is stored unquantized"):
        param.weight_loader(param, torch.zeros(96, 128), 0, "up_proj")
    with pytest.raises(ValueError, match=r"expected \(96, 128\), got \(128, 96\)"):
        param.weight_loader(param, matrices[0, "down_proj"], 0, "up_proj")
    act_order = QuantizedMatrix(**{**vars(matrices[0, "up_proj"]),
                                   "g_idx": torch.randperm(128).int() // 32})  # fmt: skip
    with pytest.raises(ValueError, match="g_idx reorders the input features"):
        param.weight_loader(param, act_order, 0, "up_proj")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_quantized_experts_on_gpu(fmt) -> None:
    """On CUDA the Triton grouped GEMMs decode the codes (compiled, and warmed up as at
    start-up); bf16 against the fp32 products of the experts dequantized in bf16."""
    config = CONFIGS[fmt]
    matrices, gate_up, down = quantized_experts(config)
    with torch.device("cuda"):
        layer = FusedMoE(8, 2, 128, 96).bfloat16()  # the model's dtype: the kernel's
    layer = load_experts(layer, config, {k: QuantizedMatrix(**{
        name: None if t is None else t.cuda() for name, t in vars(m).items()
    }) for k, m in matrices.items()})  # fmt: skip
    assert isinstance(layer.kernel, QuantizedExpertsKernel)
    layer.kernel.warm_up()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 128, generator=gen).bfloat16()
    weights, ids = select_experts(torch.randn(40, 8, generator=gen).bfloat16(), 2, True)
    with torch.inference_mode():
        got = layer(x.cuda(), weights.cuda(), ids.cuda()).cpu()
    _close(got, _reference(x, gate_up, down, weights, ids), torch.bfloat16)
