"""The AMX bf16 linear kernel (``cpu/csrc/linear_amx.c``) against the fp32 product of the same
bf16 operands, on both layouts, and where the CPU backend puts it. Held to bf16's rounding of the
output (the kernel accumulates in fp32 over the whole K, as the reference does, in its own
order)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omniserve.cpu import linear_amx
from omniserve.cpu.backend import apply_cpu_backend
from omniserve.cpu.linear_amx import AmxLinear, plain_linear
from omniserve.cpu.moe import CpuMoE
from omniserve.layers.fused_moe import FusedMoE, select_experts, torch_fused_experts
from omniserve.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from omniserve.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

pytestmark = pytest.mark.skipif(
    not AmxLinear.available(),
    reason="needs a CPU with AMX-BF16 whose Linux grants the AMX state, and a C compiler",
)


@pytest.fixture(autouse=True)
def _threads(kernel_threads: None) -> None:
    """Two threads, so the kernel's split of the weight's rows is covered."""


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


def _assert_bf16_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """One bf16 rounding of the output (half an ulp, up to 2**-8 relative), which the kernel's
    own summation order may tip to the neighbouring value (one ulp: 2**-7), and fp32
    summation-order noise near zero."""
    assert actual.dtype == torch.bfloat16 and actual.shape == expected.shape
    scale = float(expected.abs().max()) if expected.numel() else 1.0
    torch.testing.assert_close(actual.float(), expected, rtol=2**-7, atol=1e-3 * scale)


@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 31, 33, 64, 300, 700])
@pytest.mark.parametrize(
    ("out_features", "in_features"),
    [(16, 32), (48, 64), (80, 4160), (272, 1536)],
    ids=["one-half-group", "half-group", "three-K-chunks", "qkv-like"],
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_amx_linear_matches_the_fp32_product(rows, out_features, in_features, bias, packed) -> None:
    """Rows around the 16-row tiles and 32-row blocks and across the kernel's blocks of rows
    (700 rows at K = 4,160 is two of them, each over three K-chunks with partial sums), a weight
    that ends half-way through a 32-row group (of its features, plain; of its packed groups,
    packed); the input is rows of a wider tensor, and its last rows short of 16 (an A tile's)."""
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).bfloat16()
    bias_t = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, in_features + 64, generator=gen).bfloat16()[:, 32 : 32 + in_features]
    with torch.inference_mode():
        _assert_bf16_close(AmxLinear(weight, packed)(x, bias_t), _reference(x, weight, bias_t))


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_amx_linear_inputs_and_errors(packed: bool) -> None:
    """3-D and transposed inputs, an empty batch, an fp32 bias; training or a dtype mismatch is a
    clear error; shapes off its tiles are not claimed."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(64, 128, generator=gen) * 0.05).bfloat16()
    kernel = AmxLinear(weight, packed)
    with torch.inference_mode():
        x3 = torch.randn(2, 3, 128, generator=gen).bfloat16()
        _assert_bf16_close(kernel(x3, None), _reference(x3, weight, None))
        columns = torch.randn(128, 4, generator=gen).bfloat16().t()
        _assert_bf16_close(kernel(columns, None), _reference(columns, weight, None))
        bias = torch.randn(64, generator=gen)
        x = torch.randn(5, 128, generator=gen).bfloat16()
        _assert_bf16_close(kernel(x, bias), _reference(x, weight, bias.bfloat16()))
        assert kernel(torch.empty(0, 128, dtype=torch.bfloat16), None).shape == (0, 64)
        with pytest.raises(TypeError, match="input dtype torch.float32 does not match"):
            kernel(torch.randn(2, 128), None)
    with pytest.raises(RuntimeError, match="inference on CPU tensors only"):
        kernel(torch.randn(2, 128, requires_grad=True).bfloat16(), None)
    assert not AmxLinear.supports(torch.zeros(64, 48, dtype=torch.bfloat16))  # K % 32
    assert not AmxLinear.supports(torch.zeros(70, 64, dtype=torch.bfloat16))  # N % 16
    assert not AmxLinear.supports(torch.zeros(64, 64))  # fp32
    assert not AmxLinear.supports(torch.zeros(64, 128, dtype=torch.bfloat16)[:, :64])


def test_backend_puts_bf16_linears_on_amx(monkeypatch) -> None:
    """In a bf16 model each linear layer whose shapes fit runs on AMX: its own weight packed into
    the tiles' layout (the original released), the head tied to the embedding on the shared
    weight as it is (one copy). A layer off the tiles keeps oneDNN; OMNISERVE_CPU_AMX=0 puts
    them all back on oneDNN and the head on the plain-layout kernel, as on CPUs without AMX."""

    def model() -> tuple[torch.nn.Module, VocabParallelEmbedding, ParallelLMHead]:
        embed = VocabParallelEmbedding(320, 64).bfloat16()
        torch.nn.init.normal_(embed.weight)
        head = ParallelLMHead(320, 64).bfloat16()
        head.weight = embed.weight
        layers = [embed, head, QKVParallelLinear(64, 16, 4, 2), RowParallelLinear(64, 64),
                  ReplicatedLinear(64, 70)]  # fmt: skip
        return torch.nn.ModuleList(layers).bfloat16(), embed, head

    tied, embed, head = model()
    qkv = tied[2]
    qkv_weight = qkv.weight.detach().clone()
    assert apply_cpu_backend(tied, torch.bfloat16).placements == {
        "linear: C AMX bfloat16 (shared weight)": 1,
        "linear: C AMX packed bfloat16": 2,
        "linear: oneDNN packed bfloat16": 1,
    }
    assert head.weight is embed.weight and embed.weight.device.type == "cpu"
    assert isinstance(head.kernel, AmxLinear) and isinstance(qkv.kernel, AmxLinear)
    assert qkv.weight.device.type == "meta" and qkv.weight.shape == qkv_weight.shape
    hidden = torch.randn(3, 64).bfloat16()
    with torch.inference_mode():
        _assert_bf16_close(head(hidden), _reference(hidden, embed.weight, None))
        _assert_bf16_close(qkv(hidden), _reference(hidden, qkv_weight, qkv.bias))
    monkeypatch.setenv("OMNISERVE_CPU_AMX", "0")
    assert not AmxLinear.supports(embed.weight)
    assert apply_cpu_backend(model()[0], torch.bfloat16).placements == {
        "linear: C plain-layout bfloat16 (shared weight)": 1,
        "linear: oneDNN packed bfloat16": 3,
    }
    monkeypatch.setenv("OMNISERVE_CPU_AMX", "yes")
    with pytest.raises(ValueError, match="OMNISERVE_CPU_AMX must be"):
        AmxLinear.supports(embed.weight)


def test_prefill_sized_moe_runs_its_experts_on_amx(monkeypatch) -> None:
    """A bf16 prefill's per-expert products (past the MoE kernel's decode sizes) run on AMX on
    the experts as loaded and match the fp32 products of the same experts; fp32 rows, or AMX
    off, stay on F.linear."""
    calls = []
    product = linear_amx._product
    monkeypatch.setattr(linear_amx, "_product", lambda *a: calls.append(a[0].shape) or product(*a))
    gen = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        layer = FusedMoE(8, 2, 128, 96)
    layer.gate_up_proj = torch.nn.Parameter(
        (torch.randn(8, 192, 128, generator=gen) * 0.05).bfloat16()
    )
    layer.down_proj = torch.nn.Parameter((torch.randn(8, 128, 96, generator=gen) * 0.05).bfloat16())
    x = torch.randn(300, 128, generator=gen).bfloat16()
    weights, ids = select_experts(torch.randn(300, 8, generator=gen), 2, True)
    weights = weights.bfloat16()  # as the models route: in the activations' dtype
    expected = torch_fused_experts(
        x.float(), layer.gate_up_proj.float(), layer.down_proj.float(), weights, ids
    )
    with torch.inference_mode():
        got = CpuMoE(layer)(x, weights, ids)
    assert len(calls) == 2 * len(ids.unique())  # both projections of every expert with tokens
    torch.testing.assert_close(
        got.float(), expected, rtol=2e-2, atol=2e-2 * float(expected.abs().max())
    )
    calls.clear()
    fp32 = torch.randn(4, 128)
    assert torch.equal(plain_linear(fp32, fp32[:2]), F.linear(fp32, fp32[:2]))
    monkeypatch.setenv("OMNISERVE_CPU_AMX", "0")
    with torch.inference_mode():
        CpuMoE(layer)(x, weights, ids)
    assert calls == []
