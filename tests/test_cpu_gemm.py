"""The C small-batch linear and MoE kernels against torch (F.linear, the MoE reference)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omniserve.layers import cpu_gemm
from omniserve.layers.fused_moe import fused_experts, select_experts, torch_fused_experts


@pytest.fixture(autouse=True)
def _kernel_built() -> None:
    assert cpu_gemm._load() is not None, "the C kernels must build on this machine"


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Float rounding apart: a different summation order than BLAS, nothing more."""
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 17, 32])
@pytest.mark.parametrize(("out_features", "in_features"), [(512, 256), (70, 48), (33, 200)])
def test_linear_matches_torch(rows: int, out_features: int, in_features: int) -> None:
    """Any row count up to the limit, widths that are not multiples of the tiles or vectors."""
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.1
    bias = torch.randn(out_features, generator=gen)
    with torch.inference_mode():
        _close(cpu_gemm.linear(x, weight), F.linear(x, weight))
        _close(cpu_gemm.linear(x, weight, bias), F.linear(x, weight, bias))


def test_linear_rows_are_batch_invariant() -> None:
    """A row's output is the same floats alone or in a batch: decode results do not depend on
    which other requests share the step."""
    x = torch.randn(13, 256)
    weight = torch.randn(300, 256)
    with torch.inference_mode():
        batched = cpu_gemm.linear(x, weight)
        for i in range(13):
            assert torch.equal(cpu_gemm.linear(x[i : i + 1], weight), batched[i : i + 1])


def test_linear_strided_and_3d_inputs() -> None:
    """Rows of a wider tensor (a view with a row stride), a 3-D input and a non-contiguous one."""
    base = torch.randn(6, 400)
    weight = torch.randn(64, 128)
    with torch.inference_mode():
        view = base[:, 100:228]
        _close(cpu_gemm.linear(view, weight), F.linear(view, weight))
        x3 = torch.randn(2, 3, 128)
        out = cpu_gemm.linear(x3, weight)
        assert out.shape == (2, 3, 64)
        _close(out, F.linear(x3, weight))
        columns = torch.randn(128, 4).t()
        _close(cpu_gemm.linear(columns, weight), F.linear(columns, weight))


def test_linear_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Large batches, other dtypes, autograd and a missing kernel all take F.linear exactly."""
    weight = torch.randn(32, 64, requires_grad=True)
    big = torch.randn(cpu_gemm.MAX_LINEAR_ROWS + 1, 64)
    assert torch.equal(cpu_gemm.linear(big, weight), F.linear(big, weight))
    half = torch.randn(2, 64, dtype=torch.bfloat16)
    assert torch.equal(cpu_gemm.linear(half, weight.bfloat16()), F.linear(half, weight.bfloat16()))
    out = cpu_gemm.linear(torch.randn(2, 64), weight)  # grad enabled: autograd must see it
    out.sum().backward()
    assert weight.grad is not None
    monkeypatch.setattr(cpu_gemm, "_load", lambda: None)
    x = torch.randn(2, 64)
    with torch.inference_mode():
        assert torch.equal(cpu_gemm.linear(x, weight), F.linear(x, weight))
    assert cpu_gemm.linear(torch.empty(0, 64), weight).shape == (0, 32)


def _moe_case(tokens: int, experts: int = 8, top_k: int = 2, hidden: int = 96, inter: int = 40):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1
    down = torch.randn(experts, hidden, inter, generator=gen) * 0.1
    weights, ids = select_experts(torch.randn(tokens, experts, generator=gen), top_k, True)
    return x, gate_up, down, weights, ids


@pytest.mark.parametrize("tokens", [1, 2, 7, 33, 64])
def test_moe_matches_the_reference(tokens: int) -> None:
    x, gate_up, down, weights, ids = _moe_case(tokens)
    with torch.inference_mode():
        assert cpu_gemm.moe_supported(x, gate_up, down)
        _close(
            cpu_gemm.moe(x, gate_up, down, weights, ids),
            torch_fused_experts(x, gate_up, down, weights, ids),
        )
        # the dispatch point takes the kernel for this batch
        _close(
            fused_experts(x, gate_up, down, weights, ids),
            cpu_gemm.moe(x, gate_up, down, weights, ids),
        )


def test_moe_top1_all_on_one_expert_and_idle_experts() -> None:
    x, gate_up, down, _, _ = _moe_case(9)
    ids = torch.full((9, 1), 5)
    weights = torch.rand(9, 1)
    with torch.inference_mode():
        _close(
            cpu_gemm.moe(x, gate_up, down, weights, ids),
            torch_fused_experts(x, gate_up, down, weights, ids),
        )


def test_moe_bad_expert_id_is_a_clear_error() -> None:
    x, gate_up, down, weights, ids = _moe_case(4)
    ids[2, 1] = 8
    with (
        torch.inference_mode(),
        pytest.raises(ValueError, match=r"expert ids must lie in \[0, 8\)"),
    ):
        cpu_gemm.moe(x, gate_up, down, weights, ids)


def test_moe_prefill_batches_stay_on_torch() -> None:
    x, gate_up, down, _, _ = _moe_case(cpu_gemm.MAX_MOE_TOKENS + 1)
    with torch.inference_mode():
        assert not cpu_gemm.moe_supported(x, gate_up, down)
        assert not cpu_gemm.moe_supported(x[:4].double(), gate_up.double(), down.double())
