"""Embeddings (``LLM.embed``) against transformers' batched forward, pooled the same way (the
last position's state, the mean over the prompt, or the first position's: ``--pooling``), on
the same weights, prompts and dtype, in one run: a real-size random-weight checkpoint by default
(the dtype omniserve picks on this machine: bf16 where the CPU has native bf16, else fp32), or
the tiny Qwen2 of the tests. With ``--reranker`` the causal LM is served as an LLM reranker
(Qwen3-Reranker's form, through ``--hf-overrides``: the 2-way softmax of two tokens' logits at the
last position, ``LLM.classify``), each prompt standing for a query and a document joined, against
transformers' causal LM computing the same softmax. Prompts have ragged lengths (transformers pads
them to the longest, as a batched forward must); omniserve's prefix cache is off, so both compute
every position. Prints the time of each, the ratio, and how close the answers are (the smallest
cosine between the vectors; the largest difference of the reranker's probabilities).

    python scripts/bench_embeddings.py                      # qwen2.5-1.5b, 16 prompts of 64-128
    python scripts/bench_embeddings.py --model tiny --prompts 64 --pooling MEAN
    python scripts/bench_embeddings.py --model qwen3-0.6b --reranker --prompts 32 --max-len 256
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
    parser.add_argument("--reranker", action="store_true", help="score as an LLM reranker")
    args = parser.parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

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
    # The reranker's two tokens ("no", "yes" in Qwen3-Reranker; any two of this vocabulary here).
    tokens = AutoTokenizer.from_pretrained(model_dir).convert_ids_to_tokens([854, 1000])
    token_ids = torch.tensor([854, 1000])
    arch = AutoConfig.from_pretrained(model_dir).architectures[0].removesuffix("ForCausalLM")
    overrides = {"architectures": [f"{arch}ForSequenceClassification"],
                 "classifier_from_token": tokens, "is_original_qwen3_reranker": True}  # fmt: skip
    model_dtype = str(dtype).removeprefix("torch.")

    llm = LLM(model_dir, dtype=model_dtype, max_model_len=args.max_len + 16,
              kv_cache_memory="2GiB", enable_prefix_caching=False,
              hf_overrides=overrides if args.reranker else None)  # fmt: skip
    inputs = [{"prompt_token_ids": p} for p in prompts]
    pooling = PoolingParams(pooling_type=args.pooling)
    run = llm.classify if args.reranker else llm.embed
    run(inputs[:2], pooling, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    ours = torch.tensor([
        o.outputs.probs if args.reranker else o.outputs.embedding
        for o in run(inputs, pooling, use_tqdm=False)
    ])  # fmt: skip
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
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        last = hidden[torch.arange(len(prompts)), lengths - 1]
        if args.reranker:
            theirs = model.lm_head(last).float()[:, token_ids].softmax(-1)[:, 1:]
        else:
            hidden = hidden.float()
            if args.pooling == "MEAN":
                pooled = (hidden * mask[..., None]).sum(1) / lengths[:, None]
            else:
                pooled = hidden[:, 0] if args.pooling == "CLS" else last.float()
            theirs = F.normalize(pooled, dim=-1)
        hf_s = time.perf_counter() - start

    tokens_in_all = int(lengths.sum())
    task = "reranker (2-way softmax)" if args.reranker else f"{args.pooling} pooling"
    print(f"{args.model}, {model_dtype}, {len(prompts)} prompts of {args.max_len // 2}-"
          f"{args.max_len} tokens ({tokens_in_all} in all), {task}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    name = "LLM.classify" if args.reranker else "LLM.embed"
    for engine, seconds in ((f"omniserve {name}", omniserve_s), ("transformers forward", hf_s)):
        print(f"{engine:<23} {seconds:8.2f} s  ({tokens_in_all / seconds:8.1f} tok/s)")
    closeness = (
        f"largest probability difference: {(ours - theirs).abs().max():.2e}"
        if args.reranker
        else f"smallest cosine between the two engines' vectors: "
        f"{F.cosine_similarity(ours, theirs).min():.6f}"
    )
    print(f"omniserve / transformers speed: {hf_s / omniserve_s:.2f}x; {closeness}")


if __name__ == "__main__":
    main()
