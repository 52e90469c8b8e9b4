"""Expert parallelism (``--enable-expert-parallel``): each rank holds its share of the MoE
experts whole, computes the pairs routed to them and skips the others'; the ranks' parts add up
to the whole layer (the sum tensor parallelism already makes), with the torch reference and the
CPU's C kernel; the Triton kernel's skipping is checked in ``test_triton_fused_moe``, whole
engines at TP=2 in ``test_tensor_parallel``."""

from __future__ import annotations

import pytest
import torch

from omniserve.cpu.moe import CpuMoE
from omniserve.layers import fused_moe
from omniserve.layers.fused_moe import FusedMoE, expert_parallel, local_experts, select_experts

EXPERTS, TOP_K, HIDDEN, INTER = 7, 3, 64, 32


def test_placements():
    assert [local_experts(8, r, 3, "linear") for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [local_experts(8, r, 3, "round_robin") for r in range(3)] == [
        [0, 3, 6], [1, 4, 7], [2, 5],
    ]  # fmt: skip
    with pytest.raises(ValueError, match="expert placement must be one of"):
        with expert_parallel("striped"):
            pass


def _checkpoint() -> dict[tuple[int, str], torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = {"gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN),
              "down_proj": (HIDDEN, INTER)}  # fmt: skip
    return {(e, proj): torch.randn(*shape, generator=gen) * 0.1
            for e in range(EXPERTS) for proj, shape in shapes.items()}  # fmt: skip


def _layer(checkpoint: dict, placement: str | None = None) -> FusedMoE:
    with expert_parallel(placement):
        layer = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER)
    for (expert, proj), tensor in checkpoint.items():
        param = layer.down_proj if proj == "down_proj" else layer.gate_up_proj
        layer.weight_loader(param, tensor, expert, proj)
    return layer


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
@pytest.mark.parametrize("kernel", ["torch", "C"])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_ranks_parts_add_up_to_the_layer(placement, kernel, tokens, monkeypatch):
    checkpoint = _checkpoint()
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    weights, ids = select_experts(torch.randn(tokens, EXPERTS, generator=gen), TOP_K, True)
    whole = _layer(checkpoint)
    monkeypatch.setattr(fused_moe, "tp_all_reduce", lambda out: out)  # each rank's part
    parts = []
    for rank in range(3):
        monkeypatch.setattr(fused_moe, "get_tp_rank", lambda rank=rank: rank)
        monkeypatch.setattr(fused_moe, "get_tp_size", lambda: 3)
        layer = _layer(checkpoint, placement)
        assert layer.num_local_experts == len(local_experts(EXPERTS, rank, 3, placement))
        assert layer.gate_up_proj.shape == (layer.num_local_experts, 2 * INTER, HIDDEN)
        if kernel == "C":
            monkeypatch.setattr("omniserve.cpu.moe.MAX_ROUTED_PER_EXPERT", 1 << 30)
            assert CpuMoE.supports(layer)
            layer.kernel = CpuMoE(layer)
        with torch.inference_mode():
            parts.append(layer(x, weights, ids))
    monkeypatch.setattr(fused_moe, "get_tp_size", lambda: 1)
    with torch.inference_mode():
        expected = whole(x, weights, ids)
    torch.testing.assert_close(sum(parts), expected, atol=1e-5, rtol=1e-5)


def test_one_rank_is_unchanged():
    with expert_parallel("linear"):
        layer = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER)
    assert layer.placement is None and layer.expert_map is None
    assert layer.num_local_experts == EXPERTS and layer.intermediate_size_per_partition == INTER
