"""CPU matmuls against torch: oneDNN-packed linear layers vs F.linear, the C MoE block vs the
MoE reference."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from omniserve.layers import cpu_gemm
from omniserve.layers.cpu_gemm import pack_experts, pack_weights_for_cpu
from omniserve.layers.fused_moe import (
    FusedMoE,
    fused_experts,
    select_experts,
    torch_fused_experts,
)
from omniserve.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from omniserve.layers.vocab_embedding import ParallelLMHead


@pytest.fixture(autouse=True)
def _kernel_built() -> None:
    assert cpu_gemm._moe_kernel() is not None, "the C kernels must build on this machine"


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Float rounding apart: a different summation order than BLAS, nothing more (absolute
    error up to 1e-6 of the largest output, as sums of large terms cancel)."""
    atol = 1e-5 + 1e-6 * float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=atol)


def _packed_layer(out_features: int, in_features: int, bias: bool, seed: int) -> ReplicatedLinear:
    layer = ReplicatedLinear(in_features, out_features, bias=bias)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, generator=gen) * 0.1)
        if layer.bias is not None:
            layer.bias.copy_(torch.randn(out_features, generator=gen))
    assert pack_weights_for_cpu(layer) == 1 and layer.packed_weight is not None
    return layer


@pytest.mark.parametrize("rows", [1, 3, 17, 64, 700])
@pytest.mark.parametrize(("out_features", "in_features"), [(512, 256), (70, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_torch(
    rows: int, out_features: int, in_features: int, bias: bool
) -> None:
    """Decode- and prefill-sized batches, widths that are not multiples of any blocking."""
    layer = _packed_layer(out_features, in_features, bias, rows)
    x = torch.randn(rows, in_features)
    with torch.inference_mode():
        _close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_packed_linear_strided_and_3d_inputs() -> None:
    """Rows of a wider tensor (a view with a row stride), a 3-D input and a transposed one."""
    layer = _packed_layer(64, 128, True, 0)
    reference = functools.partial(F.linear, weight=layer.weight, bias=layer.bias)
    with torch.inference_mode():
        view = torch.randn(6, 400)[:, 100:228]
        _close(layer(view), reference(view))
        x3 = torch.randn(2, 3, 128)
        assert layer(x3).shape == (2, 3, 64)
        _close(layer(x3), reference(x3))
        columns = torch.randn(128, 4).t()
        _close(layer(columns), reference(columns))
        assert layer(torch.empty(0, 128)).shape == (0, 64)


def test_packed_linear_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Autograd and other dtypes take F.linear exactly; OMNISERVE_CPU_KERNELS=torch packs
    nothing."""
    layer = _packed_layer(32, 64, False, 1)
    x = torch.randn(2, 64, requires_grad=True)
    out = layer(x)  # grad enabled: autograd must see it
    assert torch.equal(out, F.linear(x, layer.weight))
    out.sum().backward()
    assert layer.weight.grad is not None
    half = ReplicatedLinear(64, 32).bfloat16()
    assert pack_weights_for_cpu(half) == 0 and half.packed_weight is None
    monkeypatch.setenv("OMNISERVE_CPU_KERNELS", "torch")
    assert pack_weights_for_cpu(ReplicatedLinear(64, 32)) == 0


def test_models_pack_every_linear_layer() -> None:
    """All projections of a decoder layer, and the LM head, get packed weights."""
    head = ParallelLMHead(100, 32)
    proj = QKVParallelLinear(32, 8, 4, 2)
    model = torch.nn.ModuleList([head, proj, RowParallelLinear(32, 32)])
    assert pack_weights_for_cpu(model) == 3


def _moe_case(tokens: int, experts: int = 8, top_k: int = 2, hidden: int = 128, inter: int = 96):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1
    down = torch.randn(experts, hidden, inter, generator=gen) * 0.1
    weights, ids = select_experts(torch.randn(tokens, experts, generator=gen), top_k, True)
    return x, gate_up, down, weights, ids


@pytest.mark.parametrize("tokens", [1, 2, 7, 33, 64, 300])
def test_moe_matches_the_reference(tokens: int) -> None:
    """Experts with 0 to many rows (row tiles of 6 cut anywhere), every activation range."""
    x, gate_up, down, weights, ids = _moe_case(tokens)
    x[0] *= 40  # large gate values: silu's exp at both ends of its range
    panels = pack_experts(gate_up, down)
    expected = torch_fused_experts(x, gate_up, down, weights, ids)
    with torch.inference_mode():
        assert panels is not None and cpu_gemm.moe_supported(x, panels)
        _close(cpu_gemm.moe(x, panels, weights, ids), expected)
        # the dispatch point takes the kernel for this batch
        _close(fused_experts(x, gate_up, down, weights, ids, panels), expected)


def test_moe_top1_all_on_one_expert_and_idle_experts() -> None:
    x, gate_up, down, _, _ = _moe_case(9)
    ids = torch.full((9, 1), 5)
    weights = torch.rand(9, 1)
    panels = pack_experts(gate_up, down)
    with torch.inference_mode():
        _close(
            cpu_gemm.moe(x, panels, weights, ids),
            torch_fused_experts(x, gate_up, down, weights, ids),
        )


def test_moe_bad_expert_id_is_a_clear_error() -> None:
    x, gate_up, down, weights, ids = _moe_case(4)
    ids[2, 1] = 8
    with (
        torch.inference_mode(),
        pytest.raises(ValueError, match=r"expert ids must lie in \[0, 8\)"),
    ):
        cpu_gemm.moe(x, pack_experts(gate_up, down), weights, ids)


def test_moe_falls_back_to_torch() -> None:
    """Unpacked experts, widths off the kernel's tiles and other dtypes use the reference;
    FusedMoE packs its panels through pack_weights_for_cpu."""
    x, gate_up, down, _, _ = _moe_case(3)
    assert not cpu_gemm.moe_supported(x, None)
    assert not cpu_gemm.moe_supported(x.double(), pack_experts(gate_up, down))
    assert pack_experts(gate_up[:, :, :96], down[:, :96]) is None  # H = 96: not a multiple of 64
    assert pack_experts(gate_up.double(), down.double()) is None
    layer = FusedMoE(8, 128, 96)
    assert pack_weights_for_cpu(layer) == 1 and layer.panels is not None
