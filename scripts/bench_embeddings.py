"""Embeddings (``LLM.embed``) against transformers' batched forward, pooled the same way (the
last position's state, the mean over the prompt, or the first position's: ``--pooling``), on
the same weights, prompts and dtype, in one run: a real-size random-weight checkpoint by default
(the dtype omniserve picks on this machine: bf16 where the CPU has native bf16, else fp32), or
the tiny Qwen2 of the tests. Prompts have ragged lengths (transformers pads them to the longest,
as a batched forward must); omniserve's prefix cache is off, so both compute every position.
Prints the time of each, the ratio, and how close the vectors are (the smallest cosine).

    python scripts/bench_embeddings.py                      # qwen2.5-1.5b, 16 prompts of 64-128
    python scripts/bench_embeddings.py --model tiny --prompts 64 --pooling MEAN
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-1.5b", help="a real-size name, or tiny")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=128, help="lengths in [max/2, max]")
    parser.add_argument("--pooling", choices=["LAST", "MEAN", "CLS"], default="LAST")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from omniserve import LLM, PoolingParams
    from omniserve.checkpoint_builder import build_realsize_checkpoint, build_tiny_checkpoint
    from omniserve.worker.worker import resolve_dtype

    tiny = args.model == "tiny"
    model_dir = str(
        build_tiny_checkpoint("Qwen2ForCausalLM") if tiny else build_realsize_checkpoint(args.model)
    )
    dtype = torch.float32 if tiny else resolve_dtype("auto", torch.device("cpu"), torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.max_len // 2, args.max_len + 1, (args.prompts,), generator=gen)
    vocab = 2000 if tiny else 10000
    prompts = [torch.randint(100, vocab, (int(n),), generator=gen).tolist() for n in lengths]

    llm = LLM(model_dir, dtype=str(dtype).removeprefix("torch."), max_model_len=args.max_len + 16,
              kv_cache_memory="2GiB", enable_prefix_caching=False)  # fmt: skip
    inputs = [{"prompt_token_ids": p} for p in prompts]
    pooling = PoolingParams(pooling_type=args.pooling)
    llm.embed(inputs[:2], pooling, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    ours = llm.embed(inputs, pooling, use_tqdm=False)
    omniserve_s = time.perf_counter() - start
    llm.shutdown()
    del llm

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    ids = torch.zeros(len(prompts), max(map(len, prompts)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, : len(p)], mask[i, : len(p)] = torch.tensor(p), 1
    with torch.inference_mode():
        model.model(input_ids=ids[:2], attention_mask=mask[:2])  # warm-up
        start = time.perf_counter()
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        if args.pooling == "MEAN":
            pooled = (hidden * mask[..., None]).sum(1) / lengths[:, None]
        else:
            pooled = hidden[torch.arange(len(prompts)), 0 if args.pooling == "CLS" else lengths - 1]
        theirs = F.normalize(pooled, dim=-1)
        hf_s = time.perf_counter() - start

    cosine = F.cosine_similarity(torch.tensor([o.outputs.embedding for o in ours]), theirs)
    tokens = int(lengths.sum())
    print(f"{args.model}, {str(dtype).removeprefix('torch.')}, {len(prompts)} prompts of "
          f"{args.max_len // 2}-{args.max_len} tokens ({tokens} in all), {args.pooling} pooling, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    for name, seconds in (("omniserve LLM.embed", omniserve_s), ("transformers forward", hf_s)):
        print(f"{name:<22} {seconds:8.2f} s  ({tokens / seconds:8.1f} tok/s)")
    print(f"omniserve / transformers speed: {hf_s / omniserve_s:.2f}x; "
          f"smallest cosine between the two engines' vectors: {cosine.min():.6f}")  # fmt: skip


if __name__ == "__main__":
    main()
