"""Decode attention over a bf16 KV cache against an fp8 one (--kv-cache-dtype fp8 / fp8_e5m2), on
this machine's attention backend (the CPU's C decode kernel; Triton on CUDA), at real models'
head shapes: time per layer call, the KV bytes it reads per second, and the ratio to bf16.

    python scripts/bench_kv_cache_dtype.py
    python scripts/bench_kv_cache_dtype.py --shapes qwen3-omni-30b-a3b --contexts 1x16384,32x2048

An fp8 cache holds twice a bf16 cache's tokens in the same memory; what this measures is what
reading it costs (fewer bytes, plus widening each element as it is loaded).
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

import torch
from bench_common import best_of

from omniserve.attention.base import AttentionBackend, to_fp8
from omniserve.attention.metadata import AttentionMetadata

SHAPES = {  # (query heads, KV heads, head size, decoder layers)
    "qwen2.5-omni-3b": (16, 2, 128, 36),
    "qwen3-omni-30b-a3b": (32, 4, 128, 48),
}
CACHE_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
                "fp8_e5m2": torch.float8_e5m2}  # fmt: skip
BLOCK_SIZE = 16


def backend_for(device: torch.device) -> AttentionBackend:
    if device.type == "cuda":
        from omniserve.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from omniserve.cpu.attention import CpuAttentionBackend

    return CpuAttentionBackend()


def decode_batch(batch: int, context: int, heads: tuple[int, int, int], cache_dtype: torch.dtype,
                 device: torch.device) -> tuple[Any, ...]:  # fmt: skip
    """(query, key, value, cache, metadata) of ``batch`` decodes with ``context`` keys each."""
    num_heads, num_kv_heads, head_size = heads
    blocks_per = -(-(context + 1) // BLOCK_SIZE)
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, batch * blocks_per, BLOCK_SIZE, num_kv_heads, head_size,
                        generator=gen, dtype=torch.bfloat16)  # fmt: skip
    cache = cache.to(device)
    if cache_dtype != torch.bfloat16:
        cache = to_fp8(cache, cache_dtype)
    order = torch.randperm(batch * blocks_per, generator=gen).view(batch, blocks_per)
    table = order.to(torch.int32).to(device)
    positions = torch.full((batch,), context)
    slots = (order[:, context // BLOCK_SIZE] * BLOCK_SIZE + context % BLOCK_SIZE).to(device)
    metadata = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32).to(device),
        seq_lens=(positions + 1).to(torch.int32).to(device), block_table=table,
        slot_mapping=slots, query_lens_cpu=[1] * batch, seq_lens_cpu=[context + 1] * batch,
    )  # fmt: skip
    query = torch.randn(batch, num_heads, head_size, dtype=torch.bfloat16, generator=gen)
    key = torch.randn(batch, num_kv_heads, head_size, dtype=torch.bfloat16, generator=gen)
    return query.to(device), key.to(device), key.clone().to(device), cache, metadata


def time_call(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Best seconds of one call over ``repeats`` (after a warm-up)."""
    fn()
    return best_of(repeats, fn, torch.cuda.synchronize if device.type == "cuda" else lambda: None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="Comma-separated names.")
    parser.add_argument("--contexts", default="1x8192,8x4096,32x2048",
                        help="BATCHxCONTEXT pairs, comma-separated.")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    backend = backend_for(device)
    print(f"{type(backend).__name__} on {device}; best of {args.repeats} calls of one layer")
    print("| shape | batch x context | cache | ms per layer | KV GB/s | vs bf16 | KiB per token |")
    print("|---|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        *heads, layers = SHAPES[name]
        for pair in args.contexts.split(","):
            batch, context = (int(x) for x in pair.split("x"))
            base = None
            for label, cache_dtype in CACHE_DTYPES.items():
                query, key, value, cache, md = decode_batch(batch, context, tuple(heads),
                                                            cache_dtype, device)  # fmt: skip
                call = functools.partial(backend.forward, query, key, value, cache, md,
                                         scale=heads[2] ** -0.5)  # fmt: skip
                seconds = time_call(call, device, args.repeats)
                kv_bytes = 2 * batch * (context + 1) * heads[1] * heads[2] * cache.element_size()
                base = base or seconds
                per_token = 2 * layers * heads[1] * heads[2] * cache.element_size() / 1024
                print(f"| {name} | {batch} x {context} | {label} | {seconds * 1e3:.3f} | "
                      f"{kv_bytes / seconds / 1e9:.1f} | {base / seconds:.2f}x | "
                      f"{per_token:.0f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
