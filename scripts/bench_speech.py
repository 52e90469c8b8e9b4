"""Speech output: time to first audio (TTFA) and real-time factor (RTF) of omniserve at
concurrency 1, 4 and 16, beside transformers' ``generate(return_audio=True)`` one request at a
time, on the bench-size full Qwen3-Omni-MoE checkpoint (a 8-layer MoE thinker, a 2-layer MoE
talker, 16 code groups over a 2048-code book, a 2-layer code2wav), in one run; ``--arch
qwen2.5-omni``: the full Qwen2.5-Omni checkpoint (its bench-size thinker, the tiny talker and
token2wav, which vocodes each answer whole, so its TTFA is the whole answer's time).

Every request is a short chat turn; the thinker writes ``--text-tokens`` tokens (greedy, end of
turn ignored on both sides) and the talker speaks up to ``--frames`` frames (12.5 per second of
audio) with the reference's sampling defaults. omniserve streams: TTFA is the time from
submitting a request to its first audio samples. transformers returns the waveform at the end,
so its TTFA is its whole request. RTF is a request's time divided by the seconds of audio it
produced (below 1: faster than real time). Target: TTFA at concurrency 16 within 2x of
concurrency 1.

    python scripts/bench_speech.py
    python scripts/bench_speech.py --requests 16 --frames 50 --skip-hf
    python scripts/bench_speech.py --arch qwen2.5-omni
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from omniserve.checkpoint_builder import build_tiny_checkpoint  # noqa: E402
from omniserve.engine.arg_utils import EngineArgs  # noqa: E402
from omniserve.engine.async_llm import AsyncLLM  # noqa: E402
from omniserve.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
from omniserve.worker.worker import checkpoint_dtype, resolve_dtype  # noqa: E402

# --arch -> (architecture, codec frames per second of audio)
ARCHS = {
    "qwen3-omni": ("Qwen3OmniMoeForConditionalGeneration", 12.5),
    "qwen2.5-omni": ("Qwen2_5OmniForConditionalGeneration", 50.0),
}
SAMPLE_RATE = 24000
QUESTIONS = [
    "Tell me about the sea.",
    "What is a cat?",
    "Describe a red apple.",
    "Why is the sky blue?",
    "Count to five.",
    "Say something kind.",
]


def prompts(tokenizer: object, count: int) -> list[str]:
    return [
        tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for i in range(count)
    ]


def params(args: argparse.Namespace, seed: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_tokens=args.text_tokens,
        ignore_eos=True,
        output_modalities=["text", "audio"],
        output_kind=RequestOutputKind.DELTA,
        speech={"max_tokens": args.frames + 1, "seed": seed},
    )


async def run_concurrency(
    engine: AsyncLLM, texts: list[str], args: argparse.Namespace, concurrency: int
) -> dict[str, float]:
    gate = asyncio.Semaphore(concurrency)
    ttfa, rtf, audio_seconds = [], [], 0.0

    async def one(i: int) -> None:
        nonlocal audio_seconds
        async with gate:
            start, first, samples = time.perf_counter(), None, 0
            async for output in engine.generate(
                {"prompt": texts[i]}, params(args, i), f"c{concurrency}-{i}"
            ):
                audio = output.outputs[0].audio
                if audio is not None and len(audio):
                    first = first or time.perf_counter()
                    samples += len(audio)
            end = time.perf_counter()
            seconds = samples / SAMPLE_RATE
            audio_seconds += seconds
            ttfa.append((first or end) - start)
            rtf.append((end - start) / max(seconds, 1e-9))

    wall = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(len(texts))))
    wall = time.perf_counter() - wall
    return {
        "ttfa_p50": statistics.median(ttfa),
        "ttfa_max": max(ttfa),
        "rtf_mean": statistics.fmean(rtf),
        "audio_s_per_s": audio_seconds / wall,
    }


def run_hf(
    model_dir: Path, texts: list[str], args: argparse.Namespace, dtype: torch.dtype
) -> dict[str, float]:
    import transformers
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    architecture = ARCHS[args.arch][0]
    # .to(dtype): transformers 5.2x leaves Qwen2.5-Omni sub-models in their own config dtype.
    model = getattr(transformers, architecture).from_pretrained(model_dir, dtype=dtype)
    model = model.to(dtype).eval()
    extra = {}
    if args.arch == "qwen2.5-omni":  # the reference hard-codes the 7B's end-of-speech ids
        talker = model.config.talker_config
        extra = {
            "speaker": "Chelsie",
            "talker_eos_token_id": [talker.tts_codec_pad_token_id, talker.tts_codec_end_token_id],
        }
    times, rtf, audio_seconds = [], [], 0.0
    wall = time.perf_counter()
    for i, text in enumerate(texts):
        torch.manual_seed(i)
        start = time.perf_counter()
        with torch.inference_mode():
            inputs = processor(text=[text], return_tensors="pt")
            _, wave = model.generate(
                **inputs,
                thinker_max_new_tokens=args.text_tokens,
                thinker_do_sample=False,
                thinker_eos_token_id=-1,
                talker_max_new_tokens=args.frames + 1,
                **extra,
            )
        elapsed = time.perf_counter() - start
        seconds = wave.numel() / SAMPLE_RATE
        audio_seconds += seconds
        times.append(elapsed)
        rtf.append(elapsed / max(seconds, 1e-9))
    wall = time.perf_counter() - wall
    return {
        "ttfa_p50": statistics.median(times),
        "ttfa_max": max(times),
        "rtf_mean": statistics.fmean(rtf),
        "audio_s_per_s": audio_seconds / wall,
    }


async def run_omniserve(model_dir: Path, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    engine = AsyncLLM.from_engine_args(
        EngineArgs(
            model=str(model_dir),
            dtype=args.dtype,
            max_model_len=2048,
            kv_cache_memory=512 << 20,
            enable_prefix_caching=False,
        )
    )
    try:
        texts = prompts(engine.tokenizer, args.requests)
        await run_concurrency(engine, texts[:2], args, 2)  # warm-up
        return {
            f"omniserve c={c}": await run_concurrency(engine, texts, args, c) for c in (1, 4, 16)
        }
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16, help="requests per concurrency")
    parser.add_argument("--text-tokens", type=int, default=32)
    parser.add_argument("--frames", type=int, default=64, help="talker frames per request")
    parser.add_argument("--hf-requests", type=int, default=4)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--arch", choices=sorted(ARCHS), default="qwen3-omni")
    args = parser.parse_args()

    architecture, frame_rate = ARCHS[args.arch]
    model_dir = build_tiny_checkpoint(architecture, size="bench")
    dtype = resolve_dtype(
        args.dtype, torch.device("cpu"), checkpoint_dtype(AutoConfig.from_pretrained(model_dir))
    )
    rows = asyncio.run(run_omniserve(model_dir, args))
    if not args.skip_hf:
        texts = prompts(AutoTokenizer.from_pretrained(model_dir), args.hf_requests)
        rows["transformers (one at a time)"] = run_hf(model_dir, texts, args, dtype)
    print(
        f"\n{architecture} bench size ({model_dir.name}), {dtype}, {args.text_tokens} text "
        f"tokens, up to {args.frames} frames ({args.frames / frame_rate:.1f} s) per request\n"
    )
    print(f"{'system':32s} {'TTFA p50':>9s} {'TTFA max':>9s} {'RTF':>7s} {'audio s/s':>10s}")
    for name, row in rows.items():
        print(
            f"{name:32s} {row['ttfa_p50']:8.3f}s {row['ttfa_max']:8.3f}s "
            f"{row['rtf_mean']:7.3f} {row['audio_s_per_s']:10.2f}"
        )
    ratio = rows["omniserve c=16"]["ttfa_p50"] / rows["omniserve c=1"]["ttfa_p50"]
    print(f"\nTTFA p50 at concurrency 16 / at 1: {ratio:.2f}x (target <= 2x)")


if __name__ == "__main__":
    main()
