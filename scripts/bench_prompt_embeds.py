"""Prompts given as embeddings on a real-size random-weight checkpoint: omniserve's
``generate({"prompt_embeds": ...})`` against the same prompts as token ids (what the embeddings
path costs) and against transformers' ``generate(inputs_embeds=...)`` batched, on the same
weights and embeddings (each prompt's rows are its tokens' embedding rows, so all three answer
alike). Every answer runs its full length (end tokens ignored).

    python scripts/bench_prompt_embeds.py                  # qwen2.5-1.5b, 4 x 256 tokens, 32 out
    python scripts/bench_prompt_embeds.py --model tiny     # the tiny Qwen2 of the tests
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-1.5b", help="a real-size name, or tiny")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()

    from safetensors import safe_open

    from omniserve import LLM, SamplingParams
    from omniserve.checkpoint_builder import build_realsize_checkpoint, build_tiny_checkpoint

    model_dir = str(
        build_tiny_checkpoint("Qwen2ForCausalLM")
        if args.model == "tiny"
        else build_realsize_checkpoint(args.model)
    )
    dtype = torch.float32 if args.model == "tiny" else torch.bfloat16
    table = None
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            if "model.embed_tokens.weight" in f.keys():  # noqa: SIM118 - safe_open's API
                table = f.get_tensor("model.embed_tokens.weight")
    assert table is not None, "no model.embed_tokens.weight in the checkpoint"
    gen = torch.Generator().manual_seed(0)
    vocab = min(table.shape[0], 10000)
    ids = [
        torch.randint(100, vocab, (args.prompt_len,), generator=gen) for _ in range(args.prompts)
    ]
    embeds = [table[p].to(dtype) for p in ids]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)

    llm = LLM(model_dir, dtype=str(dtype).removeprefix("torch."), enable_prompt_embeds=True,
              max_model_len=args.prompt_len + args.tokens + 16, kv_cache_memory="2GiB",
              enable_prefix_caching=False)  # fmt: skip
    timings = {}
    answers = {}
    cases: list[tuple[str, list[Any]]] = [
        ("embeds", [{"prompt_embeds": e} for e in embeds]),
        ("ids", [{"prompt_token_ids": p.tolist()} for p in ids]),
    ]
    for name, prompts in cases:
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        timings[name] = time.perf_counter() - start
        answers[name] = [o.outputs[0].token_ids for o in outputs]
    llm.shutdown()
    del llm

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    batch = torch.stack(embeds)
    with torch.inference_mode():
        model.generate(inputs_embeds=batch[:1], max_new_tokens=2)  # warm-up
        start = time.perf_counter()
        out = model.generate(inputs_embeds=batch, attention_mask=torch.ones(batch.shape[:2]),
                             do_sample=False, max_new_tokens=args.tokens,
                             min_new_tokens=args.tokens)  # fmt: skip
        theirs = time.perf_counter() - start
    same = sum(a == b for a, b in zip(answers["embeds"], out.tolist(), strict=True))
    print(
        f"{args.model} ({str(dtype).removeprefix('torch.')}), {args.prompts} prompts of "
        f"{args.prompt_len} rows, {args.tokens} tokens each:\n"
        f"  omniserve, prompt_embeds  {timings['embeds']:7.2f} s\n"
        f"  omniserve, token ids      {timings['ids']:7.2f} s  (embeddings cost "
        f"{timings['embeds'] / timings['ids']:.2f}x; the same answers: "
        f"{answers['embeds'] == answers['ids']})\n"
        f"  transformers inputs_embeds {theirs:6.2f} s  (omniserve is "
        f"{theirs / timings['embeds']:.2f}x as fast; {same} of {args.prompts} answers identical)"
    )


if __name__ == "__main__":
    main()
