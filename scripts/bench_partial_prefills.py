"""The partial-prefill caps (--max-num-partial-prefills / --max-long-partial-prefills) on a burst of
long prompts followed by short ones, all sent at once: time to first token of the short and the
long requests, and the whole burst's time, with and without the caps, in one run (each setting in
its own process, one at a time).

    python scripts/bench_partial_prefills.py                       # real-size Qwen3-0.6B
    python scripts/bench_partial_prefills.py --model-dir PATH --long 4x1536 --short 16x64

Without caps the step budget goes to the prompts in arrival order, so the short prompts behind
long ones wait for the long ones' chunks; with them, one long prompt at a time prefills (in chunks
of --long-prefill-token-threshold, vLLM's 4% of max_model_len) and short prompts take the other
seats.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench_common import report, run_workers

SETTINGS = {
    "no caps": {},
    "4 seats 1 long": {"max_num_partial_prefills": 4, "max_long_partial_prefills": 1},
    "2 seats 1 long": {"max_num_partial_prefills": 2, "max_long_partial_prefills": 1},
}


def _shape(text: str) -> tuple[int, int]:
    count, length = text.split("x")
    return int(count), int(length)


def run_setting(model_dir: str, name: str, args: argparse.Namespace) -> dict[str, Any]:
    from omniserve import LLM, SamplingParams

    llm = LLM(model_dir, dtype="bfloat16", max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
              kv_cache_memory=2 << 30, **SETTINGS[name])  # fmt: skip
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)
    (num_long, long_len), (num_short, short_len) = _shape(args.long), _shape(args.short)

    def prompts(num: int, length: int) -> list[dict[str, list[int]]]:
        return [{"prompt_token_ids": [rng.randrange(1000, vocab) for _ in range(length)]}
                for _ in range(num)]  # fmt: skip

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts(1, 64), params, use_tqdm=False)  # warm-up
    burst = prompts(num_long, long_len) + prompts(num_short, short_len)  # long ones first
    start = time.perf_counter()
    outputs = llm.generate(burst, params, use_tqdm=False)
    wall = time.perf_counter() - start
    ttfts = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outputs]
    long, short = ttfts[:num_long], ttfts[num_long:]
    return {"setting": name, "wall_s": wall,
            "short_mean": statistics.mean(short), "short_max": max(short),
            "long_mean": statistics.mean(long), "long_max": max(long)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b", help="A real-size checkpoint's name.")
    parser.add_argument("--model-dir", default=None, help="A local checkpoint instead.")
    parser.add_argument("--long", default="4x1536", help="COUNTxTOKENS of the long prompts.")
    parser.add_argument("--short", default="16x64", help="COUNTxTOKENS of the short prompts.")
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--settings", default=",".join(SETTINGS), help="Comma-separated.")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        name, model_dir = json.loads(args.worker)
        report(run_setting(model_dir, name, args))
        return
    model_dir = args.model_dir
    if model_dir is None:
        from omniserve.checkpoint_builder import build_realsize_checkpoint

        model_dir = str(build_realsize_checkpoint(args.model))
    results = run_workers(__file__, args.settings.split(","), model_dir)
    base = results[0]
    print(
        f"{Path(model_dir).name}: {args.long} long then {args.short} short prompts at once, "
        f"{args.output_len} tokens each, budget {args.max_num_batched_tokens} tokens a step"
    )
    print(
        "| setting | short TTFT mean s | max | vs no caps | long TTFT mean s | max | vs no caps "
        "| burst s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['setting']} | {r['short_mean']:.2f} | {r['short_max']:.2f} | "
              f"{base['short_mean'] / r['short_mean']:.2f}x | {r['long_mean']:.2f} | "
              f"{r['long_max']:.2f} | {base['long_mean'] / r['long_mean']:.2f}x | "
              f"{r['wall_s']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
