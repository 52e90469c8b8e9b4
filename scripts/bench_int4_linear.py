"""4-bit weight-only linear layers on the CPU: omniserve's ``Int4Linear`` against a bf16 layer on
oneDNN's packed weight and torch's own int4 kernel, at real checkpoints' shapes.

Per shape and row count: ``Int4Linear``'s kernel and its path for many rows (decode the weight,
then ``F.linear``) forced each way, ``OneDnnLinear`` on the same weights in bf16 (what an
unquantized model runs), and ``aten._weight_int4pack_mm_for_cpu`` on the same codes (its layout:
``(code - 8) * scale + zero``). Each figure is the median of ``--repeats`` calls in milliseconds,
the four taking turns. Before each call ``--flush-mb`` of memory is read, so the weights come
from DRAM as a decode step's do (a model's weights outsize any cache), and then the same product
runs on a small weight, so the code path is warm as the model's other layers keep it (without
that, each lost about 0.2 ms a call to cold code). The ratios compare with the path
``Int4Linear`` takes at that row count.

    python scripts/bench_int4_linear.py                     # Qwen2.5-1.5B / 7B-sized layers
    python scripts/bench_int4_linear.py --shapes 1536x17920 --rows 1 8 --threads 1
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch

from omniserve.cpu.linear import Int4Linear, OneDnnLinear, int4_kernel_max_rows
from omniserve.layers.quantization import dequantize, pack_nibbles

SHAPES = ["1536x17920", "8960x1536", "3584x37888"]
"""K x N: a 1.5B model's fused gate/up and down projections, a 7B's fused gate/up."""


def int4pack(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
             group_size: int) -> Callable[[torch.Tensor], torch.Tensor]:  # fmt: skip
    """torch's int4 matmul on the same weights: ``(q - z) s = (q - 8) s + (8 - z) s``."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 2)
    scale_and_zero = torch.stack([scales, (8 - zeros.float()) * scales], dim=-1)  # [N, K/g, 2]
    scale_and_zero = scale_and_zero.transpose(0, 1).contiguous().bfloat16()  # [K/g, N, 2]
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, packed, group_size, scale_and_zero
    )


Kernel = Callable[[torch.Tensor], torch.Tensor]
SMALL_K = 256
"""Input features of the small weight that warms each product's code path."""


def kernels(shape: tuple[int, int], group_size: int) -> list[Kernel]:
    """The four products on one random 4-bit weight of ``shape`` (K x N): ``Int4Linear``'s kernel
    and its decoding path, bf16 oneDNN, torch's int4 op."""
    in_features, out_features = shape
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.uint8)
    groups = (out_features, in_features // group_size)
    zeros = torch.randint(0, 16, groups, generator=gen, dtype=torch.uint8)
    scales = torch.rand(groups, generator=gen) * 0.01
    qweight = pack_nibbles(codes)
    layers = (
        Int4Linear(qweight, zeros, scales, torch.bfloat16, max_rows=1 << 30),
        Int4Linear(qweight, zeros, scales, torch.bfloat16, max_rows=0),
        OneDnnLinear(dequantize(qweight, zeros, scales, torch.bfloat16)),
    )
    return [*(functools.partial(layer, bias=None) for layer in layers),
            int4pack(codes, zeros, scales, group_size)]  # fmt: skip


def median_ms(big: list[Kernel], small: list[Kernel], x: torch.Tensor, x_small: torch.Tensor,
              args: argparse.Namespace, flush: torch.Tensor) -> list[float]:  # fmt: skip
    """Each big kernel's median time on ``x``. The kernels take turns (a slow spell of the
    machine hits them alike); before each call the flush evicts the weights, and the same
    product on a small weight then warms the code path again, as the model's other layers do."""
    times: list[list[float]] = [[] for _ in big]
    for kernel in big:
        kernel(x)  # warm-up
    for _ in range(args.repeats):
        for kernel, warm, kernel_times in zip(big, small, times, strict=True):
            flush.sum()
            warm(x_small)
            start = time.perf_counter()
            kernel(x)
            kernel_times.append(time.perf_counter() - start)
    return [statistics.median(t) * 1e3 for t in times]


def run(args: argparse.Namespace) -> None:
    flush = torch.ones(args.flush_mb << 18)  # fp32: 4 bytes each
    max_rows = int4_kernel_max_rows(torch.bfloat16)
    small = kernels((SMALL_K, 64), args.group_size)
    print(f"Int4Linear runs its kernel up to {max_rows} rows here (marked *)")
    print(f"{'K x N':>12} {'rows':>5} {'fused':>8} {'decoded':>8} {'bf16 oneDNN':>12} "
          f"{'int4pack':>9} {'oneDNN/ours':>12} {'int4pack/ours':>14}")  # fmt: skip
    for shape in args.shapes:
        in_features, out_features = map(int, shape.split("x"))
        big = kernels((in_features, out_features), args.group_size)
        for rows in args.rows:
            x, x_small = (torch.randn(rows, k).bfloat16() for k in (in_features, SMALL_K))
            ms = median_ms(big, small, x, x_small, args, flush)
            ours = ms[0] if rows <= max_rows else ms[1]
            marks = ("*", " ") if rows <= max_rows else (" ", "*")
            print(f"{shape:>12} {rows:>5} {ms[0]:>7.3f}{marks[0]} {ms[1]:>7.3f}{marks[1]} "
                  f"{ms[2]:>12.3f} {ms[3]:>9.3f} {ms[2] / ours:>11.2f}x {ms[3] / ours:>13.2f}x",
                  flush=True)  # fmt: skip
        del big


def add_timing_args(parser: argparse.ArgumentParser) -> None:
    """The threads, repeats and cache flush of ``median_ms``'s timing."""
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--flush-mb", type=int, default=1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="K x N (input x output)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 128])
    parser.add_argument("--group-size", type=int, default=128)
    add_timing_args(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"bf16 activations, groups of {args.group_size}, {args.threads} threads; "
          f"median of {args.repeats} calls (ms)")  # fmt: skip
    with torch.inference_mode():
        run(args)


if __name__ == "__main__":
    main()
