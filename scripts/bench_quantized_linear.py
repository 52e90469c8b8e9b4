"""Weight-only quantized linear layers on the CPU: omniserve's ``Int4Linear`` (``--format int4``)
or ``Fp8Linear`` (``--format fp8``) against the layer an unquantized bf16 checkpoint runs, at real
checkpoints' shapes.

Per shape and row count: the quantized layer's kernel and its path for many rows (decode the
weight, then ``F.linear``) forced each way; the same weights dequantized to bf16 in the layer a
bf16 checkpoint gets (bf16 activations: ``AmxLinear`` on a CPU with AMX, else ``OneDnnLinear``;
fp32 ones, ``--dtype float32``, as a CPU without native bf16 runs them: ``WidenedLinear``); for
4-bit in bf16,
``aten._weight_int4pack_mm_for_cpu`` on the same codes (its layout: ``(code - 8) * scale +
zero``). Each figure is the median of ``--repeats`` calls in milliseconds, the kernels taking
turns. Before each call ``--flush-mb`` of memory is read, so the weights come
from DRAM as a decode step's do (a model's weights outsize any cache), and then the same product
runs on a small weight, so the code path is warm as the model's other layers keep it (without
that, each lost about 0.2 ms a call to cold code). The ratios compare with the path
``Int4Linear`` takes at that row count.

    python scripts/bench_quantized_linear.py                     # Qwen2.5-1.5B / 7B-sized layers
    python scripts/bench_quantized_linear.py --shapes 1536x17920 --rows 1 8 --threads 1
    python scripts/bench_quantized_linear.py --format fp8 --dtype float32
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from omniserve.cpu.linear import (
    FP8_ROWS_KERNEL_MAX_ROWS,
    Fp8Linear,
    Int4Linear,
    OneDnnLinear,
    WidenedLinear,
    decoded_kernel_max_rows,
)
from omniserve.cpu.linear_amx import AmxLinear
from omniserve.layers.quantization import dequantize, dequantize_fp8, pack_nibbles

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


def kernels(shape: tuple[int, int], args: argparse.Namespace) -> list[Kernel]:
    """The products on one random quantized weight of ``shape`` (K x N): the quantized layer's
    kernel and its decoding path, the bf16 checkpoint's layer, and (4-bit, bf16) torch's int4
    op."""
    in_features, out_features = shape
    gen = torch.Generator().manual_seed(0)
    dtype, groups = args.dtype, (out_features, in_features // args.group_size)
    scales = torch.rand(groups, generator=gen) * 0.01
    if args.format == "fp8":
        weight = torch.randn(out_features, in_features, generator=gen) * 50
        codes8 = weight.clamp(-448, 448).to(torch.float8_e4m3fn)
        layers: tuple[Any, ...] = (
            Fp8Linear(codes8, scales, dtype, max_rows=1 << 30),
            Fp8Linear(codes8, scales, dtype, max_rows=0),
        )
        bf16 = dequantize_fp8(codes8, scales, torch.bfloat16)
    else:
        codes = torch.randint(0, 16, (out_features, in_features), generator=gen,
                              dtype=torch.uint8)  # fmt: skip
        zeros = torch.randint(0, 16, groups, generator=gen, dtype=torch.uint8)
        qweight = pack_nibbles(codes)
        layers = (
            Int4Linear(qweight, zeros, scales, dtype, max_rows=1 << 30),
            Int4Linear(qweight, zeros, scales, dtype, max_rows=0),
        )
        bf16 = dequantize(qweight, zeros, scales, torch.bfloat16)
    plain: Any = WidenedLinear(bf16)  # the layer a bf16 checkpoint's weight gets in dtype
    if dtype == torch.bfloat16:
        plain = AmxLinear(bf16, packed=True) if AmxLinear.supports(bf16) else OneDnnLinear(bf16)
    products = [functools.partial(layer, bias=None) for layer in (*layers, plain)]
    if args.format == "int4" and dtype == torch.bfloat16:
        products.append(int4pack(codes, zeros, scales, args.group_size))
    return products


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


def time_shapes(
    args: argparse.Namespace,
    kernels: Callable[[tuple[int, int]], list[Kernel]],
    dtype: torch.dtype,
) -> Iterator[tuple[str, int, list[float]]]:
    """Each of ``args.shapes`` (K x N) and ``args.rows`` with ``median_ms`` of the products
    ``kernels(shape)`` makes, on random rows of ``dtype``."""
    flush = torch.ones(args.flush_mb << 18)  # fp32: 4 bytes each
    small = kernels((SMALL_K, 64))
    for shape in args.shapes:
        in_features, out_features = map(int, shape.split("x"))
        big = kernels((in_features, out_features))
        for rows in args.rows:
            x, x_small = (torch.randn(rows, k).to(dtype) for k in (in_features, SMALL_K))
            yield shape, rows, median_ms(big, small, x, x_small, args, flush)
        del big


def run(args: argparse.Namespace) -> None:
    max_rows = decoded_kernel_max_rows(args.dtype)
    plain = "bf16 widened" if args.dtype == torch.float32 else "bf16 layer"
    extra = args.format == "int4" and args.dtype == torch.bfloat16  # torch's int4 op
    scratchless = (f", without a scratch up to {FP8_ROWS_KERNEL_MAX_ROWS[args.dtype]}"
                   * (args.format == "fp8"))  # fmt: skip
    print(f"the {args.format} layer runs its kernel up to {max_rows} rows here{scratchless} "
          "(marked *)")  # fmt: skip
    print(f"{'K x N':>12} {'rows':>5} {'kernel':>8} {'decoded':>8} {plain:>13}"
          + (f" {'int4pack':>9}" if extra else "") + f" {'plain/ours':>11}"
          + (f" {'int4pack/ours':>14}" if extra else ""))  # fmt: skip
    for shape, rows, ms in time_shapes(args, lambda shape: kernels(shape, args), args.dtype):
        ours = ms[0] if rows <= max_rows else ms[1]
        marks = ("*", " ") if rows <= max_rows else (" ", "*")
        line = (f"{shape:>12} {rows:>5} {ms[0]:>7.3f}{marks[0]} {ms[1]:>7.3f}{marks[1]} "
                f"{ms[2]:>13.3f}")  # fmt: skip
        if extra:
            line += f" {ms[3]:>9.3f}"
        line += f" {ms[2] / ours:>10.2f}x"
        if extra:
            line += f" {ms[3] / ours:>13.2f}x"
        print(line, flush=True)


def add_timing_args(parser: argparse.ArgumentParser, dtype: str | None = None) -> None:
    """The threads, repeats and cache flush of ``median_ms``'s timing, and (with a default
    ``dtype``) the activations' dtype."""
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--flush-mb", type=int, default=1024)
    if dtype is not None:
        parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=dtype,
                            help="the activations' dtype")  # fmt: skip


def parse_timing_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The arguments, with ``--dtype`` as a torch dtype and torch's threads set."""
    args = parser.parse_args()
    if hasattr(args, "dtype"):
        args.dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    return args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="K x N (input x output)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 128])
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--format", choices=["int4", "fp8"], default="int4")
    add_timing_args(parser, dtype="bfloat16")
    args = parse_timing_args(parser)
    print(f"{args.format} weights, {args.dtype} activations, groups of {args.group_size}, "
          f"{args.threads} threads; median of {args.repeats} calls (ms)")  # fmt: skip
    with torch.inference_mode():
        run(args)


if __name__ == "__main__":
    main()
