"""Speculative decoding (n-gram prompt lookup) on a real-size random-weight checkpoint: what
verifying drafts costs and what it saves, side by side with transformers (plain ``generate``, and
``generate`` with its own prompt lookup) in the same run.

Random weights do not repeat their prompt the way a trained model copying text does, so the
engine is also fed drafts of known quality besides its n-gram proposer's: first drafts that are
all wrong (every step verifies k drafts and keeps none: what drafts cost when they miss), then
that run's own greedy continuation (every draft right: the most drafts can save). In bf16 a
random-weight model's logits are nearly tied (a top-2 gap of ~0.1 over 150k tokens), and a
verifying step's k + 1-row GEMMs round differently from a 1-row decode's, so greedy outputs part
within a few tokens and the "right" drafts stop being right; the table then also gives the
derived bound (k + 1 tokens per step at the measured cost of a verifying step, which does the
same work whether its drafts are kept or not), and ``--dtype float32`` measures it directly.
Reported: output tokens/s per run, the drafts' acceptance, whether the tokens equal the plain
run's (greedy: only rounding parts them), and ratios to plain omniserve and to transformers.

    python scripts/bench_spec_decode.py --model qwen2.5-1.5b --batches 1,8 -k 4
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path
from typing import Any

os.environ["OMNISERVE_ENABLE_MULTIPROCESSING"] = "0"  # the drafts below are set in this process

from bench_realsize import _token_prompts  # noqa: E402  (this directory: the same prompts)


def _timed(llm: Any, prompts: list[list[int]], params: Any, repeats: int) -> tuple[float, list]:
    """Best wall time of ``repeats`` runs (after one untimed warm-up) and the last outputs."""
    requests = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(requests[:1], params, use_tqdm=False)
    best, outputs = float("inf"), []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    return best, outputs


def _known_drafts(continuations: dict[tuple[int, ...], list[int]], wrong: bool) -> Any:
    """A stand-in proposer: the next k tokens of the known greedy continuation (first one
    altered when ``wrong``, so the step keeps none)."""

    def propose(self: Any, token_ids: Any) -> list[int]:
        tokens = token_ids.tolist()
        for prompt, continuation in continuations.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                drafts = continuation[done : done + self.k]
                if wrong and drafts:
                    drafts[0] ^= 1
                return drafts
        return []

    return propose


def run_omniserve(model_dir: str, prompts: list[list[int]], args: argparse.Namespace) -> list[dict]:
    from omniserve import LLM, SamplingParams
    from omniserve.spec_decode.ngram_proposer import NgramProposer

    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    common = {"max_model_len": 1024, "max_num_seqs": max(len(prompts), 8), "dtype": args.dtype}
    llm = LLM(model_dir, **common)
    seconds, outputs = _timed(llm, prompts, params, args.repeats)
    greedy = [list(o.outputs[0].token_ids) for o in outputs]
    rows = [{"engine": "omniserve", "seconds": seconds}]
    del llm
    gc.collect()
    spec = {"method": "ngram", "num_speculative_tokens": args.k,
            "prompt_lookup_max": args.lookup_max, "prompt_lookup_min": args.lookup_min}  # fmt: skip
    llm = LLM(model_dir, speculative_config=spec, **common)
    continuations = {tuple(p): g for p, g in zip(prompts, greedy, strict=True)}
    ngram = NgramProposer.propose
    for label, propose in (
        ("+ drafts all wrong (cost)", _known_drafts(continuations, wrong=True)),
        ("+ drafts all right (bound)", None),
        ("+ n-gram drafts", ngram),
    ):
        propose = propose or _known_drafts(continuations, wrong=False)
        NgramProposer.propose = propose  # type: ignore[method-assign]
        before = llm.llm_engine.engine_core.call_utility("get_stats")
        seconds, outputs = _timed(llm, prompts, params, args.repeats)
        after = llm.llm_engine.engine_core.call_utility("get_stats")
        drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
        kept = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        same = sum(t == g for t, g in zip(tokens, greedy, strict=True))
        continuations = {tuple(p): t for p, t in zip(prompts, tokens, strict=True)}
        rows.append({"engine": f"omniserve {label}", "seconds": seconds,
                     "acceptance": kept / drafted if drafted else None,
                     "drafted": drafted, "same": same})  # fmt: skip
    NgramProposer.propose = ngram  # type: ignore[method-assign]
    return rows


def run_hf(model_dir: str, prompts: list[list[int]], args: argparse.Namespace) -> list[dict]:
    """transformers' greedy ``generate``, and (batch 1: transformers' assisted generation takes
    one sequence) with ``prompt_lookup_num_tokens``."""
    import torch
    import transformers

    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.eval()
    input_ids = torch.tensor(prompts)
    new = args.new_tokens
    variants: list[tuple[str, dict]] = [("transformers", {})]
    if len(prompts) == 1:
        lookup = {"prompt_lookup_num_tokens": args.k, "max_matching_ngram_size": args.lookup_max}
        variants.append(("transformers + prompt lookup", lookup))
    rows = []
    with torch.inference_mode():
        model.generate(input_ids[:1, :8], max_new_tokens=4, do_sample=False)
        for label, kwargs in variants:
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                model.generate(input_ids, max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, **kwargs)  # fmt: skip
                best = min(best, time.perf_counter() - start)
            rows.append({"engine": label, "seconds": best})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="qwen2.5-1.5b", help="A real-size builder entry, or a checkpoint dir."
    )
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="Timed runs each (best kept).")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--no-hf", action="store_true", help="Skip transformers.")
    args = parser.parse_args()

    from transformers import AutoConfig

    from omniserve.checkpoint_builder import build_realsize_checkpoint

    is_dir = Path(args.model).is_dir()
    model_dir = args.model if is_dir else str(build_realsize_checkpoint(args.model))
    vocab_size = AutoConfig.from_pretrained(model_dir).get_text_config().vocab_size
    print(f"# {args.model}, {args.dtype}, {args.prompt_len}-token prompts, "
          f"{args.new_tokens} new tokens, k={args.k}, n-grams "
          f"{args.lookup_min}..{args.lookup_max}")  # fmt: skip
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = _token_prompts(batch, batch, vocab_size, args.prompt_len)
        rows = run_omniserve(model_dir, prompts, args)
        if not args.no_hf:
            rows += run_hf(model_dir, prompts, args)
        plain = rows[0]["seconds"]
        hf = next((r["seconds"] for r in rows if r["engine"] == "transformers"), None)
        print(f"\n## batch {batch}\n\n| engine | output tok/s | vs omniserve | vs transformers "
              "| drafts kept | tokens as plain |\n|---|---|---|---|---|---|")  # fmt: skip
        for row in rows:
            rate = batch * args.new_tokens / row["seconds"]
            kept = row.get("acceptance")
            print(f"| {row['engine']} | {rate:.1f} | {plain / row['seconds']:.2f}x | "
                  + (f"{hf / row['seconds']:.2f}x" if hf else "-") + " | "
                  + ("-" if kept is None else f"{kept:.0%} of {row['drafted']:.0f}") + " | "
                  + (f"{row['same']}/{batch}" if "same" in row else "-") + " |",
                  flush=True)  # fmt: skip
        wrong = rows[1]["seconds"]
        print(f"\nDerived bound (every draft kept: {args.k + 1} tokens per verifying step): "
              f"{(args.k + 1) * batch * args.new_tokens / wrong:.1f} output tok/s, "
              f"{(args.k + 1) * plain / wrong:.2f}x omniserve"
              + (f", {(args.k + 1) * hf / wrong:.2f}x transformers" if hf else "")
              + " (prefill counted once per token, so a little under)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
