"""Decode step time with tensor parallelism: TP=1 against TP=N on the same checkpoint.

A fixed batch of ``--batch-size`` random token-id prompts of ``--prompt-len`` tokens runs twice
per TP size through the offline ``LLM``: once for one output token (prefill) and once for
``1 + --decode-steps`` (eos ignored, prefix caching off). Every decode step then runs the whole
batch, so the time difference divided by ``--decode-steps`` is the mean step time of a batch of
that many decodes, measured end to end (scheduler, broadcast, forward on every rank, sampling).

    python scripts/bench_tp.py                      # bench-size Qwen3, TP 1 vs 2, gloo on CPU
    python scripts/bench_tp.py --tp 1 2 --size tiny

On a CPU the ranks share one machine's cores and memory bandwidth and talk over gloo (loopback
TCP), so this shows the overhead of the TP machinery, not what NVLink GPUs would gain.
"""

from __future__ import annotations

import argparse
import random
import time

from omniserve import LLM, SamplingParams
from omniserve.checkpoint_builder import build_tiny_checkpoint


def _timed_generate(llm: LLM, prompts: list[dict], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def measure(
    model_dir: str, tp: int, prompts: list[dict], decode_steps: int, repeats: int
) -> tuple[float, float]:
    """(prefill seconds, mean decode step seconds), best of ``repeats``."""
    llm = LLM(
        model_dir,
        dtype="float32",
        tensor_parallel_size=tp,
        enable_prefix_caching=False,
        max_num_seqs=len(prompts),
    )
    try:
        _timed_generate(llm, prompts, 2)  # warm-up
        prefill = min(_timed_generate(llm, prompts, 1) for _ in range(repeats))
        full = min(_timed_generate(llm, prompts, 1 + decode_steps) for _ in range(repeats))
    finally:
        llm.shutdown()
    return prefill, (full - prefill) / decode_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="Qwen3ForCausalLM")
    parser.add_argument("--size", default="bench", choices=["tiny", "bench"])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model_dir = str(build_tiny_checkpoint(args.arch, size=args.size))
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, 1000) for _ in range(args.prompt_len)]}
        for _ in range(args.batch_size)
    ]
    print(
        f"{args.arch} ({args.size}), batch {args.batch_size} x {args.prompt_len} prompt "
        f"tokens, {args.decode_steps} decode steps"
    )
    print(f"{'TP':>3} {'prefill (ms)':>13} {'decode step (ms)':>17} {'vs first':>9}")
    base = None
    for tp in args.tp:
        prefill, step = measure(model_dir, tp, prompts, args.decode_steps, args.repeats)
        base = base or step
        print(f"{tp:>3} {prefill * 1e3:>13.1f} {step * 1e3:>17.2f} {step / base:>8.2f}x")


if __name__ == "__main__":
    main()
