"""bf16 linear layers on a CPU with AMX: omniserve's ``AmxLinear`` on its packed copy (a layer's
own weight) and on the plain weight (a tied head's), against ``OneDnnLinear`` (oneDNN's packed
copy, what such a layer runs with ``OMNISERVE_CPU_AMX=0``) and ``F.linear`` on the plain weight
(oneDNN reordering it per call, what a tied head runs then past 2 rows), at real checkpoints'
shapes.

Each figure is the median of ``--repeats`` calls in milliseconds, the kernels taking turns, with
the weights evicted before each call and the code path warmed on a small weight, as in
``bench_quantized_linear.py`` (whose timing loop this uses). The ratios compare each AMX layout
with the product it replaces; the last column is the weight's bytes over the packed AMX time.

    python scripts/bench_amx_linear.py                      # Qwen2.5-1.5B's layers and head
    python scripts/bench_amx_linear.py --shapes 3584x37888 --rows 1 8 --threads 1
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from bench_quantized_linear import Kernel, add_timing_args, parse_timing_args, time_shapes

from omniserve.cpu.linear import OneDnnLinear
from omniserve.cpu.linear_amx import AmxLinear

SHAPES = ["1536x2048", "1536x1536", "1536x17920", "8960x1536", "1536x151936"]
"""K x N: Qwen2.5-1.5B's fused qkv, o, fused gate/up and down projections, and its tied head."""


def kernels(shape: tuple[int, int]) -> list[Kernel]:
    """The four products of bf16 rows on one random bf16 weight of ``shape`` (K x N)."""
    in_features, out_features = shape
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.02).bfloat16()
    return [
        functools.partial(AmxLinear(weight, packed=True), bias=None),
        functools.partial(AmxLinear(weight, packed=False), bias=None),
        functools.partial(OneDnnLinear(weight), bias=None),
        functools.partial(F.linear, weight=weight),
    ]


def run(args: argparse.Namespace) -> None:
    print(f"{'K x N':>12} {'rows':>5} {'AMX':>8} {'AMX plain':>10} {'oneDNN':>8} {'F.linear':>9} "
          f"{'oneDNN/AMX':>11} {'F.linear/plain':>15} {'AMX GB/s':>9}")  # fmt: skip
    for shape, rows, ms in time_shapes(args, kernels, torch.bfloat16):
        k, n = map(int, shape.split("x"))
        print(f"{shape:>12} {rows:>5} {ms[0]:>8.3f} {ms[1]:>10.3f} {ms[2]:>8.3f} {ms[3]:>9.3f} "
              f"{ms[2] / ms[0]:>10.2f}x {ms[3] / ms[1]:>14.2f}x {k * n * 2 / ms[0] / 1e6:>9.1f}",
              flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="K x N (input x output)")
    parser.add_argument("--rows", type=int, nargs="+",
                        default=[1, 4, 8, 16, 32, 64, 128, 512, 2048])  # fmt: skip
    add_timing_args(parser)
    args = parse_timing_args(parser)
    if not AmxLinear.supports(torch.empty(16, 32, dtype=torch.bfloat16)):
        raise SystemExit("AmxLinear needs a CPU with AMX-BF16 and a C compiler (or "
                         "OMNISERVE_CPU_AMX is 0).")  # fmt: skip
    print(f"bf16, {args.threads} threads; median of {args.repeats} calls (ms)")
    with torch.inference_mode():
        run(args)


if __name__ == "__main__":
    main()
