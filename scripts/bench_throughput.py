"""Offline throughput: omniserve vs Hugging Face generate, on the same checkpoint, in one run.

Baselines: HF ``generate`` one request at a time, and HF batched ``generate`` over the whole set
with left padding (it runs every row to the longest requested output; only requested tokens
count). Every system produces exactly the requested number of tokens per request (eos ignored).

    python scripts/bench_throughput.py --num-prompts 32
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from omniserve import LLM, SamplingParams
from omniserve.checkpoint_builder import build_tiny_checkpoint


def make_workload(
    vocab: int, num: int, seed: int, in_range: tuple[int, int], out_range: tuple[int, int]
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(100, vocab) for _ in range(rng.randint(*in_range))],
            rng.randint(*out_range),
        )
        for _ in range(num)
    ]


def bench_hf_single(model, workload) -> float:
    start = time.perf_counter()
    for prompt, out_len in workload:
        model.generate(
            torch.tensor([prompt]),
            max_new_tokens=out_len,
            min_new_tokens=out_len,
            do_sample=False,
            pad_token_id=0,
        )
    return time.perf_counter() - start


def bench_hf_batched(model, workload, pad_id: int) -> float:
    longest = max(len(p) for p, _ in workload)
    ids = torch.full((len(workload), longest), pad_id)
    mask = torch.zeros((len(workload), longest), dtype=torch.long)
    for i, (prompt, _) in enumerate(workload):  # left padding, as generate expects
        ids[i, longest - len(prompt) :] = torch.tensor(prompt)
        mask[i, longest - len(prompt) :] = 1
    max_out = max(n for _, n in workload)
    start = time.perf_counter()
    model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max_out,
        min_new_tokens=max_out,
        do_sample=False,
        pad_token_id=pad_id,
    )
    return time.perf_counter() - start


def bench_omniserve(llm: LLM, workload) -> float:
    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == [n for _, n in workload]
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", default="Qwen3ForCausalLM")
    parser.add_argument("--size", default="bench", choices=["tiny", "bench"])
    parser.add_argument("--model", default=None, help="A checkpoint dir instead of building one.")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 128))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf-single", action="store_true")
    args = parser.parse_args()

    model_dir = args.model or str(build_tiny_checkpoint(args.arch, size=args.size))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    workload = make_workload(
        len(tokenizer), args.num_prompts, args.seed, tuple(args.input_len), tuple(args.output_len)
    )
    total_out = sum(n for _, n in workload)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = sum(p.numel() for p in hf.parameters()) / 1e6
    print(
        f"model {model_dir} ({params:.1f}M params), {args.num_prompts} requests, "
        f"{sum(len(p) for p, _ in workload)} prompt tokens, {total_out} output tokens, "
        f"torch threads {torch.get_num_threads()}, cpu count {os.cpu_count()}"
    )

    llm = LLM(model_dir, dtype="float32", enable_prefix_caching=False)
    bench_omniserve(llm, workload[:2])  # warm-up
    results = {"omniserve": bench_omniserve(llm, workload)}
    with torch.inference_mode():
        hf.generate(torch.tensor([workload[0][0]]), max_new_tokens=2, pad_token_id=0)
        results["hf batched generate"] = bench_hf_batched(hf, workload, tokenizer.pad_token_id or 0)
        if not args.skip_hf_single:
            results["hf generate, one at a time"] = bench_hf_single(hf, workload)

    ours = total_out / results["omniserve"]
    print(f"\n{'system':30s} {'time s':>8s} {'out tok/s':>10s} {'omniserve x':>12s}")
    for name, elapsed in results.items():
        rate = total_out / elapsed
        print(f"{name:30s} {elapsed:8.2f} {rate:10.1f} {ours / rate:12.2f}")


if __name__ == "__main__":
    main()
