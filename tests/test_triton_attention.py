"""The Triton paged-attention backend against the naive reference: on CPU under
TRITON_INTERPRET=1 at many shapes, compiled on a GPU when one is present; its tile planning and
the backend selection."""

from __future__ import annotations

import multiprocessing
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("triton")  # a dependency only on Linux x86_64 (pyproject.toml)

from omniserve.attention import Attention
from omniserve.attention.base import to_fp8
from omniserve.attention.selector import apply_attention_backend
from omniserve.attention.torch_backend import TorchAttentionBackend, reference_attention
from omniserve.attention.triton_backend import TritonAttentionBackend, decode_splits, plan_tiles
from tests.test_attention import make_batch

Spec = list[tuple[int, int]]
Runner = Callable[..., tuple[torch.Tensor, torch.Tensor, bool]]


def attend(specs: Spec, *, num_heads: int, num_kv_heads: int, head_size: int = 16,
           block_size: int = 4, dtype: torch.dtype = torch.float32, window: int | None = None,
           seed: int = 0, unwritten: float | None = None, device: str = "cpu",
           cache_dtype: torch.dtype | None = None, kv_scales: tuple[float, float] = (1.0, 1.0),
           ) -> tuple[torch.Tensor, torch.Tensor, bool]:  # fmt: skip
    """Triton's output, the fp32 reference, and whether the new keys/values reached their slots
    (an fp8 cache's: their bytes)."""
    batch = make_batch(specs, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_size=head_size, block_size=block_size, dtype=dtype, seed=seed,
                       unwritten=unwritten, cache_dtype=cache_dtype,
                       kv_scales=kv_scales)  # fmt: skip
    md = batch.metadata
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        setattr(md, name, getattr(md, name).to(device))
    cache = batch.kv_cache.to(device)
    scale = head_size**-0.5
    out = TritonAttentionBackend().forward(
        batch.query.to(device), batch.key.to(device), batch.value.to(device), cache, md,
        scale=scale, sliding_window=window, kv_scales=kv_scales,
    ).cpu()  # fmt: skip
    expected = reference_attention(
        batch.query.float(), md.query_lens_cpu, [k.float() for k, _ in batch.histories],
        [v.float() for _, v in batch.histories], scale=scale, sliding_window=window,
    )  # fmt: skip
    slots = md.slot_mapping.cpu()
    if cache_dtype is None:
        stored = all(torch.equal(cache[i].flatten(0, 1).cpu()[slots], new)
                     for i, new in enumerate((batch.key, batch.value)))  # fmt: skip
    else:
        stored = all(torch.equal(cache[i].view(torch.uint8).flatten(0, 1).cpu()[slots],
                                 to_fp8(new, cache_dtype, kv_scales[i]).view(torch.uint8))
                     for i, new in enumerate((batch.key, batch.value)))  # fmt: skip
    return out, expected, stored


@pytest.fixture(scope="module")
def interpreted() -> Iterator[Runner]:
    """``attend`` in a worker process started with TRITON_INTERPRET=1 (set before triton is
    first imported there; this process keeps its kernels compiled for the GPU tests)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        pool = multiprocessing.get_context("spawn").Pool(1)
    with pool:

        def run(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, bool]:
            return pool.apply_async(attend, args, kwargs).get(timeout=300)

        yield run


def check(result: tuple[torch.Tensor, torch.Tensor, bool], atol: float = 2e-6) -> None:
    out, expected, stored = result
    assert stored, "the new keys/values are not in their slots"
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=0)


# decode, first prefill chunk, later chunk, decode on a block boundary, prefix-cache hit, ...
MIXED = [(9, 1), (0, 7), (5, 6), (8, 1), (12, 3), (0, 1), (3, 1)]


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (6, 1), (12, 4), (32, 2)])
@pytest.mark.slow
def test_gqa_ratios(interpreted: Runner, num_heads: int, num_kv_heads: int) -> None:
    check(interpreted(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads))


@pytest.mark.parametrize("block_size", [1, 3, 16, 128])
@pytest.mark.slow
def test_block_sizes_and_chunk_boundaries(interpreted: Runner, block_size: int) -> None:
    """Keys on, just before and after block boundaries; prefill chunks longer than a tile
    (64 rows = 32 tokens of a 2-head group) starting at and off a tile's edge."""
    specs = [(2 * block_size - 1, 1), (2 * block_size, 1), (block_size - 1, 2),
             (block_size, 33), (0, 70), (31, 65)]  # fmt: skip
    check(interpreted(specs, num_heads=4, num_kv_heads=2, block_size=block_size))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.slow
def test_random_ragged_batches(interpreted: Runner, seed: int) -> None:
    rng = random.Random(seed)
    specs = [(rng.randint(0, 150), 1) if rng.random() < 0.5
             else (rng.choice([0, rng.randint(1, 150)]), rng.randint(2, 90))
             for _ in range(rng.randint(1, 9))]  # fmt: skip
    heads = rng.choice([(8, 2), (4, 4), (16, 1)])
    check(interpreted(specs, num_heads=heads[0], num_kv_heads=heads[1],
                      block_size=rng.choice([1, 4, 16]), head_size=rng.choice([16, 64]),
                      seed=seed))  # fmt: skip


@pytest.mark.parametrize("window", [1, 5, 64])
@pytest.mark.slow
def test_sliding_window(interpreted: Runner, window: int) -> None:
    specs = [(10, 1), (0, 9), (6, 5), (2, 1), (150, 1), (100, 40)]
    check(interpreted(specs, num_heads=4, num_kv_heads=2, window=window))


@pytest.mark.parametrize("head_size", [24, 80, 128])
def test_head_sizes(interpreted: Runner, head_size: int) -> None:
    """Sizes padded to a power of two (24, 80: masked lanes) and a model's 128."""
    check(interpreted([(300, 1), (0, 5), (77, 20)], num_heads=8, num_kv_heads=2,
                      head_size=head_size, block_size=16))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.slow
def test_half_precision_at_real_shapes(interpreted: Runner, dtype: torch.dtype) -> None:
    """Qwen3-Omni-30B-A3B's heads (32 on 4, size 128) on a half-precision cache: products and
    softmax in fp32, the probabilities rounded to the cache dtype for the second product and
    the output rounded once, so the gap to the fp32 reference is a few units of 2**-8 (bf16)."""
    check(interpreted([(300, 1), (45, 1), (0, 7), (511, 1), (20, 40)], num_heads=32,
                      num_kv_heads=4, head_size=128, block_size=16, dtype=dtype),
          atol=3e-2)  # fmt: skip


@pytest.mark.parametrize(
    ("cache_dtype", "kv_scales"),
    [
        (torch.float8_e4m3fn, (1.0, 1.0)),
        (torch.float8_e5m2, (1.0, 1.0)),
        (torch.float8_e4m3fn, (0.02, 0.5)),
    ],
)
def test_fp8_cache(interpreted: Runner, cache_dtype: torch.dtype,
                   kv_scales: tuple[float, float]) -> None:  # fmt: skip
    """--kv-cache-dtype fp8 under a bf16 model: the store divides by the layer's scales and
    rounds to the cache's format (exactly here: the histories are its values), the kernel
    widens what it loads and scales it back, so the output is the reference's on those values
    within bf16's rounding."""
    check(interpreted([(300, 1), (45, 1), (0, 7), (20, 40)], num_heads=8, num_kv_heads=2,
                      head_size=64, block_size=16, dtype=torch.bfloat16,
                      cache_dtype=cache_dtype, kv_scales=kv_scales), atol=3e-2)  # fmt: skip


@pytest.mark.parametrize("window", [None, 100])
def test_split_decodes_of_long_contexts(interpreted: Runner, window: int | None) -> None:
    """A few decodes with long histories: their keys split over many programs (here 3 x 2 KV
    heads take 6 splits each, some of them empty for the short one) and folded back."""
    assert decode_splits(6, torch.device("cpu")) == 6
    check(interpreted([(1000, 1), (517, 1), (40, 1)], num_heads=8, num_kv_heads=2,
                      block_size=16, window=window))  # fmt: skip


def test_a_full_decode_batch_does_not_split(interpreted: Runner) -> None:
    assert decode_splits(40, torch.device("cpu")) == 1
    check(interpreted([(30 + 7 * i, 1) for i in range(40)], num_heads=4, num_kv_heads=1))


def test_split_counts() -> None:
    """Two programs per multiprocessor (the interpreter counts 16), at most 16 splits."""
    cpu = torch.device("cpu")
    assert [decode_splits(n, cpu) for n in (1, 2, 3, 16, 31, 32, 33, 512)] == [
        16, 16, 11, 2, 2, 1, 1, 1]  # fmt: skip


def test_unwritten_slots_never_reach_the_output(interpreted: Runner) -> None:
    """The cache is allocated uninitialised: NaN in every slot no request wrote stays out."""
    check(interpreted([(3, 1), (29, 1), (0, 5), (14, 1)], num_heads=4, num_kv_heads=2,
                      unwritten=float("nan")))  # fmt: skip


def test_tiles_cover_each_query_once() -> None:
    query_lens = [1, 7, 1, 64, 65, 1, 2]
    decodes = plan_tiles(query_lens, 8, decodes=True)
    assert decodes == ([0, 2, 5], [0, 0, 0])
    reqs, firsts = plan_tiles(query_lens, 32, decodes=False)
    assert list(zip(reqs, firsts, strict=True)) == [
        (1, 0),
        (3, 0),
        (3, 32),
        (4, 0),
        (4, 32),
        (4, 64),
        (6, 0),
    ]


def test_selection_on_cpu() -> None:
    """On CPU "auto" keeps what the CPU backend placed, "torch" is the reference everywhere,
    and "triton" is refused with the reason (no CUDA, no interpreter here)."""
    model = torch.nn.Sequential(Attention(4, 16, 0.25, 2), Attention(4, 16, 0.25, 2))
    cpu = torch.device("cpu")
    sentinel = TorchAttentionBackend()
    model[0].backend = sentinel
    assert apply_attention_backend(model, "auto", cpu, torch.float32) == {"torch": 2}
    assert model[0].backend is sentinel
    apply_attention_backend(model, "torch", cpu, torch.float32)
    assert model[0].backend is not sentinel and model[0].backend is model[1].backend
    with pytest.raises(ValueError, match="needs CUDA or TRITON_INTERPRET=1"):
        apply_attention_backend(model, "triton", cpu, torch.float32)


@pytest.mark.gpu
def test_auto_picks_triton_on_cuda_with_torch_fallback() -> None:
    model = torch.nn.Sequential(Attention(4, 16, 0.25, 2), Attention(4, 512, 0.25, 2))
    counts = apply_attention_backend(model, "auto", torch.device("cuda"), torch.bfloat16)
    assert counts == {"triton": 1, "torch": 1}  # a 512 head stays on the reference


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_on_gpu(dtype: torch.dtype) -> None:
    """The compiled kernel (fp32 in IEEE, not TF32) at real shapes and ragged batches."""
    atol = 2e-6 if dtype == torch.float32 else 3e-2
    specs = [(300, 1), (45, 1), (0, 7), (511, 1), (20, 40), (0, 300), (1000, 1)]
    for heads, head_size in (((32, 4), 128), ((16, 2), 128), ((8, 8), 64), ((12, 4), 80)):
        for block_size in (16, 1, 64):
            check(
                attend(
                    specs,
                    num_heads=heads[0],
                    num_kv_heads=heads[1],
                    head_size=head_size,
                    block_size=block_size,
                    dtype=dtype,
                    device="cuda",
                ),
                atol=atol,
            )
    check(attend(specs, num_heads=8, num_kv_heads=2, window=33, device="cuda", dtype=dtype),
          atol=atol)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_compiled_fp8_cache_on_gpu(cache_dtype: torch.dtype) -> None:
    """The compiled kernel over an fp8 cache (the GPU's own fp8 conversions) at real shapes."""
    specs = [(300, 1), (45, 1), (0, 7), (511, 1), (20, 40), (0, 300), (1000, 1)]
    for kv_scales in ((1.0, 1.0), (0.02, 0.5)):
        check(attend(specs, num_heads=32, num_kv_heads=4, head_size=128, block_size=16,
                     dtype=torch.bfloat16, device="cuda", cache_dtype=cache_dtype,
                     kv_scales=kv_scales), atol=3e-2)  # fmt: skip
