"""Offline throughput: omniserve vs Hugging Face generate, on the same checkpoint, in one run.

Baselines: HF ``generate`` one request at a time, and HF batched ``generate`` over the whole set
with left padding (it runs every row to the longest requested output; only requested tokens
count). Every system produces exactly the requested number of tokens per request (eos ignored).
HF times include its processor call (padding; for multimodal, image/audio features), as
omniserve's include its front end. Prefix caching is off unless asked for: HF has none.

Workloads:

- ``text`` (default): random token-id prompts on the bench-size Qwen3.
- ``mm``: a chat turn with one image (bench-size Qwen2-VL), then a second pass with one audio clip
  (bench-size Qwen2-Audio). Items of mixed sizes come from a small pool (``--mm-pool-size``), each
  used equally often, so most requests repeat an item seen before. One table per model: their
  speeds differ, so one combined table would mix them. Each pass also reports the omniserve run's
  processor-cache and encoder-cache hit rates, and the time to first token of a new item against
  the same item again in a new request.
- ``omni``: 64 requests by default on the bench-size Qwen3-Omni-MoE thinker, a third each with one
  image, one audio clip, or text only; images and clips come from pools as in ``mm``. HF's
  processor takes the mixed batch in one call. Besides the table and the cache hit rates, the
  omniserve pass runs once more in this process with the model runner's step timer on, and a
  table attributes its time to the encoders, prefill and decode steps' forwards, the sampler, and
  the rest (front end, scheduler, input prep, output processing).
- ``omni-av``: as ``omni``, but every request carries an image *and* an audio clip (24
  requests, 32 new tokens by default): the encoder- and prefill-heavy mix.

Both systems run in ``--dtype`` (default: the checkpoint's, resolved as omniserve resolves
"auto": bf16 for the bf16 bench checkpoints on a CPU with native bf16).

    python scripts/bench_throughput.py --num-prompts 32
    python scripts/bench_throughput.py --workload mm --num-prompts 32
    python scripts/bench_throughput.py --workload omni
    python scripts/bench_throughput.py --workload omni-av
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch
import transformers
from PIL import Image
from transformers import AutoProcessor, AutoTokenizer

from omniserve import LLM, SamplingParams
from omniserve.checkpoint_builder import build_tiny_checkpoint

TEXT_ARCH = "Qwen3ForCausalLM"
MM_ARCHS = ("Qwen2VLForConditionalGeneration", "Qwen2AudioForConditionalGeneration")
OMNI_ARCH = "Qwen3OmniMoeThinkerForConditionalGeneration"
SAMPLE_RATE = 16000
WORDS = (
    "what is shown here describe the colours shapes and sounds in detail then say which part "
    "stands out most and why a listener or viewer would notice it first"
).split()

Prompt = dict[str, Any]
"""An omniserve prompt: {"prompt_token_ids": ...} or {"prompt": ..., "multi_modal_data": ...}."""
Workload = list[tuple[Prompt, int]]
"""(prompt, number of output tokens) per request."""
Encoder = Callable[[list[Prompt]], dict[str, torch.Tensor]]
"""Prompts -> HF ``generate`` inputs for them as one left-padded batch."""


# ---- media workloads --------------------------------------------------------------------------


@dataclass(frozen=True)
class MediaKind:
    """How one modality's requests are made and handed to the HF processor."""

    modality: str
    template: str
    """The chat turn around one item's placeholder; ``{question}`` is the user's text."""
    make_item: Callable[[np.random.Generator, float], Any]
    """(rng, scale in [0, 1]) -> an item in omniserve's form, larger with scale; None for a
    text-only kind."""
    hf_media: Callable[[list[Any]], dict[str, Any]]
    """Items -> the HF processor's media kwargs."""

    def prompt(self, question: str, item: Any) -> Prompt:
        prompt: Prompt = {"prompt": self.template.format(question=question)}
        if item is not None:
            prompt["multi_modal_data"] = {self.modality: item}
        return prompt

    def items(self, prompts: list[Prompt]) -> list[Any]:
        """This kind's item of each prompt that has one, in order."""
        return [
            p["multi_modal_data"][self.modality]
            for p in prompts
            if self.modality in p.get("multi_modal_data", {})
        ]


def make_image(rng: np.random.Generator, scale: float) -> Image.Image:
    """56..448 px wide, 0.5-1x as tall; the checkpoint's processor resizes the larger ones down
    to its 64-token cap (4..64 image tokens)."""
    width = 28 * (2 + round(14 * scale))
    height = 28 * max(2, round(width / 28 * rng.uniform(0.5, 1.0)))
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def make_audio(rng: np.random.Generator, scale: float) -> tuple[np.ndarray, int]:
    """A 1..12 s tone in noise (25..300 Qwen2-Audio tokens, 13..156 Qwen3-Omni ones)."""
    seconds = 1.0 + 11.0 * scale
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE  # [num_samples]
    wave = 0.3 * np.sin(2 * np.pi * rng.uniform(100, 2000) * t) + 0.05 * rng.standard_normal(len(t))
    return wave.astype(np.float32), SAMPLE_RATE


def hf_audio(items: list[tuple[np.ndarray, int]]) -> dict[str, Any]:
    return {"audio": [wave for wave, _ in items], "sampling_rate": SAMPLE_RATE}


MEDIA_KINDS = {
    "Qwen2VLForConditionalGeneration": MediaKind(
        "image",
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{question}<|im_end|>\n"
        "<|im_start|>assistant\n",
        make_image,
        lambda items: {"images": items},
    ),
    "Qwen2AudioForConditionalGeneration": MediaKind(
        "audio",
        "<|im_start|>user\nAudio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\n{question}<|im_end|>\n"
        "<|im_start|>assistant\n",
        make_audio,
        hf_audio,
    ),
}
OMNI_KINDS = (
    MEDIA_KINDS["Qwen2VLForConditionalGeneration"],  # Qwen3-Omni uses the same image tokens
    MediaKind(
        "audio",
        "<|im_start|>user\n<|audio_start|><|audio_pad|><|audio_end|>{question}<|im_end|>\n"
        "<|im_start|>assistant\n",
        make_audio,
        hf_audio,
    ),
    MediaKind(
        "text",
        "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n",
        lambda rng, scale: None,
        lambda items: {},
    ),
)
"""The ``omni`` workload's request kinds: image, audio, text only (Qwen3-Omni's tokens)."""


class PairKind(MediaKind):
    """Requests carrying one image and one audio clip each (``omni-av``)."""

    def prompt(self, question: str, item: Any) -> Prompt:
        image, audio = item
        return {"prompt": self.template.format(question=question),
                "multi_modal_data": {"image": image, "audio": audio}}  # fmt: skip

    def items(self, prompts: list[Prompt]) -> list[Any]:
        return [(p["multi_modal_data"]["image"], p["multi_modal_data"]["audio"])
                for p in prompts if "multi_modal_data" in p]  # fmt: skip


AV_KIND = PairKind(
    "image+audio",
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|><|audio_start|><|audio_pad|>"
    "<|audio_end|>{question}<|im_end|>\n<|im_start|>assistant\n",
    lambda rng, scale: (make_image(rng, scale), make_audio(rng, scale)),
    lambda items: {"images": [image for image, _ in items], **hf_audio([a for _, a in items])},
)
"""The ``omni-av`` workload's one request kind."""


def make_mm_workload(
    kind: MediaKind,
    num: int,
    seed: int,
    pool_size: int,
    in_range: tuple[int, int],
    out_range: tuple[int, int],
) -> Workload:
    """`num` requests over `pool_size` items from smallest to largest, each item used equally
    often (±1) in shuffled order; questions of `in_range` words."""
    rng = random.Random(seed)
    media_rng = np.random.default_rng(seed)
    pool = [kind.make_item(media_rng, i / max(1, pool_size - 1)) for i in range(pool_size)]
    order = [i % pool_size for i in range(num)]
    rng.shuffle(order)
    workload = []
    for index in order:
        question = " ".join(rng.choices(WORDS, k=rng.randint(*in_range)))
        workload.append((kind.prompt(question, pool[index]), rng.randint(*out_range)))
    return workload


def make_mixed_workload(
    kinds: Sequence[MediaKind],
    num: int,
    seed: int,
    pool_size: int,
    in_range: tuple[int, int],
    out_range: tuple[int, int],
) -> Workload:
    """`num` requests split evenly (±1) over `kinds`, each kind's share made by
    `make_mm_workload` with its own pool, shuffled together."""
    workload = []
    for i, kind in enumerate(kinds):
        share = num // len(kinds) + (i < num % len(kinds))
        pool = min(pool_size, share)
        workload += make_mm_workload(kind, share, seed + i, pool, in_range, out_range)
    random.Random(seed).shuffle(workload)
    return workload


def mm_encoder(processor: Any, kinds: Sequence[MediaKind]) -> Encoder:
    """One processor call for any mix of kinds: each kind's items in prompt order, which is how
    the processor matches them to the placeholders."""

    def encode(prompts: list[Prompt]) -> dict[str, torch.Tensor]:
        media: dict[str, Any] = {}
        for kind in kinds:
            items = kind.items(prompts)
            if items:
                media.update(kind.hf_media(items))
        return processor(
            text=[p["prompt"] for p in prompts],
            **media,
            padding=True,
            padding_side="left",
            return_tensors="pt",
        )

    return encode


# ---- text workload ----------------------------------------------------------------------------


def make_workload(
    vocab: int, num: int, seed: int, in_range: tuple[int, int], out_range: tuple[int, int]
) -> Workload:
    rng = random.Random(seed)
    workload = []
    for _ in range(num):
        token_ids = [rng.randrange(100, vocab) for _ in range(rng.randint(*in_range))]
        workload.append(({"prompt_token_ids": token_ids}, rng.randint(*out_range)))
    return workload


def text_encoder(pad_id: int) -> Encoder:
    def encode(prompts: list[Prompt]) -> dict[str, torch.Tensor]:
        token_ids = [p["prompt_token_ids"] for p in prompts]
        longest = max(len(ids) for ids in token_ids)
        input_ids = torch.full((len(token_ids), longest), pad_id)  # [num_prompts, longest]
        mask = torch.zeros((len(token_ids), longest), dtype=torch.long)
        for i, ids in enumerate(token_ids):  # left padding, as generate expects
            input_ids[i, longest - len(ids) :] = torch.tensor(ids)
            mask[i, longest - len(ids) :] = 1
        return {"input_ids": input_ids, "attention_mask": mask}

    return encode


# ---- the systems ------------------------------------------------------------------------------


def cast_inputs(encode: Encoder, dtype: torch.dtype) -> Encoder:
    """The encoder with its float tensors (pixels, audio features) in the model's dtype."""

    def cast(prompts: list[Prompt]) -> dict[str, torch.Tensor]:
        inputs = encode(prompts)
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}

    return cast


def hf_generate(model: Any, inputs: dict[str, torch.Tensor], num_tokens: int, pad_id: int) -> None:
    out = model.generate(
        **inputs,
        max_new_tokens=num_tokens,
        min_new_tokens=num_tokens,
        do_sample=False,
        pad_token_id=pad_id,
    )
    assert out.shape[1] == inputs["input_ids"].shape[1] + num_tokens


def bench_hf_single(model: Any, workload: Workload, encode: Encoder, pad_id: int) -> float:
    start = time.perf_counter()
    for prompt, out_len in workload:
        hf_generate(model, encode([prompt]), out_len, pad_id)
    return time.perf_counter() - start


def bench_hf_batched(model: Any, workload: Workload, encode: Encoder, pad_id: int) -> float:
    start = time.perf_counter()
    inputs = encode([prompt for prompt, _ in workload])
    hf_generate(model, inputs, max(n for _, n in workload), pad_id)
    return time.perf_counter() - start


def bench_omniserve(llm: LLM, workload: Workload) -> tuple[float, list[Any]]:
    prompts = [p for p, _ in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == [n for _, n in workload]
    return elapsed, outputs


# ---- omniserve internals: cache counters and time to first token ------------------------------


def cache_counters(llm: LLM) -> dict[str, tuple[int, int]]:
    """Cumulative (hits, lookups) of each omniserve cache: items for the processor and encoder
    caches, prompt tokens for the prefix cache."""
    stats = llm.llm_engine.engine_core.call_utility("get_stats")
    counters = {
        "encoder cache (items)": (stats["encoder_cache_hits"], stats["encoder_cache_queries"]),
        "prefix cache (tokens)": (stats["prefix_cache_hits"], stats["prefix_cache_queries"]),
    }
    mm_processor = llm.llm_engine.processor.mm_processor
    if mm_processor is not None and mm_processor.cache is not None:
        processor = mm_processor.cache.stats()
        counters["processor cache (items)"] = (processor.hits, processor.hits + processor.misses)
    return {name: (int(hits), int(lookups)) for name, (hits, lookups) in counters.items()}


@dataclass
class TTFT:
    """Median seconds to the first token: the client's wall time of ``LLM.generate`` (front end
    included) and the engine's arrival -> first token (processing excluded)."""

    first_wall: float
    first_engine: float
    repeat_wall: float
    repeat_engine: float


def measure_ttft(llm: LLM, kind: MediaKind, seed: int, repeats: int) -> TTFT:
    """A largest-size item never seen before, then the same item in a new request (another
    question), `repeats` times with fresh items."""
    media_rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    walls: dict[str, list[float]] = {"first": [], "repeat": []}
    engine: dict[str, list[float]] = {"first": [], "repeat": []}
    for _ in range(repeats):
        item = kind.make_item(media_rng, 1.0)
        for label, question in (("first", "What is this?"), ("repeat", "And what else?")):
            start = time.perf_counter()
            (output,) = llm.generate(kind.prompt(question, item), params, use_tqdm=False)
            walls[label].append(time.perf_counter() - start)
            metrics = output.metrics
            engine[label].append(metrics["first_token_time"] - metrics["arrival_time"])
    median = statistics.median
    return TTFT(
        median(walls["first"]), median(engine["first"]),
        median(walls["repeat"]), median(engine["repeat"]),
    )  # fmt: skip


# ---- omniserve profile: where the time goes ---------------------------------------------------

REST = "rest: front end (tokenizer, HF processor), scheduler, input prep, output processing"


def profile_omniserve(
    args: argparse.Namespace, model_dir: str, warmup: Workload, workload: Workload
) -> dict[str, float]:
    """The omniserve pass again with the engine core in this process and the model runner's step
    timer on (``LLMEngine.start_step_timing``): part -> seconds, summing to the run's wall time;
    REST is what the runner's parts leave."""
    with mock.patch.dict(os.environ, {"OMNISERVE_ENABLE_MULTIPROCESSING": "0"}):
        llm = LLM(model_dir, dtype=args.dtype, enable_prefix_caching=args.enable_prefix_caching)
    try:
        bench_omniserve(llm, warmup)
        llm.llm_engine.start_step_timing()
        start = time.perf_counter()
        bench_omniserve(llm, workload)
        wall = time.perf_counter() - start
        timings = llm.llm_engine.get_step_timings()["seconds"]
    finally:
        llm.shutdown()
    seconds = {part: s for part, s in timings.items() if s > 0}  # e.g. no speech stage
    return {**seconds, REST: wall - sum(seconds.values())}


# ---- one pass: one model, every system --------------------------------------------------------


@dataclass
class PassResult:
    model_dir: str
    num_output_tokens: int
    seconds: dict[str, float]
    """system -> wall seconds for the whole workload."""
    cache_hits: dict[str, tuple[int, int]] = field(default_factory=dict)
    """cache -> (hits, lookups) during the timed omniserve run."""
    ttft: TTFT | None = None
    profile: dict[str, float] | None = None
    """part -> seconds of the profiled omniserve run (``omni``)."""


def media_kinds(workload: str, arch: str) -> tuple[MediaKind, ...]:
    """The request kinds of a workload on an architecture; none for ``text``."""
    if workload == "text":
        return ()
    if workload == "mm" and arch in MEDIA_KINDS:
        return (MEDIA_KINDS[arch],)
    if workload == "omni" and arch == OMNI_ARCH:
        return OMNI_KINDS
    if workload == "omni-av" and arch == OMNI_ARCH:
        return (AV_KIND,)
    supported = sorted(MEDIA_KINDS) if workload == "mm" else [OMNI_ARCH]
    raise SystemExit(f"--workload {workload} needs one of {supported}, not {arch}")


def build_workload(
    args: argparse.Namespace, kinds: Sequence[MediaKind], tokenizer: Any, seed: int, num: int
) -> Workload:
    if not kinds:
        in_range = tuple(args.input_len or (16, 256))
        return make_workload(len(tokenizer), num, seed, in_range, tuple(args.output_len))
    in_range = tuple(args.input_len or (8, 64))
    return make_mixed_workload(
        kinds, num, seed, args.mm_pool_size, in_range, tuple(args.output_len)
    )


def run_pass(args: argparse.Namespace, model_dir: str) -> PassResult:
    arch = json.loads((Path(model_dir) / "config.json").read_text())["architectures"][0]
    kinds = media_kinds(args.workload, arch)
    hf_processor = (AutoProcessor if kinds else AutoTokenizer).from_pretrained(model_dir)
    tokenizer = getattr(hf_processor, "tokenizer", hf_processor)
    pad_id = tokenizer.pad_token_id or 0
    encode = mm_encoder(hf_processor, kinds) if kinds else text_encoder(pad_id)
    workload = build_workload(args, kinds, tokenizer, args.seed, args.num_prompts)
    warmup = build_workload(args, kinds, tokenizer, args.seed + 1, 2)  # items not in the workload
    result = PassResult(model_dir, sum(n for _, n in workload), {})

    llm = LLM(model_dir, dtype=args.dtype, enable_prefix_caching=args.enable_prefix_caching)
    try:
        dtype = getattr(torch, llm.llm_engine.engine_core.call_utility("get_model_info")["dtype"])
        bench_omniserve(llm, warmup)
        before = cache_counters(llm)
        result.seconds["omniserve"], outputs = bench_omniserve(llm, workload)
        after = cache_counters(llm)
        result.cache_hits = {
            name: (hits - before[name][0], lookups - before[name][1])
            for name, (hits, lookups) in after.items()
        }
        if args.workload == "mm":
            result.ttft = measure_ttft(llm, kinds[0], args.seed + 2, args.ttft_repeats)
    finally:
        llm.shutdown()

    hf = getattr(transformers, arch).from_pretrained(model_dir, dtype=dtype).eval()  # the same
    encode = cast_inputs(encode, dtype)
    print_header(result, hf, workload, outputs, kinds)
    with torch.inference_mode():
        hf_generate(hf, encode([warmup[0][0]]), 2, pad_id)
        result.seconds["hf batched generate"] = bench_hf_batched(hf, workload, encode, pad_id)
        if not args.skip_hf_single:
            result.seconds["hf generate, one at a time"] = bench_hf_single(
                hf, workload, encode, pad_id
            )
    if args.workload.startswith("omni"):  # last: its in-process engine tunes this process's malloc
        result.profile = profile_omniserve(args, model_dir, warmup, workload)
    print_report(result, args)
    return result


# ---- report -----------------------------------------------------------------------------------


def describe_requests(kinds: Sequence[MediaKind], workload: Workload, outputs: list[Any]) -> str:
    """Requests per media kind with their placeholder tokens and distinct items; text-only."""
    prompts = [p for p, _ in workload]
    parts = [
        f"{len(items)} {k.modality} ({sum(o.num_mm_tokens.get(k.modality, 0) for o in outputs)} "
        f"{k.modality} tokens, {len({id(item) for item in items})} distinct)"
        for k in kinds
        if (items := k.items(prompts))
    ]
    text_only = sum("multi_modal_data" not in p for p in prompts)
    parts += [f"{text_only} text-only"] if kinds and text_only else []
    return f" ({'; '.join(parts)})" if parts else ""


def print_header(
    result: PassResult, hf: Any, workload: Workload, outputs: list[Any],
    kinds: Sequence[MediaKind],
) -> None:  # fmt: skip
    params = sum(p.numel() for p in hf.parameters()) / 1e6
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    print(
        f"\nmodel {result.model_dir} ({params:.1f}M params), {len(workload)} requests"
        f"{describe_requests(kinds, workload, outputs)}, {prompt_tokens} prompt tokens, "
        f"{result.num_output_tokens} output tokens, torch threads {torch.get_num_threads()}, "
        f"cpu count {os.cpu_count()}"
    )


def print_profile(profile: dict[str, float], timed: float) -> None:
    wall = sum(profile.values())
    print(
        f"\nwhere omniserve's time goes: the pass again, engine core in process, step timer on "
        f"({wall:.2f} s; timed run {timed:.2f} s)\n{'part':48s} {'s':>8s} {'%':>6s}"
    )
    for part, seconds in profile.items():
        print(f"{part:48s} {seconds:8.2f} {100 * seconds / wall:6.1f}")


def print_report(result: PassResult, args: argparse.Namespace) -> None:
    ours = result.num_output_tokens / result.seconds["omniserve"]
    print(f"\n{'system':30s} {'time s':>8s} {'out tok/s':>10s} {'omniserve x':>12s}")
    for name, elapsed in result.seconds.items():
        rate = result.num_output_tokens / elapsed
        print(f"{name:30s} {elapsed:8.2f} {rate:10.1f} {ours / rate:12.2f}")
    for name, (hits, lookups) in sorted(result.cache_hits.items()):
        if name.startswith("prefix") and not args.enable_prefix_caching:
            continue
        if lookups or args.workload != "text":
            rate = f"{100 * hits / lookups:.1f}%" if lookups else "n/a"
            print(f"omniserve {name}: {hits}/{lookups} hits ({rate})")
    if result.ttft is not None:
        t = result.ttft
        print(
            f"TTFT, median of {args.ttft_repeats} (LLM.generate wall / engine arrival->first "
            f"token):\n  new item          {1e3 * t.first_wall:8.1f} ms / "
            f"{1e3 * t.first_engine:6.1f} ms\n  same item again   {1e3 * t.repeat_wall:8.1f} ms / "
            f"{1e3 * t.repeat_engine:6.1f} ms  ({t.first_wall / t.repeat_wall:.2f}x / "
            f"{t.first_engine / t.repeat_engine:.2f}x faster)"
        )
    if result.profile is not None:
        print_profile(result.profile, result.seconds["omniserve"])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="text", choices=["text", "mm", "omni", "omni-av"])
    parser.add_argument(
        "--arch", default=None,
        help=f"Default: {TEXT_ARCH} (text), both of {MM_ARCHS} (mm), {OMNI_ARCH} (omni*).",
    )  # fmt: skip
    parser.add_argument("--size", default="bench", choices=["tiny", "bench"])
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="Both systems' dtype; auto: the checkpoint's, resolved by omniserve.",
    )
    parser.add_argument("--model", default=None, help="A checkpoint dir instead of building one.")
    parser.add_argument(
        "--num-prompts", type=int, default=None, help="Default: 64 (omni), 32 (text, mm)."
    )
    parser.add_argument(
        "--input-len", type=int, nargs=2, default=None,
        help="Prompt tokens (text, default 16 256) or question words (mm, omni: default 8 64).",
    )  # fmt: skip
    parser.add_argument(
        "--output-len",
        type=int,
        nargs=2,
        default=None,
        help="Default: 32 32 (omni-av), 16 128 (the others).",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf-single", action="store_true")
    parser.add_argument(
        "--mm-pool-size", type=int, default=8,
        help="Distinct items per media kind (mm, omni); requests beyond repeat them.",
    )  # fmt: skip
    parser.add_argument("--ttft-repeats", type=int, default=3)
    parser.add_argument(
        "--enable-prefix-caching", action="store_true", help="Off by default: HF has none."
    )
    args = parser.parse_args(argv)
    if args.num_prompts is None:
        args.num_prompts = {"omni": 64, "omni-av": 24}.get(args.workload, 32)
    if args.output_len is None:
        args.output_len = (32, 32) if args.workload == "omni-av" else (16, 128)
    return args


def main(argv: Sequence[str] | None = None) -> list[PassResult]:
    args = parse_args(argv)
    if args.model:
        model_dirs = [args.model]
    else:
        defaults = {"text": (TEXT_ARCH,), "mm": MM_ARCHS, "omni": (OMNI_ARCH,),
                    "omni-av": (OMNI_ARCH,)}  # fmt: skip
        archs = [args.arch] if args.arch else defaults[args.workload]
        model_dirs = [str(build_tiny_checkpoint(arch, size=args.size)) for arch in archs]
    return [run_pass(args, model_dir) for model_dir in model_dirs]


if __name__ == "__main__":
    main()
