"""Structured outputs' cost: the same offline workload free and JSON-schema constrained (output
tokens/s, and their ratio), and how long xgrammar takes to compile a 50-field schema against the
model's vocabulary (cold, then cached).

Both runs generate the same number of tokens (``ignore_eos``): a constrained request that
completes its JSON before max_tokens goes on unconstrained, as in vLLM, so the constrained figure
is a lower bound on the masking work only when outputs are long enough to stay inside the JSON.

    python scripts/bench_structured.py                          # bench-size Qwen3
    python scripts/bench_structured.py --realsize qwen3-1.7b --num-prompts 32 --output-len 32
    python scripts/bench_structured.py --model DIR --num-prompts 64 --output-len 64
"""

from __future__ import annotations

import argparse
import json
import os
import time

from omniserve import LLM, SamplingParams
from omniserve.checkpoint_builder import build_tiny_checkpoint
from omniserve.sampling_params import StructuredOutputsParams


def schema(num_fields: int) -> dict:
    kinds = [
        {"type": "string", "maxLength": 12},
        {"type": "integer"},
        {"type": "boolean"},
        {"enum": ["low", "mid", "high"]},
        {"type": "array", "items": {"type": "number"}, "maxItems": 3},
    ]
    return {
        "type": "object",
        "additionalProperties": False,
        "required": [f"field_{i}" for i in range(num_fields)],
        "properties": {f"field_{i}": kinds[i % len(kinds)] for i in range(num_fields)},
    }


def run(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="Checkpoint dir (default: bench Qwen3).")
    parser.add_argument(
        "--realsize",
        default=None,
        metavar="NAME",
        help="A real-size random-weight checkpoint instead (e.g. qwen3-1.7b: "
        "the real 151,936-token vocabulary), built once into the cache.",
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--fields", type=int, default=50, help="Fields of the compiled schema.")
    args = parser.parse_args()
    # The engine in this process, so its grammar compiler can be timed directly.
    os.environ["OMNISERVE_ENABLE_MULTIPROCESSING"] = "0"
    if args.realsize:
        from omniserve.checkpoint_builder.realsize import build_realsize_checkpoint

        model = str(build_realsize_checkpoint(args.realsize))
    else:
        model = args.model or str(build_tiny_checkpoint("Qwen3ForCausalLM", size="bench"))
    llm = LLM(model, max_model_len=1024)
    prompts = [f"Request {i}: describe the weather as JSON." for i in range(args.num_prompts)]
    free = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0,
        max_tokens=args.output_len,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(json=schema(4), disable_any_whitespace=True),
    )
    run(llm, prompts[:4], free)  # warm-up, and the small schema compiled once
    run(llm, prompts[:4], constrained)
    free_s, free_tokens = run(llm, prompts, free)
    constrained_s, constrained_tokens = run(llm, prompts, constrained)

    manager = llm.llm_engine.engine_core.engine_core.structured_output
    big = StructuredOutputsParams(json=schema(args.fields), disable_any_whitespace=True)
    start = time.perf_counter()
    manager.compile_async(big).result()
    cold = time.perf_counter() - start
    start = time.perf_counter()
    manager.compile_async(big).result()
    cached = time.perf_counter() - start

    free_rate, constrained_rate = free_tokens / free_s, constrained_tokens / constrained_s
    print(
        json.dumps(
            {
                "model": model,
                "prompts": args.num_prompts,
                "output_len": args.output_len,
                "vocab": manager.vocab_size,
            }
        )
    )
    print(f"free:        {free_tokens} tokens in {free_s:.2f} s = {free_rate:.1f} tok/s")
    print(
        f"constrained: {constrained_tokens} tokens in {constrained_s:.2f} s = "
        f"{constrained_rate:.1f} tok/s ({constrained_rate / free_rate:.2f}x free)"
    )
    print(
        f"compile of a {args.fields}-field schema: {cold * 1000:.0f} ms cold, "
        f"{cached * 1000:.1f} ms cached"
    )


if __name__ == "__main__":
    main()
