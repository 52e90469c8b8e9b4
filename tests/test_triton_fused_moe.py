"""The Triton fused-MoE kernel against the torch reference: on CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

pytest.importorskip("triton")  # a dependency only on Linux x86_64 (pyproject.toml)

from omniserve.layers import fused_moe, triton_fused_moe
from omniserve.layers.fused_moe import FusedMoE, select_experts, torch_fused_experts
from omniserve.layers.quantized_loading import expert_codes
from omniserve.layers.triton_fused_moe import align_pairs_by_expert, triton_fused_experts
from tests.test_quantized_experts import CONFIGS, load_experts, quantized_experts

GEN = torch.Generator().manual_seed(0)
Weights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # x, gate_up_proj, down_proj
InterpretedMoE = Callable[..., torch.Tensor]


@pytest.fixture(scope="module")
def interpreted() -> Iterator[InterpretedMoE]:
    """``triton_fused_experts`` run in a worker process started with TRITON_INTERPRET=1.

    Triton picks interpreter or compiler when each ``@triton.jit`` runs, including its own
    ``triton.language`` helpers (``tl.zeros``, ``tl.sigmoid``), so the variable must be set before
    triton is first imported. A fresh spawned process guarantees that whatever this session
    imported earlier, and keeps this process's kernels compiled for the GPU test.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        pool = multiprocessing.get_context("spawn").Pool(1)  # workers start (and copy env) here
    with pool:

        def run(*args: torch.Tensor) -> torch.Tensor:
            return pool.apply_async(triton_fused_experts, args).get(timeout=120)

        yield run


def make_weights(
    num_tokens: int, num_experts: int, hidden: int, inter: int, dtype: torch.dtype
) -> Weights:
    x = torch.randn(num_tokens, hidden, generator=GEN)
    gate_up_proj = torch.randn(num_experts, 2 * inter, hidden, generator=GEN) / hidden**0.5
    down_proj = torch.randn(num_experts, hidden, inter, generator=GEN) / inter**0.5
    return x.to(dtype), gate_up_proj.to(dtype), down_proj.to(dtype)


def skewed_routing(
    num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token from a lopsided popularity; the upper half never get a token."""
    popularity = torch.zeros(num_experts)
    popularity[: num_experts // 2] = 4.0 ** -torch.arange(num_experts // 2).float()
    topk_ids = torch.multinomial(
        popularity.expand(num_tokens, -1), top_k, replacement=False, generator=GEN
    )  # [num_tokens, top_k]
    topk_weights = torch.rand(num_tokens, top_k, generator=GEN) + 0.1
    return (topk_weights / topk_weights.sum(-1, keepdim=True)).to(dtype), topk_ids


@pytest.mark.parametrize("num_experts", [4, 8])
@pytest.mark.parametrize("num_tokens, block_m", [(1, 16), (7, 16), (33, 16), (100, 32)])
def test_alignment_groups_pairs_into_single_expert_blocks(
    num_tokens: int, block_m: int, num_experts: int
) -> None:
    _, topk_ids = skewed_routing(num_tokens, num_experts, 2, torch.float32)
    sorted_pair_ids, block_expert_ids = align_pairs_by_expert(topk_ids, num_experts, block_m)
    num_pairs = topk_ids.numel()
    counts = torch.bincount(topk_ids.flatten(), minlength=num_experts)
    blocks_used = int(((counts + block_m - 1) // block_m).sum())

    assert block_expert_ids.numel() * block_m == sorted_pair_ids.numel()
    assert (block_expert_ids[blocks_used:] == -1).all()
    real = sorted_pair_ids[sorted_pair_ids < num_pairs]
    assert torch.equal(real.sort().values, torch.arange(num_pairs, dtype=torch.int32))
    assert (sorted_pair_ids[blocks_used * block_m :] == num_pairs).all()
    for block, expert in enumerate(block_expert_ids[:blocks_used].tolist()):
        pairs = sorted_pair_ids[block * block_m : (block + 1) * block_m]
        pairs = pairs[pairs < num_pairs].long()
        assert pairs.numel() > 0
        assert (topk_ids.flatten()[pairs] == expert).all()
    # Every expert with pairs owns exactly ceil(count / block_m) blocks; idle experts own none.
    owned = torch.bincount(block_expert_ids[:blocks_used].long(), minlength=num_experts)
    assert torch.equal(owned, (counts + block_m - 1) // block_m)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("num_experts", [4, 8])
@pytest.mark.parametrize("num_tokens, hidden, inter", [(1, 32, 16), (7, 48, 24), (33, 64, 48)])
@pytest.mark.parametrize("routing", ["skewed", pytest.param("softmax", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_interpreted_kernel_matches_reference_fp32(
    interpreted: InterpretedMoE,
    routing: str,
    num_tokens: int,
    hidden: int,
    inter: int,
    num_experts: int,
    top_k: int,
) -> None:
    x, gate_up_proj, down_proj = make_weights(num_tokens, num_experts, hidden, inter, torch.float32)
    if routing == "skewed":
        topk_weights, topk_ids = skewed_routing(num_tokens, num_experts, top_k, torch.float32)
    else:
        logits = torch.randn(num_tokens, num_experts, generator=GEN)
        topk_weights, topk_ids = select_experts(logits, top_k, renormalize=False)
    expected = torch_fused_experts(x, gate_up_proj, down_proj, topk_weights, topk_ids)
    out = interpreted(x, gate_up_proj, down_proj, topk_weights, topk_ids)
    assert out.dtype == torch.float32 and out.shape == x.shape
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_interpreted_kernel_one_expert_spanning_many_blocks(interpreted: InterpretedMoE) -> None:
    x, gate_up_proj, down_proj = make_weights(33, 4, 40, 20, torch.float32)
    topk_ids = torch.full((33, 1), 2)  # 33 pairs on expert 2: three 16-row blocks, two padded
    topk_weights = torch.rand(33, 1, generator=GEN)
    expected = torch_fused_experts(x, gate_up_proj, down_proj, topk_weights, topk_ids)
    out = interpreted(x, gate_up_proj, down_proj, topk_weights, topk_ids)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def assert_half_precision_close(
    out: torch.Tensor, weights: Weights, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> None:
    """Close to the reference, and no further from the fp32 result than the reference is."""
    x, gate_up_proj, down_proj = weights
    routing = (topk_weights, topk_ids)
    expected = torch_fused_experts(x, gate_up_proj, down_proj, *routing).float()
    exact = torch_fused_experts(x.float(), gate_up_proj.float(), down_proj.float(), *routing)
    assert out.dtype == x.dtype
    torch.testing.assert_close(out.float(), expected, atol=4e-2, rtol=2e-2)
    ulp = torch.finfo(x.dtype).eps * exact.abs().max()
    assert (out.float() - exact).abs().max() <= 2 * (expected - exact).abs().max() + ulp


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("num_tokens, num_experts", [(1, 4), (7, 8), (33, 8), (33, 4)])
def test_interpreted_kernel_half_precision(
    interpreted: InterpretedMoE, num_tokens: int, num_experts: int, dtype: torch.dtype
) -> None:
    weights = make_weights(num_tokens, num_experts, 64, 48, dtype)
    topk_weights, topk_ids = skewed_routing(num_tokens, num_experts, 2, dtype)
    out = interpreted(*weights, topk_weights, topk_ids)
    assert_half_precision_close(out, weights, topk_weights, topk_ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["int4", "fp8", "fp8-channel"])
def test_interpreted_kernel_decodes_quantized_experts(
    interpreted: InterpretedMoE, fmt: str, dtype: torch.dtype
) -> None:
    """Quantized experts (4-bit in groups of 32, FP8 in 32 x 32 blocks or per output feature)
    decoded in the kernel: the products of the experts dequantized in the activations' dtype
    (fp32 to summation order; bf16 as close as the bf16 reference, whose weights are those)."""
    config = CONFIGS[fmt]
    matrices, gate_up, down = quantized_experts(config, experts=4, hidden=64, inter=64)
    layer = load_experts(FusedMoE(4, 2, 64, 64), config, matrices)
    codes = expert_codes(layer)
    x = torch.randn(9, 64, generator=GEN).to(dtype)
    topk_weights, topk_ids = skewed_routing(9, 4, 2, dtype)
    out = interpreted(x, *codes, topk_weights, topk_ids)
    weights = (x, gate_up.to(dtype), down.to(dtype))
    if dtype == torch.float32:
        expected = torch_fused_experts(*weights, topk_weights, topk_ids)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    else:
        assert_half_precision_close(out, weights, topk_weights, topk_ids)


def test_interpreted_kernel_matches_hf_block(interpreted: InterpretedMoE) -> None:
    config = Qwen3MoeConfig(
        hidden_size=32, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2
    )
    hf = Qwen3MoeSparseMoeBlock(config)
    for param in hf.parameters():
        param.data.copy_(torch.randn(*param.shape, generator=GEN) / 4)
    x = torch.randn(11, 32, generator=GEN)
    with torch.no_grad():
        topk_weights, topk_ids = select_experts(
            F.linear(x, hf.gate.weight), config.num_experts_per_tok, config.norm_topk_prob
        )
        out = interpreted(
            x,
            hf.experts.gate_up_proj.detach(),
            hf.experts.down_proj.detach(),
            topk_weights,
            topk_ids,
        )
        torch.testing.assert_close(out, hf(x[None])[0], atol=1e-5, rtol=1e-5)


def test_interpreted_kernel_edge_inputs(interpreted: InterpretedMoE) -> None:
    x, gate_up_proj, down_proj = make_weights(0, 4, 32, 16, torch.float32)
    empty_ids = torch.zeros(0, 2, dtype=torch.long)
    out = interpreted(x, gate_up_proj, down_proj, empty_ids.float(), empty_ids)
    assert out.shape == (0, 32)
    with pytest.raises(ValueError, match="dtype mismatch"):
        interpreted(x.bfloat16(), gate_up_proj, down_proj, empty_ids.float(), empty_ids)


def test_interpreted_kernel_skips_other_ranks_experts(interpreted: InterpretedMoE) -> None:
    """Expert parallelism: pairs of id E (experts another rank holds) are grouped last into
    blocks of expert -1 and add nothing; a token routed only there gets zeros."""
    x, gate_up_proj, down_proj = make_weights(9, 3, 32, 16, torch.float32)
    topk_weights = torch.rand(9, 2, generator=GEN)
    topk_ids = torch.randint(0, 4, (9, 2), generator=GEN)  # 3: another rank's
    topk_ids[0] = 3
    alignment = align_pairs_by_expert(topk_ids, 3, 4)
    skipped = (topk_ids.flatten() == 3).nonzero().flatten().int()
    blocks = alignment.block_expert_ids
    assert set(alignment.sorted_pair_ids.view(-1, 4)[blocks == -1].flatten().tolist()) >= set(
        skipped.tolist()
    )
    expected = torch_fused_experts(x, gate_up_proj, down_proj, topk_weights, topk_ids)
    out = interpreted(x, gate_up_proj, down_proj, topk_weights, topk_ids)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert not out[0].any()


@pytest.mark.slow
def test_cpu_dispatch_uses_torch_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> torch.Tensor:
        raise AssertionError("the Triton path must not run on CPU tensors")

    monkeypatch.setattr(triton_fused_moe, "triton_fused_experts", fail)
    x, gate_up_proj, down_proj = make_weights(5, 4, 32, 16, torch.float32)
    topk_weights, topk_ids = skewed_routing(5, 4, 2, torch.float32)
    out = fused_moe.fused_experts(x, gate_up_proj, down_proj, topk_weights, topk_ids)
    expected = torch_fused_experts(x, gate_up_proj, down_proj, topk_weights, topk_ids)
    assert torch.equal(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 257])
@pytest.mark.slow
def test_cuda_dispatch_runs_compiled_kernel(
    monkeypatch: pytest.MonkeyPatch, num_tokens: int, dtype: torch.dtype
) -> None:
    calls: list[int] = []
    compiled = triton_fused_moe.triton_fused_experts

    def spy(*args: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return compiled(*args)

    monkeypatch.setattr(triton_fused_moe, "triton_fused_experts", spy)
    x, gate_up_proj, down_proj = (t.cuda() for t in make_weights(num_tokens, 16, 256, 160, dtype))
    weights = (x, gate_up_proj, down_proj)
    logits = torch.randn(num_tokens, 16, generator=GEN).cuda()
    topk_weights, topk_ids = select_experts(logits.to(dtype), 4, renormalize=True)
    out = fused_moe.fused_experts(*weights, topk_weights, topk_ids)
    assert calls == [1]
    if dtype == torch.float32:
        expected = torch_fused_experts(*weights, topk_weights, topk_ids)
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    else:
        assert_half_precision_close(out, weights, topk_weights, topk_ids)


@pytest.mark.gpu
@pytest.mark.slow
def test_compiled_kernel_skips_other_ranks_experts() -> None:
    """Expert parallelism on the GPU: ids past the experts (another rank's) add nothing."""
    x, gate_up_proj, down_proj = (t.cuda() for t in make_weights(33, 6, 256, 160, torch.float32))
    topk_weights = torch.rand(33, 4, generator=GEN).cuda()
    topk_ids = torch.randint(0, 7, (33, 4), generator=GEN).cuda()  # 6: another rank's
    out = triton_fused_experts(x, gate_up_proj, down_proj, topk_weights, topk_ids)
    expected = torch_fused_experts(x, gate_up_proj, down_proj, topk_weights, topk_ids)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
