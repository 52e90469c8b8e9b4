"""Video token pruning (--video-pruning-rate) on a video prompt: time to first token and decode
speed at each rate, beside transformers' ``generate`` (bf16, no pruning) on the same video, in one
run. Each engine runs in its own process (one at a time), so no engine's threads or allocator
slow another; every timed request carries a video the engine has not seen (no cache hit).

    python scripts/bench_video_pruning.py                         # real-size Qwen2.5-VL-3B
    python scripts/bench_video_pruning.py --model qwen3-vl-2b --rates 0,0.75 --frames 16
    python scripts/bench_video_pruning.py --model qwen2.5-omni-3b-thinker
    python scripts/bench_video_pruning.py --model-dir PATH --no-hf     # any local checkpoint

The video is a still scene with a moving square, ``--frames`` frames of ``--size`` pixels a side.
What pruning saves is decoder work (the prompt's video tokens, and the KV they take); the vision
tower still encodes every frame.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_common import report, run_workers


def make_prompt(model_dir: str) -> str:
    """One user turn with the video, in the model's placeholder."""
    from omniserve.config import ModelConfig
    from omniserve.plugins import load_plugins
    from omniserve.registry import ModelRegistry

    load_plugins()
    architecture = ModelConfig.from_path(model_dir).architecture
    placeholder = ModelRegistry.resolve_model_cls(architecture).get_placeholder_str("video", 0)
    return (f"<|im_start|>user\n{placeholder}What happens in this video?<|im_end|>\n"
            "<|im_start|>assistant\n")  # fmt: skip


def make_video(seed: int, frames: int, size: int) -> np.ndarray:
    """``[frames, size, size, 3]`` uint8: a fixed random background, a square moving across."""
    rng = np.random.default_rng(seed)
    background = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    video = np.repeat(background[None], frames, axis=0)
    side = size // 6
    for t in range(frames):
        x = (t * size // max(frames, 1)) % (size - side)
        video[t, size // 3 : size // 3 + side, x : x + side] = rng.integers(0, 256, 3)
    return video


def run_omniserve(model_dir: str, rate: float, args: argparse.Namespace) -> dict[str, Any]:
    from omniserve import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model_dir, dtype="bfloat16", video_pruning_rate=rate,
              max_model_len=args.max_model_len, kv_cache_memory=2 << 30,
              enable_prefix_caching=False)  # fmt: skip
    load_s = time.perf_counter() - start
    text = make_prompt(model_dir)

    def timed(seed: int, max_tokens: int) -> tuple[float, Any]:
        video = make_video(seed, args.frames, args.size)
        prompt = {"prompt": text, "multi_modal_data": {"video": [video]}}
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        begin = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        return time.perf_counter() - begin, out

    timed(1, 2)  # warm-up: kernels, the media path
    ttft = min(timed(seed, 1)[0] for seed in range(2, 2 + args.rounds))
    _, out = timed(100, args.decode)  # its tokens after the first, timed by the engine
    decode_s = out.metrics["last_token_time"] - out.metrics["first_token_time"]
    return {"engine": f"omniserve rate {rate:g}", "load_s": load_s, "ttft_s": ttft,
            "decode_tok_s": (args.decode - 1) / max(decode_s, 1e-9),
            "prompt_tokens": len(out.prompt_token_ids),
            "video_tokens": out.prompt_token_ids.count(_video_token_id(model_dir))}  # fmt: skip


def _video_token_id(model_dir: str) -> int:
    from transformers import AutoProcessor

    return int(AutoProcessor.from_pretrained(model_dir).video_token_id)


def run_hf(model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import AutoConfig, AutoProcessor

    start = time.perf_counter()
    processor = AutoProcessor.from_pretrained(model_dir)
    model_cls = getattr(transformers, AutoConfig.from_pretrained(model_dir).architectures[0])
    model = model_cls.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    text = make_prompt(model_dir)
    load_s = time.perf_counter() - start

    def timed(seed: int, max_tokens: int) -> tuple[float, Any]:
        begin = time.perf_counter()
        inputs = processor(text=[text], videos=[make_video(seed, args.frames, args.size)],
                           return_tensors="pt")  # fmt: skip
        inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v
                  for k, v in inputs.items()}  # fmt: skip
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                           do_sample=False)  # fmt: skip
        return time.perf_counter() - begin, inputs["input_ids"][0]

    timed(1, 2)
    ttft = min(timed(seed, 1)[0] for seed in range(2, 2 + args.rounds))
    whole, ids = timed(100, args.decode)
    first, _ = timed(100, 1)  # the same request to its first token: the rest is decode
    return {"engine": "transformers generate", "load_s": load_s, "ttft_s": ttft,
            "decode_tok_s": (args.decode - 1) / max(whole - first, 1e-9),
            "prompt_tokens": len(ids),
            "video_tokens": int((ids == processor.video_token_id).sum())}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-vl-3b", help="A real-size checkpoint's name.")
    parser.add_argument("--model-dir", default=None, help="A local checkpoint instead.")
    parser.add_argument("--rates", default="0,0.5,0.75")
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--size", type=int, default=336)
    parser.add_argument("--decode", type=int, default=16, help="Tokens of the decode run.")
    parser.add_argument("--rounds", type=int, default=2, help="Timed first-token runs (best).")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:  # one engine, in this process
        engine, model_dir = json.loads(args.worker)
        if engine == "hf":
            result = run_hf(model_dir, args)
        else:
            result = run_omniserve(model_dir, float(engine), args)
        report(result)
        return
    model_dir = args.model_dir
    if model_dir is None:
        from omniserve.checkpoint_builder import build_realsize_checkpoint

        model_dir = str(build_realsize_checkpoint(args.model))
    engines = [*args.rates.split(","), *([] if args.no_hf else ["hf"])]
    results = run_workers(__file__, engines, model_dir)
    base = results[0]
    print(
        f"{Path(model_dir).name}: {args.frames} frames of {args.size} px; TTFT best of "
        f"{args.rounds}, decode over {args.decode} tokens"
    )
    print(
        "| engine | video tokens | prompt tokens | TTFT s | TTFT vs rate 0 | decode tok/s | "
        "load s |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['engine']} | {r['video_tokens']} | {r['prompt_tokens']} | {r['ttft_s']:.2f} | "
              f"{base['ttft_s'] / r['ttft_s']:.2f}x | {r['decode_tok_s']:.2f} | "
              f"{r['load_s']:.1f} |")  # fmt: skip
    if not args.no_hf:
        hf = results[-1]
        print(f"omniserve rate 0 vs transformers: TTFT {hf['ttft_s'] / base['ttft_s']:.2f}x; "
              + "; ".join(f"rate {r['engine'].split()[-1]} {hf['ttft_s'] / r['ttft_s']:.2f}x"
                          for r in results[1:-1]))  # fmt: skip


if __name__ == "__main__":
    main()
