"""The CPU backend's kernels against torch references, in fp32 and bf16, and where the backend
puts them. bf16 kernels accumulate in fp32: they are held to the fp32 reference within bf16's
rounding of their inputs and outputs, at the real checkpoints' shapes too."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from omniserve.attention import Attention
from omniserve.cpu import activation as cpu_activation
from omniserve.cpu import linear as cpu_linear
from omniserve.cpu import moe as cpu_moe
from omniserve.cpu.backend import apply_cpu_backend, keep_bf16_weights
from omniserve.cpu.build import load_library
from omniserve.cpu.linear import (
    AMX_DECODED_KERNEL_MAX_ROWS,
    AMX_ROWS_KERNEL_MAX_ROWS,
    DECODED_KERNEL_MAX_ROWS,
    ROWS_KERNEL_MAX_ROWS,
    Int4Linear,
    RowsLinear,
    WidenedLinear,
    decoded_kernel_max_rows,
    onednn_packs,
    rows_kernel_max_rows,
)
from omniserve.cpu.moe import CpuMoE
from omniserve.cpu.norm_rope import qk_norm_rope
from omniserve.layers.activation import GELU, SiluAndMul, silu_and_mul
from omniserve.layers.fused_moe import FusedMoE, select_experts, torch_fused_experts
from omniserve.layers.layernorm import RMSNorm
from omniserve.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from omniserve.layers.quantization import dequantize, pack_nibbles
from omniserve.layers.rotary_embedding import QKRotary, apply_rotary_emb
from omniserve.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _kernels_built(kernel_threads: None) -> None:
    for source in ("moe.c", "linear_rows.c", "linear_int4.c", "paged_decode.c", "norm_rope.c"):
        assert load_library(source) is not None, f"{source} must build on this machine"


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: another summation order than BLAS (1e-6 of the largest output). bf16: the output's
    own rounding (2**-8 relative) plus that of inputs summed over K, bounded at 2% of the
    largest output."""
    scale = float(expected.detach().abs().max())
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 + 1e-6 * scale)
    else:
        torch.testing.assert_close(actual.float(), expected, rtol=1e-2, atol=2e-2 * scale)


def _linear(out_features: int, in_features: int, bias: bool, dtype: torch.dtype, seed: int):
    layer = ReplicatedLinear(in_features, out_features, bias=bias)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, generator=gen) * 0.1)
        if layer.bias is not None:
            layer.bias.copy_(torch.randn(out_features, generator=gen))
    return layer.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 700])
@pytest.mark.parametrize(("out_features", "in_features"), [(512, 256), (70, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_matches_torch(
    rows, out_features, in_features, bias, dtype, monkeypatch
) -> None:
    """Decode- and prefill-sized batches, widths that are not multiples of any blocking; the
    packed copy replaces the weight (a meta placeholder of the same shape remains). AMX off, as
    on CPUs without it (tests/test_cpu_amx.py covers AMX)."""
    monkeypatch.setenv("OMNISERVE_CPU_AMX", "0")
    layer = _linear(out_features, in_features, bias, dtype, rows)
    weight, bias_t = layer.weight.detach().float().clone(), layer.bias
    if not onednn_packs(dtype):  # bf16 on a CPU without AVX-512 BW/VL/DQ: torch computes it
        assert apply_cpu_backend(layer, dtype).placements == {"linear: torch": 1}
    else:
        assert apply_cpu_backend(layer, dtype).placements == {
            f"linear: oneDNN packed {str(dtype)[6:]}": 1
        }
        assert layer.weight.device.type == "meta" and layer.weight.shape == weight.shape
    x = torch.randn(rows, in_features).to(dtype)
    with torch.inference_mode():
        expected = F.linear(x.float(), weight, None if bias_t is None else bias_t.float())
        _close(layer(x), expected, dtype)


def test_packing_hands_freed_weights_back_as_it_goes(monkeypatch) -> None:
    """The originals packed copies replace are freed into the C heap, which is trimmed every
    ``TRIM_EVERY_BYTES`` of them and at the end (glibc kept them: the process grew by ~40% of
    the weights while packing)."""
    from omniserve.cpu import backend

    trims: list[int] = []
    monkeypatch.setattr(backend, "_trim_heap", lambda: trims.append(1))
    monkeypatch.setattr(backend, "TRIM_EVERY_BYTES", 2 * 512 * 256 * 4)  # two layers' weights
    model = torch.nn.Sequential(*(_linear(512, 256, False, torch.float32, i) for i in range(5)))
    assert apply_cpu_backend(model, torch.float32).placements == {
        "linear: oneDNN packed float32": 5
    }
    assert len(trims) == 2 + 1  # after the 2nd and 4th layers, and once at the end
    assert backend._malloc_trim() is not None  # glibc (this suite's Linux)


def test_onednn_linear_inputs_and_errors() -> None:
    """Rows of a wider tensor, 3-D and transposed inputs, empty batches; training or a dtype
    mismatch is a clear error, not a silent wrong answer."""
    layer = _linear(64, 128, True, torch.float32, 0)
    reference = functools.partial(F.linear, weight=layer.weight.detach().clone(),
                                  bias=layer.bias)  # fmt: skip
    apply_cpu_backend(layer, torch.float32)
    with torch.inference_mode():
        view = torch.randn(6, 400)[:, 100:228]
        _close(layer(view), reference(view), torch.float32)
        x3 = torch.randn(2, 3, 128)
        assert layer(x3).shape == (2, 3, 64)
        _close(layer(x3), reference(x3), torch.float32)
        columns = torch.randn(128, 4).t()
        _close(layer(columns), reference(columns), torch.float32)
        assert layer(torch.empty(0, 128)).shape == (0, 64)
        with pytest.raises(TypeError, match="input dtype torch.bfloat16 does not match"):
            layer(torch.randn(2, 128).bfloat16())
    with pytest.raises(RuntimeError, match="inference on CPU tensors only"):
        layer(torch.randn(2, 128, requires_grad=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 6, 13, ROWS_KERNEL_MAX_ROWS, ROWS_KERNEL_MAX_ROWS + 3])
def test_rows_linear_matches_torch(rows: int, dtype: torch.dtype) -> None:
    """The plain-layout kernel (tied LM heads): row tiles and weight blocks cut anywhere, a
    strided input; past its row limit it hands over to F.linear."""
    layer = _linear(131, 96, True, dtype, rows)
    kernel = RowsLinear(layer.weight, max_rows=ROWS_KERNEL_MAX_ROWS)
    x = torch.randn(rows, 200).to(dtype)[:, 50:146]
    with torch.inference_mode():
        expected = F.linear(x.float(), layer.weight.float(), layer.bias.float())
        _close(kernel(x, layer.bias), expected, dtype)
    assert not RowsLinear.supports(torch.zeros(8, 40))  # K not a multiple of 32


needs_widened = pytest.mark.skipif(
    not WidenedLinear.available(), reason="the bf16-weight kernel needs AVX-512"
)


@needs_widened
@pytest.mark.parametrize("rows", [1, 2, 13, 14, 15, 64, 197, 600])
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 64), (70, 1030), (33, 5)])
def test_widened_linear_is_fp32_on_the_bf16_weight(rows, out_features, in_features) -> None:
    """fp32 activations on a bf16 weight: the fp32 product of the widened weight, to fp32's
    summation-order tolerance, for row counts around the kernel's tiles (14) and row blocks
    (196), K across its 512-long slices and not a multiple of 16, a last panel of 1-31 output
    features, a strided input and a bias."""
    layer = _linear(out_features, in_features, True, torch.float32, rows)
    weight = layer.weight.detach().bfloat16()
    kernel = WidenedLinear(weight)
    x = torch.randn(rows, in_features + 9)[:, 4 : 4 + in_features]
    with torch.inference_mode():
        expected = F.linear(x, weight.float(), layer.bias)
        _close(kernel(x, layer.bias), expected, torch.float32)
        _close(kernel(x, None), F.linear(x, weight.float()), torch.float32)
        x3 = x.unsqueeze(0)
        _close(kernel(x3, None), F.linear(x3, weight.float()), torch.float32)
        assert kernel(torch.empty(0, in_features), None).shape == (0, out_features)
        with pytest.raises(TypeError, match="input dtype torch.bfloat16 does not match"):
            kernel(x.bfloat16(), None)


@needs_widened
def test_widened_linear_past_its_rows_widens_pieces_for_onednn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past ``max_rows`` the weight is widened back from its panels (exactly, any row range,
    panels cut anywhere) piece by piece for ``F.linear``: fp32's product."""
    weight = (torch.randn(70, 96) * 0.02).bfloat16()
    kernel = WidenedLinear(weight, max_rows=4)
    for start, end in ((0, 70), (3, 40), (31, 33), (64, 70), (5, 5)):
        rows = torch.empty(end - start, 96)
        kernel.widen(start, end, rows)
        assert torch.equal(rows, weight[start:end].float()), (start, end)
    monkeypatch.setattr(cpu_linear, "DEQUANTIZE_SCRATCH_BYTES", 25 * 96 * 4)  # 3 pieces
    x, bias = torch.randn(2, 9, 96), torch.randn(70)
    with torch.inference_mode():
        _close(kernel(x, bias), F.linear(x, weight.float(), bias), torch.float32)
        _close(kernel(x[0, :4], None), F.linear(x[0, :4], weight.float()), torch.float32)


@needs_widened
def test_bf16_weights_are_kept_for_an_fp32_model_of_a_bf16_checkpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before loading, the linear layers, MoE experts and token embeddings of an fp32 model of a
    bf16 checkpoint take bf16 weights (keeping their loaders; a tied head keeps sharing its
    embedding's), but not when any matrix of the checkpoint (quantized ones' scales aside) is
    stored in another dtype, not for
    a bf16 model, and not when OMNISERVE_CPU_BF16_WEIGHTS=0. The backend then widens them in its
    kernels, and the embedding returns fp32 rows: the fp32 model's results."""

    def model():
        model = torch.nn.Module()
        model.qkv = QKVParallelLinear(64, 16, 4, 2, bias=True)
        model.embed = VocabParallelEmbedding(100, 64)
        model.head = ParallelLMHead(100, 64)
        model.head.weight = model.embed.weight
        model.experts = FusedMoE(4, 2, 64, 32)
        return model

    matrix, norm = torch.Size([8, 8]), torch.Size([8])
    bf16 = {"a": (matrix, torch.bfloat16), "norm": (norm, torch.float32)}  # 1-D: not a matrix
    assert keep_bf16_weights(model(), torch.float32, {**bf16, "b": (matrix, torch.float32)}) == 0
    quantized = {"q.qweight": (matrix, torch.int32), "q.scales": (matrix, torch.float16),
                 "e.weight_scale": (matrix, torch.float32)}  # fmt: skip
    assert keep_bf16_weights(model(), torch.float32, {**bf16, **quantized}) == 4  # scales aside
    assert keep_bf16_weights(model(), torch.bfloat16, bf16) == 0
    monkeypatch.setenv("OMNISERVE_CPU_BF16_WEIGHTS", "0")
    assert keep_bf16_weights(model(), torch.float32, bf16) == 0
    monkeypatch.setenv("OMNISERVE_CPU_BF16_WEIGHTS", "1")
    kept = model()
    loader = kept.qkv.weight.weight_loader
    assert keep_bf16_weights(kept, torch.float32, bf16) == 4  # qkv, embedding, both experts
    assert kept.experts.down_proj.dtype == torch.bfloat16
    assert kept.experts.gate_up_proj.shard_ids == {(e, s) for e in range(4)
                                                   for s in ("gate_proj", "up_proj")}  # fmt: skip
    assert kept.qkv.weight.dtype == torch.bfloat16 and kept.qkv.weight.weight_loader == loader
    assert kept.qkv.weight.shard_ids == {("q",), ("k",), ("v",)}
    assert kept.head.weight.dtype == torch.bfloat16 and kept.head.weight is kept.embed.weight
    assert kept.qkv.bias.dtype == torch.float32 and kept.embed.activation_dtype == torch.float32
    with torch.no_grad():
        for param in kept.parameters():
            param.copy_(torch.randn(param.shape))
    qkv = kept.qkv.weight.detach().float().clone(), kept.qkv.bias.detach().clone()
    table = kept.embed.weight.detach().float().clone()
    assert apply_cpu_backend(kept, torch.float32).placements == {
        "linear: C bf16 weights, fp32 activations": 1,
        "linear: C plain-layout bf16 weights, fp32 activations (shared weight)": 1,
        "MoE: C bf16 weights, fp32 activations": 1,
    }
    assert kept.qkv.weight.device.type == "meta"
    ids = torch.tensor([3, 99, 0])
    with torch.inference_mode():
        assert torch.equal(kept.embed(ids), table[ids])
        for rows in (5, ROWS_KERNEL_MAX_ROWS + 1):  # the head: its kernel, then F.linear
            x = torch.randn(rows, 64)
            _close(kept.qkv(x), F.linear(x, *qkv), torch.float32)
            _close(kept.head(x), F.linear(x, table), torch.float32)
    with pytest.raises(ValueError, match="OMNISERVE_CPU_BF16_WEIGHTS must be"):
        monkeypatch.setenv("OMNISERVE_CPU_BF16_WEIGHTS", "yes")
        keep_bf16_weights(model(), torch.float32, bf16)


@needs_widened
@pytest.mark.parametrize("rows", [1, 7, ROWS_KERNEL_MAX_ROWS, ROWS_KERNEL_MAX_ROWS + 3])
def test_rows_linear_takes_fp32_rows_on_a_bf16_weight(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tied head kept bf16 under fp32 activations: the kernel widens the weight up to its row
    limit; past it, F.linear runs on the weight widened piece by piece (pieces forced small)."""
    monkeypatch.setattr(cpu_linear, "DEQUANTIZE_SCRATCH_BYTES", 40 * 96 * 4)
    weight = (torch.randn(131, 96) * 0.1).bfloat16()
    bias = torch.randn(131)
    kernel = RowsLinear(weight, torch.float32)
    assert RowsLinear.supports(weight, torch.float32)
    assert not RowsLinear.supports(weight, torch.float16)
    x = torch.randn(rows, 200)[:, 50:146]
    with torch.inference_mode():
        _close(kernel(x, bias), F.linear(x, weight.float(), bias), torch.float32)
        with pytest.raises(TypeError, match="input dtype torch.bfloat16 does not match"):
            kernel(x.bfloat16(), None)


def test_rows_kernel_hands_bf16_to_onednn_where_the_cpu_has_amx(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """AMX multiplies bf16 faster than the kernel's dot products from 3 rows; fp32 never runs on
    AMX, and a CPU without it keeps the kernel up to 64 rows."""
    for amx, bf16_rows in ((True, AMX_ROWS_KERNEL_MAX_ROWS), (False, ROWS_KERNEL_MAX_ROWS)):
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda amx=amx: {"amx_bf16": amx})
        rows_kernel_max_rows.cache_clear()
        assert rows_kernel_max_rows(torch.bfloat16) == bf16_rows
        assert rows_kernel_max_rows(torch.float32) == ROWS_KERNEL_MAX_ROWS
    rows_kernel_max_rows.cache_clear()


def _int4_weights(out_features: int, in_features: int, group_size: int, seed: int):
    """``qweight``, ``qzeros``, ``scales`` in ``layers.quantization``'s layout."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.uint8)
    groups = (out_features, in_features // group_size)
    zeros = torch.randint(0, 16, groups, generator=gen, dtype=torch.uint8)
    return pack_nibbles(codes), zeros, torch.rand(groups, generator=gen) * 0.05


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("rows", [1, 3, 5, 9])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_linear_matches_the_dequantized_weight(rows, group_size, bias, dtype) -> None:
    """The fused kernel (up to 8 rows here) and the decode-then-``F.linear`` path above it, on
    100 output rows (blocks of 48 and tiles of 6 cut anywhere) and rows of a wider input, against
    the torch reference's weight (bf16: the same rounded weights, multiplied in fp32)."""
    qweight, qzeros, scales = _int4_weights(100, 384, group_size, rows)
    assert Int4Linear.supports(qweight, qzeros, scales, dtype)
    kernel = Int4Linear(qweight, qzeros, scales, dtype, max_rows=8)
    bias_t = torch.randn(100) if bias else None  # fp32: cast to the activations' dtype
    x = torch.randn(rows, 400).to(dtype)[:, 8:392]
    weight = dequantize(qweight, qzeros, scales, dtype).float()
    with torch.inference_mode():
        got = kernel(x, bias_t)
    expected = F.linear(x.float(), weight, None if bias_t is None else bias_t.to(dtype).float())
    assert got.dtype == dtype
    _close(got, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("in_features", "group_size"), [(2176, 128), (2144, 32)])
@pytest.mark.parametrize("rows", [1, 5])
def test_int4_linear_sums_long_rows_slice_by_slice(rows, in_features, group_size, dtype) -> None:
    """Rows of over 2,048 features are multiplied in slices of whole groups (here two, the
    second shorter), summed in fp32, the bias added once."""
    qweight, qzeros, scales = _int4_weights(100, in_features, group_size, rows)
    bias = torch.randn(100).to(dtype)
    x = torch.randn(rows, in_features).to(dtype)
    with torch.inference_mode():
        got = Int4Linear(qweight, qzeros, scales, dtype, max_rows=8)(x, bias)
    weight = dequantize(qweight, qzeros, scales, dtype).float()
    _close(got, F.linear(x.float(), weight, bias.float()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_linear_shapes_and_its_decoding(dtype: torch.dtype, monkeypatch) -> None:
    """Leading dims on both paths; the decoded weight is the torch reference's, bit for bit (zero,
    denormal and huge scales too); past the scratch's size the weight is decoded in pieces, and
    two layers in turn reuse one scratch."""
    qweight, qzeros, scales = _int4_weights(100, 256, 64, 0)
    scales[0, :3] = torch.tensor([0.0, 1e-40, 1e37])
    kernel = Int4Linear(qweight, qzeros, scales, dtype, max_rows=8)
    assert torch.equal(kernel.dequantize(), dequantize(qweight, qzeros, scales, dtype))
    scales[0, :3] = 0.01
    monkeypatch.setattr(cpu_linear, "DEQUANTIZE_SCRATCH_BYTES", 100 * 256 * 2 // 3)
    other_weights = _int4_weights(100, 256, 64, 1)
    other = Int4Linear(*other_weights, dtype, max_rows=8)
    with torch.inference_mode():
        for shape in ((2, 3, 256), (2, 5, 256)):  # 6 rows fused, 10 decoded
            x = torch.randn(shape).to(dtype)
            for layer, weights in ((kernel, (qweight, qzeros, scales)), (other, other_weights)):
                got = layer(x, None)
                assert got.shape == (*shape[:-1], 100)
                _close(got, F.linear(x.float(), dequantize(*weights, torch.float32)), dtype)
        assert kernel(torch.empty(0, 256).to(dtype), None).shape == (0, 100)
        with pytest.raises(TypeError, match="does not match"):
            kernel(torch.randn(2, 256).to(torch.float16), None)


def test_int4_linear_refuses_shapes_off_the_kernel() -> None:
    """K and the group size must be multiples of 32; the layout's dtypes, contiguous."""
    assert Int4Linear.supports(*_int4_weights(8, 64, 32, 0), torch.bfloat16)
    assert not Int4Linear.supports(*_int4_weights(8, 48, 48, 0), torch.float32)  # K % 32
    assert not Int4Linear.supports(*_int4_weights(8, 64, 16, 0), torch.float32)  # groups of 16
    assert not Int4Linear.supports(*_int4_weights(8, 64, 32, 0), torch.float16)
    qweight, qzeros, scales = _int4_weights(8, 64, 32, 0)
    assert not Int4Linear.supports(qweight, qzeros, scales.double(), torch.float32)
    assert not Int4Linear.supports(qweight.t().contiguous().t(), qzeros, scales, torch.float32)


def test_int4_kernel_hands_bf16_to_onednn_sooner_where_the_cpu_has_amx(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for amx, bf16_rows in ((True, AMX_DECODED_KERNEL_MAX_ROWS), (False, DECODED_KERNEL_MAX_ROWS)):
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda amx=amx: {"amx_bf16": amx})
        decoded_kernel_max_rows.cache_clear()
        assert decoded_kernel_max_rows(torch.bfloat16) == bf16_rows
        assert decoded_kernel_max_rows(torch.float32) == DECODED_KERNEL_MAX_ROWS
    decoded_kernel_max_rows.cache_clear()


@pytest.mark.parametrize("dtype", DTYPES)
def test_tied_lm_head_keeps_the_shared_embedding(dtype: torch.dtype, monkeypatch) -> None:
    """A head tied to the embedding stays in its layout (one copy) on the plain-layout kernel;
    the other linears are packed and their originals released (AMX off, as on CPUs without
    it: tests/test_cpu_amx.py covers AMX)."""
    monkeypatch.setenv("OMNISERVE_CPU_AMX", "0")
    embed = VocabParallelEmbedding(300, 64).to(dtype)
    torch.nn.init.normal_(embed.weight)
    head = ParallelLMHead(300, 64).to(dtype)
    head.weight = embed.weight
    model = torch.nn.ModuleList([embed, head, QKVParallelLinear(64, 16, 4, 2).to(dtype),
                                 RowParallelLinear(64, 64).to(dtype)])  # fmt: skip
    name = str(dtype)[6:]
    packed = f"linear: oneDNN packed {name}" if onednn_packs(dtype) else "linear: torch"
    assert apply_cpu_backend(model, dtype).placements == {
        f"linear: C plain-layout {name} (shared weight)": 1,
        packed: 2,
    }
    assert head.weight is embed.weight and embed.weight.device.type == "cpu"
    assert isinstance(head.kernel, RowsLinear)
    hidden = torch.randn(3, 64).to(dtype)
    with torch.inference_mode():
        _close(head(hidden), F.linear(hidden.float(), embed.weight.float()), dtype)


def _moe_case(tokens, dtype, experts=8, top_k=2, hidden=128, inter=96, seed=None):
    gen = torch.Generator().manual_seed(tokens if seed is None else seed)
    x = torch.randn(tokens, hidden, generator=gen)
    with torch.device("meta"):
        layer = FusedMoE(experts, top_k, hidden, inter)
    layer.gate_up_proj = torch.nn.Parameter(
        torch.randn(experts, 2 * inter, hidden, generator=gen, dtype=dtype) * 0.05
    )
    layer.down_proj = torch.nn.Parameter(
        torch.randn(experts, hidden, inter, generator=gen, dtype=dtype) * 0.05
    )
    weights, ids = select_experts(torch.randn(tokens, experts, generator=gen), top_k, True)
    return x.to(dtype), layer, weights, ids


def _moe_reference(x, layer, weights, ids) -> torch.Tensor:
    """torch_fused_experts in fp32 over the experts the batch selects (not all 128)."""
    active, local_ids = ids.unique(return_inverse=True)
    gate_up, down = (w.detach()[active].float() for w in (layer.gate_up_proj, layer.down_proj))
    return torch_fused_experts(x.float(), gate_up, down, weights.float(), local_ids)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 2, 7, 33, 64, 300])
def test_moe_matches_the_reference(
    tokens: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Experts with 0 to many rows (row tiles of 4 cut anywhere), every activation range, H off
    the 64-row work blocks (the kernel at every size: prefill-sized batches would go to torch)."""
    monkeypatch.setattr(cpu_moe, "MAX_ROUTED_PER_EXPERT", 1 << 30)
    x, layer, weights, ids = _moe_case(tokens, dtype, hidden=96)
    x[0] *= 40  # large gate values: silu's exp at both ends of its range
    assert CpuMoE.supports(layer)
    with torch.inference_mode():
        _close(CpuMoE(layer)(x, weights, ids), _moe_reference(x, layer, weights, ids), dtype)


@needs_widened
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_moe_takes_fp32_rows_on_bf16_experts(tokens: int) -> None:
    """Experts kept bf16 under fp32 activations (``keep_bf16_weights``): the kernel at decode
    sizes and torch's per-expert products past them (each expert widened) both give the fp32
    products of the widened experts; the backend places and names the kernel."""
    x, layer, weights, ids = _moe_case(tokens, torch.float32, hidden=96)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            setattr(layer, name, torch.nn.Parameter(getattr(layer, name).bfloat16()))
    expected = _moe_reference(x, layer, weights, ids)
    assert apply_cpu_backend(layer, torch.float32).placements == {
        "MoE: C bf16 weights, fp32 activations": 1
    }
    with torch.inference_mode():
        _close(layer.kernel(x, weights, ids), expected, torch.float32)
        _close(torch_fused_experts(x, layer.gate_up_proj, layer.down_proj, weights, ids),
               expected, torch.float32)  # fmt: skip
    assert not CpuMoE.supports(layer, torch.float16)


@pytest.fixture(scope="module")
def flagship_moe() -> FusedMoE:
    """Qwen3-Omni-30B-A3B's expert block: hidden 2048, 128 experts of width 768 (bf16). The
    weights repeat a random 256-wide block along the hidden axis (drawing 400M fresh normals
    takes ~10 s; the shapes, not the values, are what this checks)."""
    gen = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        layer = FusedMoE(128, 8, 2048, 768)
    block = (torch.randn(128, 2 * 768, 256, generator=gen) * 0.05).bfloat16()
    layer.gate_up_proj = torch.nn.Parameter(block.repeat(1, 1, 8))
    down = (torch.randn(128, 2048, 96, generator=gen) * 0.05).bfloat16()
    layer.down_proj = torch.nn.Parameter(down.repeat(1, 1, 8))
    return layer


@pytest.mark.parametrize("tokens", [1, 8, 40])
@pytest.mark.slow
def test_bf16_moe_at_the_flagship_shape(tokens: int, flagship_moe: FusedMoE) -> None:
    """Top-8 routing over the 128 experts, decode and small-prefill batch sizes."""
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 2048, generator=gen).bfloat16()
    weights, ids = select_experts(torch.randn(tokens, 128, generator=gen), 8, True)
    with torch.inference_mode():
        got = CpuMoE(flagship_moe)(x, weights, ids)
    _close(got, _moe_reference(x, flagship_moe, weights, ids), torch.bfloat16)


def test_prefill_sized_moe_batches_take_the_grouped_gemms(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above MAX_ROUTED_PER_EXPERT routed tokens per expert the kernel is not called (its cost
    grows per token; the per-expert GEMMs read each expert once); at or below it, it is."""
    calls = []
    x, layer, weights, ids = _moe_case(64, torch.float32)
    moe = CpuMoE(layer)
    kernel = moe.kernel
    monkeypatch.setattr(moe, "kernel", lambda *args: calls.append(args[1]) or kernel(*args))
    num_experts, top_k = layer.gate_up_proj.shape[0], ids.shape[1]
    decode = cpu_moe.MAX_ROUTED_PER_EXPERT * num_experts // top_k
    with torch.inference_mode():
        for n in (decode, decode + 1, 64):
            _close(
                moe(x[:n], weights[:n], ids[:n]),
                _moe_reference(x[:n], layer, weights[:n], ids[:n]),
                torch.float32,
            )
    assert calls == [decode]


def test_moe_top1_all_on_one_expert_and_chunked_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_moe, "TOKENS_PER_CALL", 4)
    x, layer, _, _ = _moe_case(9, torch.float32)
    ids, weights = torch.full((9, 1), 5), torch.rand(9, 1)
    with torch.inference_mode():
        got = CpuMoE(layer)(x, weights, ids)
    _close(got, _moe_reference(x, layer, weights, ids), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_bad_expert_id_is_a_clear_error(dtype: torch.dtype) -> None:
    x, layer, weights, ids = _moe_case(4, dtype)
    for bad in (9, -1):  # (8: another rank's expert, skipped; see test_expert_parallel)
        ids[2, 1] = bad
        with torch.inference_mode(), pytest.raises(ValueError, match=r"ids must lie in \[0, 8\]"):
            CpuMoE(layer)(x, weights, ids)


def test_moe_shapes_off_the_kernel_stay_on_torch() -> None:
    assert not CpuMoE.supports(FusedMoE(8, 2, 100, 64))  # H not a multiple of 32
    assert not CpuMoE.supports(FusedMoE(8, 2, 128, 48))  # I not a multiple of 32
    assert not CpuMoE.supports(FusedMoE(8, 2, 128, 64).double())
    layer = FusedMoE(8, 2, 100, 64)
    assert apply_cpu_backend(layer, torch.float32).placements == {"MoE: torch": 1}
    assert layer.kernel is None


def _rarely_a_step_apart(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal but for a few elements: the norm's sum of squares is added in another order, which
    now and then moves the normalised value across a rounding boundary (one bf16 step), and
    scaling by the weight and rounding again can make that two steps of the output."""
    step = expected.float().abs().clamp_min(1e-30) * 2**-6
    assert bool(((actual.float() - expected.float()).abs() <= step).all())
    assert (actual != expected).float().mean() < 0.01


@pytest.mark.parametrize("cols", [2048, 1536, 100])
def test_bf16_rms_norm_kernel_matches_transformers_rounding(
    cols: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from omniserve.cpu import norm_rope

    calls: list[bool] = []  # whether each kernel call had a residual
    kernel = norm_rope._rms_kernel()

    def counted(*args: object) -> None:
        calls.append(args[4] is not None)
        kernel(*args)

    monkeypatch.setattr(norm_rope, "_rms_kernel", lambda: counted)
    gen = torch.Generator().manual_seed(cols)
    layer = RMSNorm(cols, eps=1e-6)
    layer.weight.data.copy_(torch.randn(cols, generator=gen))
    layer = layer.bfloat16()
    x = (torch.randn(3, 37, cols + 8, generator=gen) * 5).bfloat16()[..., 4 : cols + 4]
    rows = (torch.randn(111, cols + 8, generator=gen) * 5).bfloat16()[:, 4 : cols + 4]
    residual = (torch.randn(111, cols, generator=gen) * 5).bfloat16()
    expected = layer(x)  # the torch reference (no kernel yet)
    expected_sum, expected_normed = layer.add_forward(rows, residual)
    placements = apply_cpu_backend(layer, torch.bfloat16).placements
    assert placements == {"RMSNorm (+ residual add): C bfloat16": 1}
    with torch.inference_mode():
        got = layer(x)
        got_sum, got_normed = layer.add_forward(rows, residual)  # rows of a wider tensor
    assert got.shape == expected.shape and got.dtype == torch.bfloat16
    _rarely_a_step_apart(got, expected)
    assert calls == [False, True]  # both ran in the kernel
    assert torch.equal(got_sum, expected_sum)  # rounded as torch's bf16 add rounds
    _rarely_a_step_apart(got_normed, expected_normed)


@pytest.mark.parametrize("shape", [(64, 4304), (3, 1000), (1, 7)])
def test_bf16_gelu_tanh_kernel_matches_torch_rounding(
    shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tanh form in one pass: torch's bf16 results where they are not tiny (|y| > 1e-2),
    within 1e-6 of the largest elsewhere (its exp is within 2 ulp of torch's); the erf form keeps
    torch's, which is as fast."""
    monkeypatch.setattr(cpu_activation, "GELU_MIN_ELEMENTS", 1)  # small inputs take it too
    gen = torch.Generator().manual_seed(shape[1])
    x = (torch.randn(*shape, generator=gen) * 4).bfloat16()
    tanh, erf = GELU("tanh"), GELU()
    expected = tanh(x)  # the torch reference (no kernel yet)
    report = apply_cpu_backend(nn.Sequential(tanh, erf), torch.bfloat16)
    assert report.placements == {"GELU (tanh form): C bfloat16": 1}
    assert tanh.kernel is not None and erf.kernel is None
    with torch.inference_mode():
        got = tanh(x)
    visible = expected.float().abs() > 1e-2
    assert torch.equal(got[visible], expected[visible])
    torch.testing.assert_close(got.float(), expected.float(), rtol=0,
                               atol=1e-6 * expected.float().abs().max().item())  # fmt: skip


@pytest.mark.parametrize("width", [8960, 1000, 7])
def test_bf16_silu_and_mul_kernel_matches_torch_rounding(
    width: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One pass over strided rows (a row splits into blocks; a width not a multiple of 16 ends
    in the scalar loop): torch's two roundings, the exp an ulp apart at most."""
    monkeypatch.setattr(cpu_activation, "MIN_ELEMENTS", 1)  # small inputs take it too
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(5, 2 * width + 6, generator=gen) * 4).bfloat16()[:, 3 : 2 * width + 3]
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, float("inf")])
    layer = SiluAndMul()
    expected = layer(x)  # the torch reference (no kernel yet)
    fp32 = torch.nn.Sequential(ReplicatedLinear(4, 4), SiluAndMul())
    assert apply_cpu_backend(fp32, torch.float32).placements == {"linear: oneDNN packed float32": 1}
    model = torch.nn.Sequential(ReplicatedLinear(4, 4).bfloat16(), layer)
    assert apply_cpu_backend(model, torch.bfloat16).placements["SiLU-and-mul: C bfloat16"] == 1
    with torch.inference_mode():
        got = layer(x)
        assert torch.equal(layer(x.float()), silu_and_mul(x.float()))  # fp32: torch's
    assert got.shape == expected.shape == (5, width) and got.dtype == torch.bfloat16
    _rarely_a_step_apart(got[:, 4:], expected[:, 4:])
    assert got[0, :4].tolist()[1:] == expected[0, :4].tolist()[1:]  # silu(-100) is ~0 in both
    assert abs(got[0, 0].item()) < 1e-30


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
def test_qk_norm_rope_kernel_matches_the_torch_ops(with_norm, rotary_fraction, dtype) -> None:
    """The one-pass kernel on views of a qkv output: the rotation is bit-identical to the
    torch ops (in bf16 too: each product and sum rounded as torch's bf16 ops round them); the
    norm only adds its squares in another order."""
    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, dim = 37, 4, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 3
    half = int(dim * rotary_fraction) // 2
    cos = torch.randn(tokens, half, generator=gen).repeat(1, 2)
    sin = torch.randn(tokens, half, generator=gen).repeat(1, 2)
    q_norm, k_norm = (RMSNorm(dim, eps=1e-6) if with_norm else None for _ in range(2))
    for norm in (q_norm, k_norm):
        if norm is not None:
            norm.weight.data.copy_(torch.randn(dim, generator=gen))

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = t.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        return q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)

    qkv, cos, sin = qkv.to(dtype), cos.to(dtype), sin.to(dtype)
    q_norm, k_norm = (None if n is None else n.to(dtype) for n in (q_norm, k_norm))
    with torch.inference_mode():
        q, k = views(qkv.clone())
        if with_norm:
            q, k = q_norm(q), k_norm(k)
        expected = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        fused = qkv.clone()
        q, k = qk_norm_rope(*views(fused), cos, sin, q_norm, k_norm)
        assert q.data_ptr() == fused.data_ptr()  # in place, in the qkv buffer
        for got, want in zip((q, k), expected, strict=True):
            if not with_norm:
                assert torch.equal(got, want)
            elif dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
            else:
                _rarely_a_step_apart(got, want)
        assert torch.equal(fused[:, (heads + kv_heads) * dim :], qkv[:, (heads + kv_heads) * dim :])


@pytest.mark.parametrize("with_norm", [True, False])
def test_qk_rope_with_fp32_angles_rotates_in_fp32(with_norm) -> None:
    """bf16 q/k with the vision towers' fp32 angles: the kernel and the torch reference equal
    transformers' ``apply_rotary_pos_emb_vision`` bit for bit (fp32 products, one rounding)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision

    gen = torch.Generator().manual_seed(1)
    tokens, heads, dim = 29, 3, 80
    qkv = (torch.randn(tokens, 3 * heads * dim, generator=gen) * 3).to(torch.bfloat16)
    angles = torch.randn(tokens, dim // 2, generator=gen).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    q_norm, k_norm = (RMSNorm(dim, eps=1e-6) if with_norm else None for _ in range(2))
    for norm in (q_norm, k_norm):
        if norm is not None:
            norm.weight.data.copy_(torch.randn(dim, generator=gen))
            norm.to(torch.bfloat16)

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = t.view(tokens, 3, heads, dim).unbind(1)
        return q, k

    with torch.inference_mode():
        q, k = views(qkv.clone())
        if with_norm:
            q, k = q_norm(q), k_norm(k)
        expected = apply_rotary_pos_emb_vision(q, k, cos, sin)
        reference = QKRotary()(*views(qkv.clone()), cos, sin, q_norm, k_norm)
        fused = qkv.clone()
        got = qk_norm_rope(*views(fused), cos, sin, q_norm, k_norm)
        assert got[0].data_ptr() == fused.data_ptr()  # the kernel ran, in place
        for pair in (reference, got):
            for actual, want in zip(pair, expected, strict=True):
                assert actual.dtype == torch.bfloat16
                if with_norm and pair is got:  # the norm's squares add in another order
                    _rarely_a_step_apart(actual, want)
                else:
                    assert torch.equal(actual, want)


def test_backend_places_each_layer_kind_and_can_be_turned_off(monkeypatch) -> None:
    model = torch.nn.ModuleList([ReplicatedLinear(64, 32), FusedMoE(4, 2, 64, 32), QKRotary(),
                                 Attention(4, 16, 0.25, num_kv_heads=2)])  # fmt: skip
    monkeypatch.setenv("OMNISERVE_CPU_KERNELS", "torch")
    report = apply_cpu_backend(model, torch.float32)
    assert not report.placements and "off" in report.summary()
    assert model[0].kernel is None and model[0].weight.device.type == "cpu"
    monkeypatch.delenv("OMNISERVE_CPU_KERNELS")
    report = apply_cpu_backend(model, torch.float32)
    assert report.placements == {
        "linear: oneDNN packed float32": 1, "MoE: C float32": 1, "q/k norm + RoPE: C": 1,
        "attention: C decode + SDPA prefill": 1,
    }  # fmt: skip
    assert model[3].backend.name == "cpu"
