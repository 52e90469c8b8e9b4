"""The paged-attention backends (torch, and CPU with its C decode kernel) against a naive
per-token reference on contiguous histories, in fp32 and bf16."""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass

import pytest
import torch

from omniserve.attention import (
    Attention,
    AttentionMetadata,
    get_attention_layers,
    torch_backend,
)
from omniserve.attention.base import to_fp8
from omniserve.attention.layer import copy_kv_blocks
from omniserve.attention.torch_backend import (
    TorchAttentionBackend,
    causal_attention,
    reference_attention,
)
from omniserve.cpu.attention import CpuAttentionBackend, kernel_available
from omniserve.forward_context import get_forward_context, set_forward_context

BACKEND: type[TorchAttentionBackend] = TorchAttentionBackend
"""The backend under test; the autouse ``decode_path`` fixture sets it for each test."""


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def decode_path(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, kernel_threads: None
) -> str:
    """Every test runs with CPU decodes on the C kernel (on two threads) and on the torch
    gather + SDPA path."""
    if request.param == "kernel":
        assert kernel_available(torch.float32), "the C kernel must build on this machine"
        assert kernel_available(torch.bfloat16), "the C kernel must build on this machine"
    backend = CpuAttentionBackend if request.param == "kernel" else TorchAttentionBackend
    monkeypatch.setattr(sys.modules[__name__], "BACKEND", backend)
    return request.param


@dataclass
class Batch:
    query: torch.Tensor  # [N, H, D]
    key: torch.Tensor  # [N, KVH, D] new tokens only
    value: torch.Tensor
    kv_cache: torch.Tensor
    metadata: AttentionMetadata
    histories: list[tuple[torch.Tensor, torch.Tensor]]  # per request: full [S, KVH, D] k and v


def make_batch(
    specs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int = 16,
    block_size: int = 4,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    unwritten: float | None = None,
    cache_dtype: torch.dtype | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> Batch:
    """specs: (num_context_tokens already cached, query_len) per request, in batch order.
    Slots no request has written hold random values, or ``unwritten`` (e.g. NaN: the cache is
    allocated uninitialised). An fp8 ``cache_dtype``: the histories are values it holds
    exactly at ``kv_scales`` (rounded to it), the cache is of that type."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = [-(-(c + q) // block_size) for c, q in specs]
    num_blocks = sum(blocks_needed) + 3
    pool = list(range(num_blocks))
    rng.shuffle(pool)  # blocks of a request are scattered, not contiguous
    kv_cache = torch.randn(
        2, num_blocks, block_size, num_kv_heads, head_size, generator=gen, dtype=dtype
    )  # garbage in unused slots must never be read
    if unwritten is not None:
        kv_cache.fill_(unwritten)
    max_blocks = max(blocks_needed)
    block_table = torch.zeros(len(specs), max_blocks, dtype=torch.int32)
    histories, new_k, new_v, slots, queries = [], [], [], [], []
    for r, ((num_context, query_len), n_blocks) in enumerate(
        zip(specs, blocks_needed, strict=True)
    ):
        block_ids = [pool.pop() for _ in range(n_blocks)]
        block_table[r, :n_blocks] = torch.tensor(block_ids, dtype=torch.int32)
        seq_len = num_context + query_len
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=gen, dtype=dtype)
        v = torch.randn(seq_len, num_kv_heads, head_size, generator=gen, dtype=dtype)
        if cache_dtype is not None:
            k, v = (to_fp8(x, cache_dtype, s).float().mul(s).to(dtype)
                    for x, s in zip((k, v), kv_scales, strict=True))  # fmt: skip
        histories.append((k, v))
        for t in range(seq_len):
            slot = block_ids[t // block_size] * block_size + t % block_size
            if t < num_context:  # written by earlier steps
                kv_cache[0, slot // block_size, slot % block_size] = k[t]
                kv_cache[1, slot // block_size, slot % block_size] = v[t]
            else:
                slots.append(slot)
        new_k.append(k[num_context:])
        new_v.append(v[num_context:])
        queries.append(torch.randn(query_len, num_heads, head_size, generator=gen, dtype=dtype))
    query_lens = [q for _, q in specs]
    seq_lens = [c + q for c, q in specs]
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(
            [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32
        ),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    if cache_dtype is not None:
        kv_cache = torch.stack(
            [to_fp8(kv_cache[i], cache_dtype, s) for i, s in enumerate(kv_scales)]
        )
    return Batch(
        torch.cat(queries), torch.cat(new_k), torch.cat(new_v), kv_cache, metadata, histories
    )


def run_and_compare(batch: Batch, *, sliding_window: int | None = None, atol: float = 1e-5) -> None:
    scale = batch.query.shape[-1] ** -0.5
    out = BACKEND().forward(
        batch.query,
        batch.key,
        batch.value,
        batch.kv_cache,
        batch.metadata,
        scale=scale,
        sliding_window=sliding_window,
    )
    expected = reference_attention(
        batch.query,
        batch.metadata.query_lens_cpu,
        [k for k, _ in batch.histories],
        [v for _, v in batch.histories],
        scale=scale,
        sliding_window=sliding_window,
    )
    torch.testing.assert_close(out, expected, atol=atol, rtol=0)
    # The new tokens landed in their slots.
    flat_k = batch.kv_cache[0].flatten(0, 1)
    torch.testing.assert_close(flat_k[batch.metadata.slot_mapping], batch.key, atol=0, rtol=0)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (6, 1)])
def test_mixed_batch_matches_reference(num_heads: int, num_kv_heads: int) -> None:
    # decode, first prefill chunk, later chunk, decode at a block boundary, prefix-cache hit
    specs = [(9, 1), (0, 7), (5, 6), (8, 1), (12, 3), (0, 1), (3, 1)]
    run_and_compare(make_batch(specs, num_heads=num_heads, num_kv_heads=num_kv_heads))


@pytest.mark.parametrize("seed", range(6))
def test_random_mixed_batches(seed: int) -> None:
    rng = random.Random(seed)
    specs = []
    for _ in range(rng.randint(1, 8)):
        if rng.random() < 0.5:
            specs.append((rng.randint(0, 30), 1))  # decode
        else:
            specs.append((rng.choice([0, 0, rng.randint(1, 30)]), rng.randint(2, 20)))
    rng.shuffle(specs)
    block_size = rng.choice([1, 4, 16])
    run_and_compare(
        make_batch(specs, num_heads=8, num_kv_heads=2, block_size=block_size, seed=seed)
    )


@pytest.mark.parametrize("block_size", [1, 4, 8])
def test_block_boundaries(block_size: int) -> None:
    # sequences ending exactly on, just before and just after a block boundary
    specs = [
        (2 * block_size - 1, 1),
        (2 * block_size, 1),
        (block_size - 1, 2),
        (block_size, block_size),
        (0, 3 * block_size),
    ]
    run_and_compare(make_batch(specs, num_heads=4, num_kv_heads=2, block_size=block_size))


@pytest.mark.parametrize(
    ("head_size", "block_size", "num_heads"), [(128, 32, 8), (64, 16, 12), (24, 16, 4)]
)
def test_long_histories_wide_heads(head_size: int, block_size: int, num_heads: int) -> None:
    """Hundreds of keys (many 16-key steps of the online softmax, blocks cut into 16-key parts),
    model-sized heads, a group of 3 query heads per KV head; a head size the kernel does not
    take (24) runs the torch path."""
    specs = [(300, 1), (0, 5), (77, 1), (31, 1), (129, 1)]
    batch = make_batch(
        specs,
        num_heads=num_heads,
        num_kv_heads=4 if num_heads == 12 else 2,
        head_size=head_size,
        block_size=block_size,
    )
    if head_size % 16:
        assert not CpuAttentionBackend().decode_kernel_supports(batch.query, batch.kv_cache)
    run_and_compare(batch)


@pytest.mark.parametrize("window", [1, 3, 8])
def test_sliding_window(window: int) -> None:
    specs = [(10, 1), (0, 9), (6, 5), (2, 1)]
    run_and_compare(make_batch(specs, num_heads=4, num_kv_heads=2), sliding_window=window)


def test_decodes_split_into_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_backend, "_DECODE_KEYS_PER_CHUNK", 24)
    specs = [(n, 1) for n in (3, 17, 9, 22, 1, 11, 5)]
    batch = make_batch(specs, num_heads=4, num_kv_heads=2)
    plan = torch_backend._plan_batch(batch.metadata, 4, None, use_kernel=False)
    assert len(plan.decode_chunks) > 1 and not plan.prefills
    run_and_compare(batch)


def test_plan_is_shared_across_layers() -> None:
    batch = make_batch([(5, 1), (0, 4)], num_heads=4, num_kv_heads=2)
    backend = TorchAttentionBackend()
    first = backend._plan(batch.metadata, 4, None, False)
    assert backend._plan(batch.metadata, 4, None, False) is first
    assert backend._plan(batch.metadata, 4, 2, False) is not first
    other = make_batch([(5, 1), (0, 4)], num_heads=4, num_kv_heads=2)
    assert backend._plan(other.metadata, 4, None, False) is not first


def test_bfloat16_close_to_fp32_reference() -> None:
    batch = make_batch([(7, 1), (3, 5), (0, 6)], num_heads=8, num_kv_heads=2, dtype=torch.bfloat16)
    run_and_compare(batch, atol=3e-2)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(32, 4), (16, 2)])
def test_bfloat16_decode_at_real_shapes(num_heads: int, num_kv_heads: int) -> None:
    """Qwen3-Omni-30B-A3B's attention (32 query heads on 4 KV heads, head size 128) and
    Qwen2.5-VL-3B's (16 on 2) with a bf16 cache: hundreds of keys, a prefill alongside. The
    kernel widens bf16 to fp32 and rounds its output once; the reference runs in fp32 on the
    same bf16 values, so the gap is the output's rounding (2**-8 relative)."""
    specs = [(300, 1), (45, 1), (0, 7), (511, 1)]
    batch = make_batch(specs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=128,
                       block_size=16, dtype=torch.bfloat16)  # fmt: skip
    scale = 128**-0.5
    out = BACKEND().forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata,
                            scale=scale)  # fmt: skip
    expected = reference_attention(
        batch.query.float(), batch.metadata.query_lens_cpu,
        [k.float() for k, _ in batch.histories], [v.float() for _, v in batch.histories],
        scale=scale,
    )  # fmt: skip
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=1e-2)


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("kv_scales", [(1.0, 1.0), (0.02, 0.5)])
@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_attends_its_values(
    decode_path: str, dtype: torch.dtype, cache_dtype: torch.dtype,
    kv_scales: tuple[float, float],
) -> None:  # fmt: skip
    """--kv-cache-dtype fp8: the new keys and values are stored divided by the layer's scales
    and rounded (their bytes), and attention over the cache is the reference's over the
    histories it holds (widened exactly and scaled back; the kernel takes the decodes and short
    chunks, SDPA the prefills)."""
    specs = [(300, 1), (9, 1), (0, 7), (5, 6), (12, 3), (129, 1), (0, 1)]
    batch = make_batch(specs, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                       dtype=dtype, cache_dtype=cache_dtype, seed=3,
                       kv_scales=kv_scales)  # fmt: skip
    backend = BACKEND()
    assert backend.decode_kernel_supports(batch.query, batch.kv_cache) == (decode_path == "kernel")
    scale = 64**-0.5
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata,
                          scale=scale, kv_scales=kv_scales)  # fmt: skip
    expected = reference_attention(
        batch.query.float(), batch.metadata.query_lens_cpu,
        [k.float() for k, _ in batch.histories], [v.float() for _, v in batch.histories],
        scale=scale,
    )  # fmt: skip
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=0 if atol < 1e-3 else 1e-2)
    for i, new in enumerate((batch.key, batch.value)):
        stored = batch.kv_cache.view(torch.uint8)[i].flatten(0, 1)[batch.metadata.slot_mapping]
        assert torch.equal(stored, to_fp8(new, cache_dtype, kv_scales[i]).view(torch.uint8))


def test_fp8_store_saturates() -> None:
    """Values past the format's largest are stored as it, never as infinity or NaN."""
    cache = torch.zeros(2, 1, 4, 1, 16, dtype=torch.float8_e5m2)
    key = torch.full((2, 1, 16), 1e6)
    key[1] = -1e6
    torch_backend.write_to_kv_cache(key, key, cache, torch.tensor([0, 3]))
    assert cache[0, 0, 0].float().eq(57344).all() and cache[1, 0, 3].float().eq(-57344).all()


def test_unwritten_slots_never_reach_the_output() -> None:
    """The cache is not zeroed: NaN in every slot no request wrote (the padding a batched
    decode gathers among them) must not leak into any output."""
    batch = make_batch([(3, 1), (29, 1), (0, 5), (14, 1)], num_heads=4, num_kv_heads=2,
                       unwritten=float("nan"))  # fmt: skip
    run_and_compare(batch)


def test_copy_kv_blocks_copies_whole_blocks_in_every_layer() -> None:
    caches = [torch.randn(2, 6, 4, 2, 8) for _ in range(3)]  # [k/v, blocks, slots, heads, dim]
    before = [cache.clone() for cache in caches]
    copy_kv_blocks(caches, [(1, 4), (3, 0)])
    copy_kv_blocks(caches, [])
    for cache, old in zip(caches, before, strict=True):
        assert torch.equal(cache[:, 4], old[:, 1]) and torch.equal(cache[:, 0], old[:, 3])
        assert torch.equal(cache[:, [1, 2, 3, 5]], old[:, [1, 2, 3, 5]])


def test_causal_attention_without_cache() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(11, h, 8, generator=gen) for h in (6, 2, 2))
    for window in (None, 4):
        out = causal_attention(q, k, v, scale=0.3, sliding_window=window)
        expected = reference_attention(q, [11], [k], [v], scale=0.3, sliding_window=window)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_attention_layer_uses_forward_context() -> None:
    batch = make_batch([(4, 1), (0, 5)], num_heads=4, num_kv_heads=2)
    model = torch.nn.ModuleList([Attention(4, 16, 0.25, num_kv_heads=2) for _ in range(2)])
    layers = get_attention_layers(model)
    assert layers == list(model)
    layer = layers[0]
    q, k, v = batch.query.flatten(1), batch.key.flatten(1), batch.value.flatten(1)
    with pytest.raises(RuntimeError, match="forward context"):
        layer(q, k, v)
    with set_forward_context(batch.metadata):
        with pytest.raises(RuntimeError, match="kv_cache"):
            layer(q, k, v)
        layer.kv_cache = batch.kv_cache
        out = layer(q, k, v)
    expected = reference_attention(
        batch.query,
        [1, 5],
        [h[0] for h in batch.histories],
        [h[1] for h in batch.histories],
        scale=0.25,
    )
    torch.testing.assert_close(out, expected.flatten(1), atol=1e-5, rtol=0)


def test_forward_context_refuses_nesting() -> None:
    with set_forward_context(None):
        assert get_forward_context().attn_metadata is None
        with pytest.raises(RuntimeError, match="nest"):
            with set_forward_context(None):
                pass
    with pytest.raises(RuntimeError):
        get_forward_context()


def test_metadata_validates_lengths() -> None:
    with pytest.raises(ValueError, match="slot_mapping"):
        AttentionMetadata(
            query_start_loc=torch.tensor([0, 2], dtype=torch.int32),
            seq_lens=torch.tensor([2], dtype=torch.int32),
            block_table=torch.zeros(1, 1, dtype=torch.int32),
            slot_mapping=torch.tensor([0], dtype=torch.int64),
            query_lens_cpu=[2],
            seq_lens_cpu=[2],
        )


def test_gather_workspace_survives_grad_modes() -> None:
    # The runner runs under inference_mode, tests under no_grad; the shared workspace serves both.
    backend = TorchAttentionBackend()
    small = make_batch([(6, 1), (3, 4)], num_heads=4, num_kv_heads=2)
    large = make_batch([(40, 1), (30, 5)], num_heads=4, num_kv_heads=2, seed=1)
    scale = 0.25
    with torch.inference_mode():
        backend.forward(
            small.query, small.key, small.value, small.kv_cache, small.metadata, scale=scale
        )
    workspace = backend._workspace
    with torch.no_grad():
        out = backend.forward(
            large.query, large.key, large.value, large.kv_cache, large.metadata, scale=scale
        )
    assert backend._workspace is not workspace  # grown for the longer sequences
    expected = reference_attention(
        large.query,
        large.metadata.query_lens_cpu,
        [k for k, _ in large.histories],
        [v for _, v in large.histories],
        scale=scale,
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_kernel_plans_decodes_without_padding(decode_path: str) -> None:
    """A chunk of up to KERNEL_MAX_QUERY tokens (a decode with drafts) is a row per token, each
    with its causal length; a longer one stays a prefill."""
    batch = make_batch([(9, 1), (5, 3), (0, 9), (4, 1)], num_heads=4, num_kv_heads=2)
    use_kernel = BACKEND().decode_kernel_supports(batch.query, batch.kv_cache)
    assert use_kernel == (decode_path == "kernel")
    plan = torch_backend._plan_batch(batch.metadata, 4, None, use_kernel)
    prefills = [(p.start, p.end) for p in plan.prefills]
    if use_kernel:
        assert prefills == [(4, 13)]
        assert plan.decode_rows is not None and not plan.decode_chunks
        assert plan.decode_rows.token_rows.tolist() == [0, 1, 2, 3, 13]
        assert plan.decode_rows.seq_lens.tolist() == [10, 6, 7, 8, 5]
    else:
        assert prefills == [(1, 4), (4, 13)]
        assert plan.decode_rows is None and plan.decode_chunks
    run_and_compare(batch)


def test_kernel_on_strided_query_rows(decode_path: str) -> None:
    # q is a column slice of a fused qkv output in the models: rows are strided, heads are not.
    batch = make_batch([(12, 1), (5, 1), (30, 1)], num_heads=8, num_kv_heads=2, block_size=16)
    fused = torch.cat([batch.query.flatten(1), torch.zeros(3, 40)], dim=1)
    query = fused[:, : 8 * 16].view(3, 8, 16)
    assert not query.is_contiguous()
    batch.query = query
    run_and_compare(batch)


def test_kernel_rejects_block_ids_outside_the_cache(decode_path: str) -> None:
    if decode_path != "kernel":
        pytest.skip("kernel-only bounds check")
    batch = make_batch([(6, 1)], num_heads=4, num_kv_heads=2)
    rows = torch.tensor([0])
    table = torch.full((1, 2), 10_000, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block id outside the KV cache"):
        CpuAttentionBackend().decode_kernel(
            batch.query,
            torch.empty_like(batch.query),
            rows,
            batch.kv_cache,
            table,
            batch.metadata.seq_lens,
            scale=0.25,
            sliding_window=None,
        )
