"""One MoE layer's experts on the CPU at a real checkpoint's shape (Qwen3-30B-A3B and
Qwen3-Omni-30B-A3B: 128 experts of width 768 over hidden 2048, top-8): the experts kept 4-bit
(groups of 128) and FP8 (128 x 128 blocks) against the bf16 checkpoint's experts, all through
``CpuMoE`` as the backend places them.

Per token count: the median of ``--repeats`` calls in milliseconds, the formats taking turns,
each call on fresh routing (random experts, so most weights come from DRAM as a decode step's
do; ``--flush-mb`` of memory is read before each call as well), and the bytes of the experts the
call touched over its time. Up to ``MAX_ROUTED_PER_EXPERT`` routed tokens per expert (64 tokens
here) the C kernel runs; past that, torch's per-expert products (quantized experts decoded in C
first).

    python scripts/bench_moe.py                        # fp32 activations, as this CPU runs them
    python scripts/bench_moe.py --dtype bfloat16 --tokens 1 8 64
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch
from bench_quantized_linear import add_timing_args, median_ms, parse_timing_args

from omniserve.checkpoint_builder.quantized import quantized_matrix
from omniserve.config import QuantizationConfig
from omniserve.cpu.moe import CpuMoE
from omniserve.layers.fused_moe import FusedMoE, select_experts
from omniserve.layers.quantized_loading import quantize_experts

EXPERTS, TOP_K, HIDDEN, WIDTH = 128, 8, 2048, 768
FORMATS = {"int4": QuantizationConfig("awq", 128), "fp8": QuantizationConfig("fp8", 128, 128)}


def layers(args: argparse.Namespace) -> dict[str, FusedMoE]:
    """The bf16 experts (random, 0.05 std) and their quantized copies, each as ``CpuMoE`` runs
    it (bf16 experts under fp32 activations: widened in the kernel, as ``keep_bf16_weights``
    keeps them)."""
    gen = torch.Generator().manual_seed(0)
    plain = FusedMoE(EXPERTS, TOP_K, HIDDEN, WIDTH).bfloat16().requires_grad_(False)
    for param in (plain.gate_up_proj, plain.down_proj):
        for expert in param:
            expert.copy_(torch.randn(expert.shape, generator=gen) * 0.05)
    built = {"bf16": plain}
    for name in args.formats:
        config = FORMATS[name]
        layer = FusedMoE(EXPERTS, TOP_K, HIDDEN, WIDTH)
        quantize_experts(layer, config)
        for e in range(EXPERTS):
            gate, up = plain.gate_up_proj[e].float().chunk(2)
            for proj, weight in (("gate_proj", gate), ("up_proj", up),
                                 ("down_proj", plain.down_proj[e].float())):  # fmt: skip
                param = layer.down_proj if proj == "down_proj" else layer.gate_up_proj
                param.weight_loader(param, quantized_matrix(weight, config), e, proj)
        built[name] = layer
    for layer in built.values():
        assert CpuMoE.supports(layer, args.dtype)
        layer.kernel = CpuMoE(layer, args.dtype)
    return built


def caller(
    layer: FusedMoE, x: torch.Tensor, routes: list[tuple[torch.Tensor, torch.Tensor]]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer on ``x``, each call on the next routing of ``routes``."""
    order = itertools.cycle(routes)

    def run(_: torch.Tensor) -> torch.Tensor:
        weights, ids = next(order)
        return layer(x, weights.to(x.dtype), ids)

    return run


def expert_bytes(layer: FusedMoE) -> int:
    """One expert's stored bytes (codes, scales and zero points)."""
    tensors = [*layer.parameters(), *layer.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors) // EXPERTS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 256])
    parser.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS))
    add_timing_args(parser, dtype="float32")
    args = parse_timing_args(parser)
    with torch.inference_mode():
        built = layers(args)
        names = list(built)
        per_expert = {name: expert_bytes(layer) for name, layer in built.items()}
        print(f"{EXPERTS} experts, top-{TOP_K}, hidden {HIDDEN}, width {WIDTH}; {args.dtype} "
              f"activations, {args.threads} threads; median of {args.repeats} calls (ms); "
              "MB per expert: " + ", ".join(f"{n} {b / 1e6:.2f}" for n, b in
                                            per_expert.items()))  # fmt: skip
        ratios = " ".join(f"{'bf16/' + n:>10} {n + ' GB/s':>10}" for n in names[1:])
        print(f"{'tokens':>6} {'experts':>7} " + " ".join(f"{n:>8}" for n in names) + " " + ratios)
        flush = torch.ones(args.flush_mb << 18)
        gen = torch.Generator().manual_seed(1)
        for tokens in args.tokens:
            x = torch.randn(tokens, HIDDEN, generator=gen).to(args.dtype)
            routes = [select_experts(torch.randn(tokens, EXPERTS, generator=gen), TOP_K, True)
                      for _ in range(args.repeats + 1)]  # fmt: skip
            touched = sum(ids.unique().numel() for _, ids in routes) / len(routes)

            kernels = [caller(layer, x, routes) for layer in built.values()]
            warm = [lambda _: None for _ in kernels]
            ms = median_ms(kernels, warm, x, x, args, flush)
            line = f"{tokens:>6} {touched:>7.1f} " + " ".join(f"{t:>8.2f}" for t in ms)
            for name, t in zip(names[1:], ms[1:], strict=True):
                rate = touched * per_expert[name] / (t * 1e-3) / 1e9
                line += f" {ms[0] / t:>9.2f}x {rate:>10.1f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
