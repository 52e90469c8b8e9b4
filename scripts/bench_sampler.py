"""Sampling speed: omniserve's sampler against transformers' logits processors, on one batch of
logits over a real vocabulary (Qwen's 151,936 by default), per sampling setting.

omniserve's time includes building the step's metadata from host arrays (what the model runner
does each step); transformers' runs its processors (repetition penalty, temperature, top-k,
top-p) and then ``argmax`` or ``softmax`` + ``multinomial``, as ``generate`` does. Each figure is
the best of ``--repeats`` calls, each on a fresh copy of the logits (the copy is timed on both
sides). CPU by default; ``--device cuda`` where there is one.

    python scripts/bench_sampler.py                       # batch 256 x 151,936 on the CPU
    python scripts/bench_sampler.py --batch 32 --device cuda
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from omniserve.layers.sampler import Sampler
from omniserve.worker.sampling_inputs import build_sampling_metadata

CASES: dict[str, dict[str, float]] = {
    "greedy": {"temperature": 0.0},
    "top-p 0.9": {"temperature": 0.8, "top_p": 0.9},
    "top-k 20, top-p 0.8": {"temperature": 0.7, "top_k": 20, "top_p": 0.8},
    "untruncated": {"temperature": 1.0},
    "greedy, repetition 1.05": {"temperature": 0.0, "repetition_penalty": 1.05},
    "top-p 0.8, repetition 1.05": {"temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.05},
}
"""Name -> the settings of every row (Qwen checkpoints' generation configs look like the last)."""


def omniserve_sampler(
    settings: dict[str, float], seen: tuple[np.ndarray, np.ndarray], device: torch.device
) -> Callable[[torch.Tensor], torch.Tensor]:
    sampler = Sampler()

    def sample(logits: torch.Tensor) -> torch.Tensor:
        rows = logits.shape[0]

        def column(name: str, default: float) -> np.ndarray:
            return np.full(rows, settings.get(name, default))

        metadata = build_sampling_metadata(
            device,
            temperature=column("temperature", 1.0),
            top_p=column("top_p", 1.0),
            top_k=column("top_k", 0).astype(np.int64),
            min_p=column("min_p", 0.0),
            generators={},
            repetition=column("repetition_penalty", 1.0),
            seen_tokens=lambda penalized: (seen[0][penalized], seen[1][penalized]),
        )
        return sampler(logits, metadata).sampled_token_ids

    return sample


def transformers_sampler(
    settings: dict[str, float], seen: tuple[np.ndarray, np.ndarray], device: torch.device
) -> Callable[[torch.Tensor], torch.Tensor]:
    from transformers import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    processors = LogitsProcessorList()
    if settings.get("repetition_penalty", 1.0) != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(settings["repetition_penalty"]))
    greedy = settings["temperature"] == 0.0
    if not greedy:
        processors.append(TemperatureLogitsWarper(settings["temperature"]))
        if settings.get("top_k"):
            processors.append(TopKLogitsWarper(int(settings["top_k"])))
        if settings.get("top_p", 1.0) < 1.0:
            processors.append(TopPLogitsWarper(settings["top_p"]))
    input_ids = torch.from_numpy(np.concatenate(seen, axis=1)).clamp(min=0).to(device)

    def sample(logits: torch.Tensor) -> torch.Tensor:
        scores = processors(input_ids, logits)
        if greedy:
            return scores.argmax(-1)
        return torch.multinomial(scores.softmax(-1), 1).squeeze(1)

    return sample


def best_time(sample: Callable[[torch.Tensor], torch.Tensor], logits: torch.Tensor,
              repeats: int) -> float:  # fmt: skip
    best = float("inf")
    for _ in range(repeats):
        if logits.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        sample(logits.clone())
        if logits.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    device = torch.device(args.device)
    logits = (torch.randn(args.batch, args.vocab) * 4).to(device)
    rng = np.random.default_rng(0)
    # Every row has seen a prompt and an answer (the penalties' work grows with them).
    seen = (rng.integers(0, args.vocab, (args.batch, args.prompt_len)),
            rng.integers(0, args.vocab, (args.batch, args.output_len)))  # fmt: skip
    results = []
    for name, settings in CASES.items():
        ours = best_time(omniserve_sampler(settings, seen, device), logits, args.repeats)
        theirs = best_time(transformers_sampler(settings, seen, device), logits, args.repeats)
        results.append({"case": name, "omniserve_ms": ours * 1e3, "transformers_ms": theirs * 1e3})
        print(f"{name:28s} omniserve {ours * 1e3:8.1f} ms   transformers {theirs * 1e3:8.1f} ms"
              f"   {theirs / ours:5.2f}x", flush=True)  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--prompt-len", type=int, default=500)
    parser.add_argument("--output-len", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    print(f"batch {args.batch} x vocab {args.vocab} on {args.device}, "
          f"{torch.get_num_threads()} threads; best of {args.repeats}")  # fmt: skip
    run(args)


if __name__ == "__main__":
    main()
