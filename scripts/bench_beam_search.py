"""Beam search on a real-size random-weight checkpoint: omniserve's ``LLM.beam_search`` (vLLM's
algorithm: one-token engine requests per step over the prefix cache) against transformers'
``generate(num_beams=...)`` on the same weights, and omniserve's greedy decoding of the same
prompts for scale. Every answer runs its full length (end tokens ignored), so both do the same
number of steps; the two searches keep different candidates (vLLM's and transformers' rules), so
only the time compares, not the beams.

    python scripts/bench_beam_search.py                       # qwen2.5-1.5b, 4 prompts, 4 beams
    python scripts/bench_beam_search.py --beams 2 --tokens 16 --prompts 2
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-1.5b")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16, help="omniserve's KV block size")
    args = parser.parse_args()

    from omniserve import LLM, BeamSearchParams, SamplingParams
    from omniserve.checkpoint_builder import build_realsize_checkpoint

    model_dir = str(build_realsize_checkpoint(args.model))
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(100, 10000, (args.prompt_len,), generator=gen).tolist()
        for _ in range(args.prompts)
    ]
    llm = LLM(
        model_dir,
        max_model_len=args.prompt_len + args.tokens + 16,
        kv_cache_memory="2GiB",
        block_size=args.block_size,
    )
    token_prompts = [{"prompt_token_ids": p} for p in prompts]
    params = BeamSearchParams(beam_width=args.beams, max_tokens=args.tokens, ignore_eos=True)
    llm.beam_search(token_prompts[:1], BeamSearchParams(beam_width=2, max_tokens=2))  # warm-up
    start = time.perf_counter()
    llm.beam_search(token_prompts, params)
    ours = time.perf_counter() - start
    greedy_params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(token_prompts, greedy_params, use_tqdm=False)
    greedy = time.perf_counter() - start
    llm.shutdown()
    del llm

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]]), num_beams=2, max_new_tokens=2)  # warm-up
        start = time.perf_counter()
        model.generate(
            torch.tensor(prompts), attention_mask=torch.ones(len(prompts), args.prompt_len),
            num_beams=args.beams, do_sample=False, max_new_tokens=args.tokens,
            min_new_tokens=args.tokens,
        )  # fmt: skip
        theirs = time.perf_counter() - start
    print(
        f"{args.model}, {args.prompts} prompts of {args.prompt_len} tokens, {args.beams} beams, "
        f"{args.tokens} tokens:\n"
        f"  omniserve beam search  {ours:7.2f} s\n"
        f"  transformers beams     {theirs:7.2f} s  (omniserve is {theirs / ours:.2f}x as fast)\n"
        f"  omniserve greedy       {greedy:7.2f} s  (beam search costs {ours / greedy:.1f}x)"
    )


if __name__ == "__main__":
    main()
