"""fp32 linear layers of a bf16 checkpoint on a CPU without native bf16: omniserve's
``WidenedLinear`` (the bf16 weight widened in registers) against ``OneDnnLinear`` on the weight
widened to fp32 at load (``OMNISERVE_CPU_BF16_WEIGHTS=0``) and against bf16 throughout on
oneDNN's packed weight (``--dtype bfloat16``: bf16 activations, emulated where the CPU lacks
AVX512-BF16), at real checkpoints' shapes.

Each figure is the median of ``--repeats`` calls in milliseconds, the kernels taking turns, with
the weights evicted before each call and the code path warmed on a small weight, as in
``bench_quantized_linear.py`` (whose timing loop this uses). The ratios are the others' time over
``WidenedLinear``'s.

    python scripts/bench_cpu_linear.py                      # Qwen2.5-1.5B / 7B-sized layers
    python scripts/bench_cpu_linear.py --shapes 1536x17920 --rows 1 64 --threads 1
"""

from __future__ import annotations

import argparse
import functools

import torch
from bench_quantized_linear import SHAPES, Kernel, add_timing_args, parse_timing_args, time_shapes

from omniserve.cpu.linear import OneDnnLinear, WidenedLinear


def kernels(shape: tuple[int, int]) -> list[Kernel]:
    """The three products of fp32 rows on one random bf16 weight of ``shape`` (K x N); the last
    rounds the rows to bf16 first (a bf16 model's activations are bf16 already, so its times
    include that small cast)."""
    in_features, out_features = shape
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.02).bfloat16()
    bf16 = OneDnnLinear(weight)
    return [
        functools.partial(WidenedLinear(weight), bias=None),
        functools.partial(OneDnnLinear(weight.float()), bias=None),
        lambda x: bf16(x.bfloat16(), None),
    ]


def run(args: argparse.Namespace) -> None:
    print(f"{'K x N':>12} {'rows':>5} {'bf16 w, fp32':>13} {'fp32 oneDNN':>12} "
          f"{'bf16 oneDNN':>12} {'fp32/ours':>10} {'bf16/ours':>10}")  # fmt: skip
    for shape, rows, ms in time_shapes(args, kernels, torch.float32):
        print(f"{shape:>12} {rows:>5} {ms[0]:>13.3f} {ms[1]:>12.3f} {ms[2]:>12.3f} "
              f"{ms[1] / ms[0]:>9.2f}x {ms[2] / ms[0]:>9.2f}x", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="K x N (input x output)")
    parser.add_argument("--rows", type=int, nargs="+",
                        default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 1024])  # fmt: skip
    add_timing_args(parser)
    args = parse_timing_args(parser)
    if not WidenedLinear.available():
        raise SystemExit("WidenedLinear needs AVX-512 and a C compiler, which this machine lacks.")
    print(f"fp32 activations (bf16 for bf16 oneDNN), {args.threads} threads; "
          f"median of {args.repeats} calls (ms)")  # fmt: skip
    with torch.inference_mode():
        run(args)


if __name__ == "__main__":
    main()
