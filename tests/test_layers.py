"""Shared layers against transformers' modules, TP sharding simulated per rank, weight loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import LlamaConfig, Qwen3MoeConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from omniserve.layers import fused_moe, linear, vocab_embedding
from omniserve.layers.activation import SiluAndMul, get_act_and_mul
from omniserve.layers.fused_moe import FusedMoE
from omniserve.layers.layernorm import RMSNorm
from omniserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from omniserve.layers.rotary_embedding import apply_rotary_emb, get_rope
from omniserve.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from omniserve.layers.weight_utils import load_weights_by_route, route_stacked
from omniserve.worker import model_loader
from omniserve.worker.model_loader import iterate_checkpoint_weights, load_model_weights

GEN = torch.Generator().manual_seed(0)


def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN).to(dtype)


def as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, size: int, *modules: object) -> None:
    """Make layers built next act as rank ``rank`` of ``size`` (collectives stay local)."""
    for module in modules:
        monkeypatch.setattr(module, "get_tp_rank", lambda: rank)
        monkeypatch.setattr(module, "get_tp_size", lambda: size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_hf_bitwise(dtype: torch.dtype) -> None:
    ours, hf = RMSNorm(48, eps=1e-5), LlamaRMSNorm(48, eps=1e-5)
    weight = randn(48)
    ours.weight.data.copy_(weight)
    hf.weight.data.copy_(weight)
    ours, hf = ours.to(dtype), hf.to(dtype)
    x = randn(5, 3, 48, dtype=dtype) * 7
    assert torch.equal(ours(x), hf(x))


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rotary_matches_hf(rope: dict) -> None:
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_parameters=dict(rope),
    )
    ours, hf = get_rope(config, 16), LlamaRotaryEmbedding(config)
    positions = torch.tensor([0, 1, 5, 63, 64, 200, 255])
    q, k = randn(7, 4, 16), randn(7, 2, 16)
    cos, sin = ours(positions, torch.float32)
    hf_cos, hf_sin = hf(q, positions[None])
    torch.testing.assert_close(cos, hf_cos[0], atol=0, rtol=0)
    torch.testing.assert_close(sin, hf_sin[0], atol=0, rtol=0)
    hf_q, hf_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin
    )
    torch.testing.assert_close(apply_rotary_emb(q, cos, sin), hf_q[0].transpose(0, 1))
    torch.testing.assert_close(apply_rotary_emb(k, cos, sin), hf_k[0].transpose(0, 1))


def test_rotary_partial_and_unsupported() -> None:
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5},
    )
    rope = get_rope(config, 16)
    cos, sin = rope(torch.arange(3), torch.float32)
    assert cos.shape == (3, 8)
    x = randn(3, 2, 16)
    out = apply_rotary_emb(x, cos, sin)
    assert torch.equal(out[..., 8:], x[..., 8:])  # the pass-through half is untouched
    torch.testing.assert_close(out[..., :8], apply_rotary_emb(x[..., :8].contiguous(), cos, sin))
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 100.0, "factor": 2.0}
    with pytest.raises(ValueError, match="dynamic"):
        get_rope(config, 16)


def test_silu_and_mul() -> None:
    x = randn(4, 10)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :5]) * x[:, 5:])
    with pytest.raises(ValueError, match="gelu"):
        get_act_and_mul("gelu")


def test_fused_linears_load_separate_checkpoint_matrices() -> None:
    hidden, head, heads, kv_heads = 32, 8, 4, 2
    wq, wk = randn(heads * head, hidden), randn(kv_heads * head, hidden)
    wv = randn(kv_heads * head, hidden)
    bq, bk, bv = randn(heads * head), randn(kv_heads * head), randn(kv_heads * head)
    qkv = QKVParallelLinear(hidden, head, heads, kv_heads, bias=True)
    for shard, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
        qkv.weight.weight_loader(qkv.weight, w, shard)
        qkv.bias.weight_loader(qkv.bias, b, shard)
    x = randn(3, hidden)
    expected = torch.cat([F.linear(x, w, b) for w, b in ((wq, bq), (wk, bk), (wv, bv))], -1)
    torch.testing.assert_close(qkv(x), expected)
    gate, up = randn(20, hidden), randn(20, hidden)
    merged = MergedColumnParallelLinear(hidden, [20, 20])
    merged.weight.weight_loader(merged.weight, up, 1)
    merged.weight.weight_loader(merged.weight, gate, 0)
    torch.testing.assert_close(merged(x), torch.cat([F.linear(x, gate), F.linear(x, up)], -1))
    with pytest.raises(ValueError, match="Shape mismatch"):
        qkv.weight.weight_loader(qkv.weight, wq, "k")


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_shards_recombine(monkeypatch: pytest.MonkeyPatch, tp_size: int) -> None:
    hidden, head, heads, kv_heads = 32, 4, 8, 2  # tp 4 > 2 KV heads: KV heads are replicated
    wq, wk, wv = randn(heads * head, hidden), randn(kv_heads * head, hidden), randn(8, hidden)
    w_col, w_row = randn(24, hidden), randn(hidden, 24)
    x = randn(5, hidden)
    col_parts, row_sum, qkv_parts = [], torch.zeros(5, hidden), []
    for rank in range(tp_size):
        as_rank(monkeypatch, rank, tp_size, linear)
        col = ColumnParallelLinear(hidden, 24)
        col.weight.weight_loader(col.weight, w_col)
        col_parts.append(col(x))
        row = RowParallelLinear(24, hidden)
        row.weight.weight_loader(row.weight, w_row)
        row_sum += row(F.linear(x, w_col).chunk(tp_size, -1)[rank])  # partial sums, reduced here
        qkv = QKVParallelLinear(hidden, head, heads, kv_heads)
        for shard, w in (("q", wq), ("k", wk), ("v", wv)):
            qkv.weight.weight_loader(qkv.weight, w, shard)
        qkv_parts.append(qkv(x).split([qkv.q_size, qkv.kv_size, qkv.kv_size], -1))
    torch.testing.assert_close(torch.cat(col_parts, -1), F.linear(x, w_col))
    torch.testing.assert_close(row_sum, F.linear(F.linear(x, w_col), w_row))
    torch.testing.assert_close(torch.cat([q for q, _, _ in qkv_parts], -1), F.linear(x, wq))
    kv_per_rank = max(1, kv_heads // tp_size) * head
    for rank, (_, k, v) in enumerate(qkv_parts):
        # The KV head of rank r serves query heads [r * heads / tp, (r + 1) * heads / tp).
        kv_head = rank * (heads // tp_size) // (heads // kv_heads)
        torch.testing.assert_close(k[:, :head], F.linear(x, wk)[:, kv_head * head :][:, :head])
        torch.testing.assert_close(v, F.linear(x, wv)[:, kv_head * head :][:, :kv_per_rank])


def test_vocab_parallel_embedding_and_lm_head(monkeypatch: pytest.MonkeyPatch) -> None:
    vocab, dim, tp_size = 10, 6, 4  # 10 rows over 4 ranks: the last rank holds 1 row + padding
    weight, ids, hidden = randn(vocab, dim), torch.tensor([0, 3, 9, 5, 2]), randn(2, dim)
    embed_sum, logit_parts = torch.zeros(5, dim), []
    for rank in range(tp_size):
        as_rank(monkeypatch, rank, tp_size, vocab_embedding)
        embed = VocabParallelEmbedding(vocab, dim)
        embed.weight.weight_loader(embed.weight, weight)
        embed_sum += embed(ids)
        head = ParallelLMHead(vocab, dim)
        head.weight.weight_loader(head.weight, weight)
        logit_parts.append(F.linear(hidden, head.weight))
    torch.testing.assert_close(embed_sum, weight[ids])
    torch.testing.assert_close(torch.cat(logit_parts, -1)[:, :vocab], hidden @ weight.T)


def _hf_moe(norm_topk_prob: bool) -> tuple[Qwen3MoeConfig, Qwen3MoeSparseMoeBlock]:
    config = Qwen3MoeConfig(
        hidden_size=16,
        moe_intermediate_size=12,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
    )
    block = Qwen3MoeSparseMoeBlock(config)
    for param in block.parameters():
        param.data.copy_(randn(*param.shape))
    return config, block


def _per_expert_keys(block: Qwen3MoeSparseMoeBlock) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint layout transformers' save_pretrained writes: one matrix per expert."""
    inter = block.experts.down_proj.shape[2]
    keys = []
    for e in range(block.experts.gate_up_proj.shape[0]):
        gate_up = block.experts.gate_up_proj[e]
        keys += [
            (f"mlp.experts.{e}.gate_proj.weight", gate_up[:inter]),
            (f"mlp.experts.{e}.up_proj.weight", gate_up[inter:]),
            (f"mlp.experts.{e}.down_proj.weight", block.experts.down_proj[e]),
        ]
    return keys


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_moe_matches_hf_block(norm_topk_prob: bool) -> None:
    from model_zoo.qwen3_moe import Qwen3MoeSparseMoeBlock as OurBlock

    config, hf = _hf_moe(norm_topk_prob)
    ours = torch.nn.Module()
    ours.mlp = OurBlock(config)
    weights = [("mlp.gate.weight", hf.gate.weight.data), *_per_expert_keys(hf)]
    loaded = load_weights_by_route(
        ours, weights, lambda n: FusedMoE.route_expert_weight(n) or (n, ())
    )
    assert loaded == {"mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    x = randn(9, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours.mlp(x), hf(x[None])[0], atol=1e-5, rtol=1e-5)


def test_moe_tensor_parallel_shards_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    _, hf = _hf_moe(True)
    x = randn(7, 16)
    weights, ids = fused_moe.select_experts(F.linear(x, hf.gate.weight), 2, True)
    full = fused_moe.fused_experts(x, hf.experts.gate_up_proj, hf.experts.down_proj, weights, ids)
    total = torch.zeros_like(x)
    for rank in range(2):
        as_rank(monkeypatch, rank, 2, fused_moe)
        experts = FusedMoE(6, 2, 16, 12)
        for name, tensor in _per_expert_keys(hf):
            param_name, args = FusedMoE.route_expert_weight(name)
            param = getattr(experts, param_name.rsplit(".", 1)[1])
            param.weight_loader(param, tensor, *args)
        total += experts(x, weights, ids)
    torch.testing.assert_close(total, full.detach(), atol=1e-5, rtol=1e-5)


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(8, 4, 2, 1)
        self.norm = RMSNorm(8)

    def load_weights(self, weights: object) -> set[str]:
        stacked = (
            ("qkv_proj", "q_proj", "q"),
            ("qkv_proj", "k_proj", "k"),
            ("qkv_proj", "v_proj", "v"),
        )
        return load_weights_by_route(self, weights, lambda n: route_stacked(n, stacked))


def _write_sharded(model_dir: Path, shards: list[dict[str, torch.Tensor]]) -> None:
    weight_map = {}
    for i, tensors in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(model_dir / name))
        weight_map.update(dict.fromkeys(tensors, name))
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_sharded_checkpoint_loads_and_errors_name_keys(tmp_path: Path, monkeypatch) -> None:
    q, k, v, norm = randn(8, 8), randn(4, 8), randn(4, 8), randn(8)
    _write_sharded(
        tmp_path,
        [{"q_proj.weight": q, "norm.weight": norm}, {"k_proj.weight": k, "v_proj.weight": v}],
    )
    assert sorted(n for n, _ in iterate_checkpoint_weights(tmp_path)) == [
        "k_proj.weight",
        "norm.weight",
        "q_proj.weight",
        "v_proj.weight",
    ]
    model = _Tiny()
    load_model_weights(model, tmp_path)
    torch.testing.assert_close(model.qkv_proj.weight.data, torch.cat([q, k, v]))
    # The progress bar (--use-tqdm-on-load): on a terminal, or off.
    bars: list[object] = []
    real_tqdm = model_loader.tqdm
    monkeypatch.setattr(model_loader, "tqdm", lambda **kw: bars.append(kw["disable"]) or
                        real_tqdm(**kw))  # fmt: skip
    load_model_weights(_Tiny(), tmp_path)
    load_model_weights(_Tiny(), tmp_path, progress_bar=False)
    assert bars == [None, True]
    torch.testing.assert_close(model.norm.weight.data, norm)

    missing_v = tmp_path / "missing"
    missing_v.mkdir()
    save_file(
        {"q_proj.weight": q, "k_proj.weight": k, "norm.weight": norm},
        str(missing_v / "model.safetensors"),
    )
    with pytest.raises(ValueError, match=r"not \(fully\) loaded.*qkv_proj\.weight"):
        load_model_weights(_Tiny(), missing_v)

    extra = tmp_path / "extra"
    extra.mkdir()
    save_file(
        {
            "q_proj.weight": q,
            "k_proj.weight": k,
            "v_proj.weight": v,
            "norm.weight": norm,
            "bogus.weight": norm.clone(),
        },
        str(extra / "model.safetensors"),
    )
    with pytest.raises(ValueError, match="match no parameter.*bogus.weight"):
        load_model_weights(_Tiny(), extra)

    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model_weights(_Tiny(), tmp_path / "missing" / "nowhere")


def test_large_tensors_are_read_in_pieces_side_by_side(tmp_path: Path, monkeypatch) -> None:
    """A read of several pieces (one per thread, split at page bounds and not) gives the
    file's bytes exactly, as one read does."""
    from omniserve.layers import weight_utils
    from omniserve.layers.weight_utils import SafetensorsFile

    monkeypatch.setattr(weight_utils, "_PARALLEL_READ_BYTES", 1 << 12)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)  # 3 pieces, whatever the machine
    tensors = {"a": randn(3, 5000), "b": torch.arange(70001, dtype=torch.int32)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with SafetensorsFile(tmp_path / "model.safetensors") as file:
        for name, expected in tensors.items():
            lazy = file.tensor(name)
            dest = torch.empty(lazy.shape, dtype=lazy.dtype)
            file.read_into(dest, lazy._offset)
            assert torch.equal(dest, expected)
