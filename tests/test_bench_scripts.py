"""The benchmark scripts run end to end on tiny checkpoints: counters checked, timings not."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
SYSTEMS = {"omniserve", "hf batched generate", "hf generate, one at a time"}


def _load_script(name: str) -> ModuleType:
    if str(SCRIPTS) not in sys.path:  # as when run: the scripts import their shared helpers
        sys.path.insert(0, str(SCRIPTS))
    if name not in sys.modules:  # registered first: dataclasses look their module up by name
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_mm_workload_mixes_sizes_and_repeats_each_item_equally():
    bench = _load_script("bench_throughput")
    for arch, kind in bench.MEDIA_KINDS.items():
        workload = bench.make_mm_workload(kind, 10, 0, 4, (3, 5), (2, 6))
        items = [prompt["multi_modal_data"][kind.modality] for prompt, _ in workload]
        uses = Counter(id(item) for item in items)
        assert sorted(uses.values()) == [2, 2, 3, 3], arch
        distinct = list({id(item): item for item in items}.values())
        if kind.modality == "image":
            sizes = sorted(image.width * image.height for image in distinct)
            assert sizes[0] == 56 * 56 and sizes[-1] >= 448 * 224
        else:
            seconds = sorted(len(wave) / rate for wave, rate in distinct)
            assert seconds == pytest.approx([1.0, 1 + 11 / 3, 1 + 22 / 3, 12.0], abs=1e-3)
            assert all(wave.dtype == np.float32 for wave, _ in distinct)
        assert all(2 <= n <= 6 for _, n in workload)
        assert all(kind.template.split("{question}")[0] in p["prompt"] for p, _ in workload)


def test_omni_workload_splits_kinds_evenly_with_a_pool_each():
    bench = _load_script("bench_throughput")
    workload = bench.make_mixed_workload(bench.OMNI_KINDS, 10, 0, 2, (3, 5), (2, 6))
    prompts = [prompt for prompt, _ in workload]
    images, audio, text = (kind.items(prompts) for kind in bench.OMNI_KINDS)
    assert (len(images), len(audio)) == (4, 3) and text == []
    assert sorted(Counter(map(id, images)).values()) == [2, 2]
    assert sorted(Counter(map(id, audio)).values()) == [1, 2]
    assert sum("multi_modal_data" not in p for p in prompts) == 3
    for prompt in prompts:  # each prompt holds its item's placeholder only; text-only none
        placeholders = [t for t in ("<|image_pad|>", "<|audio_pad|>") if t in prompt["prompt"]]
        assert placeholders == [f"<|{m}_pad|>" for m in prompt.get("multi_modal_data", {})]
    kinds = [next(iter(p.get("multi_modal_data", {"text": 0}))) for p in prompts]
    assert kinds != sorted(kinds)  # shuffled together, not in blocks


@pytest.mark.slow
def test_mm_benchmark_runs_on_tiny_checkpoints(capsys):
    bench = _load_script("bench_throughput")
    argv = ["--workload", "mm", "--size", "tiny", "--num-prompts", "4", "--mm-pool-size", "2"]
    results = bench.main([*argv, "--output-len", "2", "4", "--ttft-repeats", "1"])
    assert [Path(r.model_dir).name.split("-")[0] for r in results] == list(bench.MM_ARCHS)
    out = capsys.readouterr().out
    for result in results:
        assert set(result.seconds) == SYSTEMS and min(result.seconds.values()) > 0
        # Two items, each used twice: every second use hits both caches.
        assert result.cache_hits["processor cache (items)"] == (2, 4)
        assert result.cache_hits["encoder cache (items)"] == (2, 4)
        ttft = result.ttft
        assert ttft is not None and min(ttft.first_wall, ttft.repeat_wall) > 0
    assert out.count("omniserve processor cache (items): 2/4 hits (50.0%)") == 2
    assert out.count("same item again") == 2


@pytest.mark.slow
def test_text_benchmark_runs_on_a_tiny_checkpoint(capsys):
    bench = _load_script("bench_throughput")
    (result,) = bench.main(["--size", "tiny", "--num-prompts", "3", "--output-len", "2", "3"])
    assert Path(result.model_dir).name.startswith(bench.TEXT_ARCH)
    assert set(result.seconds) == SYSTEMS and result.ttft is None
    assert result.cache_hits["prefix cache (tokens)"] == (0, 0)  # off: HF has no prefix cache
    assert "processor cache" not in capsys.readouterr().out


@pytest.mark.slow
def test_omni_benchmark_runs_on_a_tiny_checkpoint_with_a_profile(capsys):
    bench = _load_script("bench_throughput")
    argv = ["--workload", "omni", "--size", "tiny", "--num-prompts", "4", "--mm-pool-size", "1"]
    (result,) = bench.main([*argv, "--output-len", "3", "4"])
    assert Path(result.model_dir).name.startswith(bench.OMNI_ARCH)
    assert set(result.seconds) == SYSTEMS and min(result.seconds.values()) > 0
    # Two image requests share one image; one audio request; one text-only request.
    assert result.cache_hits["processor cache (items)"] == (1, 3)
    assert result.cache_hits["encoder cache (items)"] == (1, 3)
    profile = result.profile
    assert profile is not None and result.ttft is None
    # Every part of the thinker's steps ran (prompts prefill, then 2-3 decode steps; the model
    # does not speak), and the rest is what they leave.
    assert list(profile) == [
        "encoders",
        "prefill steps: forward + logits",
        "decode steps: forward + logits",
        "sampler",
        bench.REST,
    ]
    assert min(profile.values()) > 0
    out = capsys.readouterr().out
    assert "2 image (" in out and "1 audio (" in out and "1 text-only" in out
    assert "where omniserve's time goes" in out and "decode steps" in out


@pytest.mark.slow
def test_realsize_benchmark_runs_each_engine_in_its_own_process(tiny_checkpoint, tmp_path):
    """The real-size benchmark's workers and report on a tiny omni thinker: every run counted,
    the media request timed, memory and the limits reported, variants' tokens compared and the
    step profile, the torch profiler's table and cProfile's read (timings are not checked)."""
    bench = _load_script("bench_realsize")
    model_dir = tiny_checkpoint("Qwen3OmniMoeThinkerForConditionalGeneration")
    workload = bench.make_workload(["b1", "prefill", "ttft_mm"], model_dir, tmp_path, "cpu")
    assert [run["name"] for run in workload["runs"]] == ["b1", "prefill", "ttft_mm_warmup",
                                                          "ttft_mm"]  # fmt: skip
    fresh = workload["runs"][-1]["fresh_media"]  # the profiled re-runs' unseen media
    assert len({m["image"] for m in fresh} | {workload["runs"][-1]["requests"][0]["image"]}) == 4
    workload["profile_steps"] = workload["torch_profile"] = True
    workload["runs"][0]["requests"][0]["max_tokens"] = 32  # (128 in the benchmark: time)
    # --sampling: every engine samples (seeded per request in omniserve, so variants agree).
    workload["sampling"] = {"temperature": 0.8, "top_p": 0.9, "top_k": 40,
                            "repetition_penalty": 1.1}  # fmt: skip
    workload_file = tmp_path / "workload.json"
    workload_file.write_text(json.dumps(workload))
    results = {}
    for engine in ("omniserve", "hf"):
        results[engine] = bench.run_engine(engine, model_dir, workload_file,
                                           tmp_path / f"{engine}.json", None, 600)  # fmt: skip
        runs = {run["name"]: run for run in results[engine]["runs"]}
        assert runs["b1"]["num_output_tokens"] == 32 and runs["b1"]["num_prompt_tokens"] == 128
        assert runs["prefill"]["num_output_tokens"] == 16
        assert runs["ttft_mm"]["num_output_tokens"] == 1
        assert runs["ttft_mm"]["num_prompt_tokens"] > 200  # 448 px image + 10 s clip
        assert results[engine]["peak_rss_bytes"] > 0
    workload["python_profile"] = True  # the variant's engine core runs in-process, under cProfile
    workload["profile_steps"] = workload["torch_profile"] = False  # (checked above already)
    variant_file = tmp_path / "variant.json"
    variant_file.write_text(json.dumps(workload))
    variant = bench.run_engine("omniserve:torch", model_dir, variant_file, tmp_path / "v.json",
                               None, 600, {"attention_backend": "torch"})  # fmt: skip
    assert set(variant["model_info"]["attention_backends"]) == {"torch"}
    assert "torch_backend.py" in variant["runs"][0]["python_profile"]  # the core, in-process
    results["omniserve:torch"] = variant
    assert "aten::" in results["omniserve"]["runs"][0]["torch_profile"]
    assert set(results["omniserve"]["model_info"]["attention_backends"]) == {"cpu"}
    costs = bench.model_costs(model_dir)
    assert costs["decode_bytes_per_step"] > 0 and costs["prefill_flops_per_token"] > 0
    lines = bench.report("tiny", results, costs, {"gemv_bytes_per_s": 1e10,
                                                  "gemm_flops_per_s": 1e11})  # fmt: skip
    table = "\n".join(lines)
    assert "| ttft_mm |" in table and "omniserve: float32, weights" in table  # as stored
    assert "x the bound" in table and "x the GEMM time" in table
    assert "omniserve:torch vs omniserve: the same tokens in" in table
    assert "of 19 requests" in table  # b1, 16 prefills, the media warm-up and the media request
    assert "omniserve b1 profile (1 prefill and 31 decode steps" in table
    # the first media request, profiled as it ran (its first uses are what it shows)
    assert "omniserve ttft_mm_warmup profile (1 prefill and 0 decode steps" in table
    assert "decode steps: forward + logits" in table and ", rest " in table


def test_sampler_benchmark_runs_every_case():
    bench = _load_script("bench_sampler")
    args = argparse.Namespace(batch=3, vocab=500, prompt_len=7, output_len=5, repeats=1,
                              device="cpu")  # fmt: skip
    results = bench.run(args)
    assert [r["case"] for r in results] == list(bench.CASES)
    assert all(r["omniserve_ms"] > 0 and r["transformers_ms"] > 0 for r in results)


def test_structured_benchmark_runs_on_a_tiny_checkpoint(monkeypatch, capsys):
    bench = _load_script("bench_structured")
    monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "1")  # restored after; main sets 0
    monkeypatch.setattr(
        sys,
        "argv",
        ["bench_structured.py", "--num-prompts", "3", "--output-len", "4", "--fields", "5"],
    )
    bench.main()
    out = capsys.readouterr().out
    assert "constrained: 12 tokens" in out and "x free" in out
    assert "compile of a 5-field schema" in out


def test_embeddings_benchmark_runs_on_the_tiny_checkpoint(monkeypatch, capsys):
    bench = _load_script("bench_embeddings")
    monkeypatch.setattr(sys, "argv", ["bench_embeddings.py", "--model", "tiny", "--prompts", "5"])
    bench.main()
    out = capsys.readouterr().out
    assert "tiny, float32, 5 prompts of 64-128 tokens" in out
    cosine = float(out.rsplit("smallest cosine between the two engines' vectors: ", 1)[1])
    assert cosine > 0.9999  # the same fp32 vectors
    monkeypatch.setattr(sys, "argv", ["bench_embeddings.py", "--model", "tiny", "--prompts", "5",
                                      "--reranker"])  # fmt: skip
    bench.main()
    out = capsys.readouterr().out
    assert "5 prompts of 64-128 tokens (" in out and "reranker (2-way softmax)" in out
    assert float(out.rsplit("largest probability difference: ", 1)[1]) < 1e-4


def test_serving_ablation_runs_a_b_b_a_and_merges_each_level(monkeypatch):
    """Near-equal systems run twice, A B B A, so neither always meets the colder machine; each
    level's two runs become one (rates over the summed wall time, percentiles over all)."""
    bench = _load_script("bench_serving")
    order: list[str] = []

    def fake(spec, prompts, args, log_dir):
        order.append(spec.name)
        run = len(order)
        return [
            bench.LevelResult(spec.name, 1, 1.0 * run, [bench.RequestResult(0.1 * run, 1.0, [], 4)])
        ]

    monkeypatch.setattr(bench, "bench_system", fake)
    specs = [bench.ServerSpec(name, [], "bench", {}) for name in ("omniserve", "no-playground")]
    results = bench.bench_interleaved(specs, [], None, Path("."))
    assert order == ["omniserve", "no-playground", "no-playground", "omniserve"]
    (ours,), (theirs,) = results["omniserve"], results["no-playground"]
    assert ours.wall_time == 1.0 + 4.0 and len(ours.results) == 2
    assert theirs.wall_time == 2.0 + 3.0 and theirs.output_tokens_per_s == 8 / 5


def test_realsize_rounds_rotate_the_engines_and_keep_each_fastest_run():
    """``--rounds``: no engine always goes first; each workload's fastest run is reported, with
    every round's time; the fastest load, the highest peak RSS."""
    bench = _load_script("bench_realsize")
    assert bench.round_orders(["a", "b", "c"], 4) == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]  # fmt: skip

    def result(b1: float, b8: float, load: float, rss: int) -> dict:
        runs = [{"name": "b1", "elapsed_s": b1}, {"name": "b8", "elapsed_s": b8}]
        return {"runs": runs, "load_s": load, "ready_s": load + 1, "peak_rss_bytes": rss}

    merged = bench.merge_rounds([result(5.0, 9.0, 3.0, 10), result(6.0, 7.0, 2.0, 12)])
    assert [(r["name"], r["elapsed_s"], r["rounds_elapsed_s"]) for r in merged["runs"]] == [
        ("b1", 5.0, [5.0, 6.0]), ("b8", 7.0, [9.0, 7.0])]  # fmt: skip
    assert (merged["load_s"], merged["ready_s"], merged["peak_rss_bytes"]) == (2.0, 3.0, 12)
    assert merged["rounds"] == 2


def test_long_prompt_workload_fits_the_context(tiny_checkpoint, tmp_path):
    bench = _load_script("bench_realsize")
    model_dir = tiny_checkpoint("Qwen2ForCausalLM")
    (run,) = bench.make_workload(["b1_long"], model_dir, tmp_path, "cpu")["runs"]
    (request,) = run["requests"]
    assert len(request["prompt_token_ids"]) == bench.LONG_PROMPT_LEN
    assert bench.LONG_PROMPT_LEN + request["max_tokens"] <= bench.MAX_MODEL_LEN


def test_realsize_benchmark_runs_every_request_with_a_lora_adapter(tiny_checkpoint, tmp_path):
    """--lora-rank: a random adapter on every decoder projection, for omniserve and
    transformers through PEFT."""
    from omniserve.checkpoint_builder.lora import build_random_adapter
    from omniserve.lora.adapter import read_adapter
    from omniserve.lora.request import LoRARequest

    bench = _load_script("bench_realsize")
    model_dir = tiny_checkpoint("Qwen2ForCausalLM")
    adapter = build_random_adapter(model_dir, tmp_path / "adapter", rank=8)
    pairs = read_adapter(LoRARequest("bench", 1, str(adapter)), max_rank=8)
    assert len(pairs) == 7 * 2 and {p.rank for p in pairs.values()} == {8}  # 2 layers
    workload = bench.make_workload(["b1"], model_dir, tmp_path, "cpu")
    workload.update(lora_rank=8, lora_path=str(adapter))
    workload_file = tmp_path / "workload.json"
    workload_file.write_text(json.dumps(workload))
    for engine in ("omniserve", "hf"):
        result = bench.run_engine(engine, model_dir, workload_file, tmp_path / f"{engine}.json",
                                  None, 600)  # fmt: skip
        assert result["runs"][0]["num_output_tokens"] == 128
    assert "+ PEFT" in result["engine"]  # the adapter, through PEFT
    omni = json.loads((tmp_path / "omniserve.json").read_text())
    assert omni["model_info"]["lora_slot_bytes"] > 0


def test_spec_decode_benchmark_measures_drafts_of_known_quality(tiny_checkpoint):
    """fp32 (no rounding between the 1-row and the verifying steps): drafts all wrong keep none,
    drafts all right keep every one, and every omniserve run gives the plain run's tokens."""
    model_dir = tiny_checkpoint("Qwen3ForCausalLM")
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_spec_decode.py"), "--model",
         str(model_dir), "--batches", "1,2", "--new-tokens", "12", "--repeats", "1",
         "--dtype", "float32", "-k", "3"],
        capture_output=True, text=True, timeout=600, cwd=SCRIPTS.parent,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("| omniserve + drafts all wrong (cost) |") == 2
    for batch in (1, 2):
        table = out.split(f"## batch {batch}")[1].split("Derived bound")[0]
        rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()}
        assert "| 0% of " in rows["omniserve + drafts all wrong (cost)"]
        assert "| 100% of " in rows["omniserve + drafts all right (bound)"]
        assert all(line.endswith(f"| {batch}/{batch} |") for name, line in rows.items()
                   if name.startswith("omniserve +"))  # fmt: skip
    assert "| transformers + prompt lookup |" in out.split("## batch 2")[0]


def _linear_bench_rows(script: str, rows: list[str]) -> list[list[str]]:
    """A layer benchmark's lines on one small shape, one per row count."""
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / script), "--shapes", "64x96", "--rows", *rows,
         "--repeats", "1", "--flush-mb", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line.split() for line in result.stdout.splitlines() if "64x96" in line]
    assert [line[1] for line in lines] == rows
    return lines


def test_bench_amx_linear_runs():
    """The AMX kernel's benchmark: its ratios against oneDNN's packed and plain products."""
    from omniserve.cpu.linear_amx import AmxLinear

    if not AmxLinear.available():
        pytest.skip("the AMX kernel needs a CPU with AMX-BF16")
    lines = _linear_bench_rows("bench_amx_linear.py", ["1", "40"])
    assert all(line[-2].endswith("x") and line[-3].endswith("x") for line in lines)


def test_bench_cpu_linear_runs():
    """The bf16-weight kernel's benchmark: its ratios against fp32 and bf16 oneDNN."""
    from omniserve.cpu.linear import WidenedLinear

    if not WidenedLinear.available():
        pytest.skip("the bf16-weight kernel needs AVX-512")
    lines = _linear_bench_rows("bench_cpu_linear.py", ["1", "3"])
    assert all(line[-1].endswith("x") and line[-2].endswith("x") for line in lines)


@pytest.mark.slow
def test_bench_towers_runs():
    """The towers' benchmark on tiny checkpoints: a ratio and an output difference per tower."""
    arch = "Qwen2_5OmniThinkerForConditionalGeneration"
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_towers.py"), "--tiny", "--models", arch,
         "--repeats", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    timed = [line for line in result.stdout.splitlines() if "pairwise" in line]
    assert [line.split()[1] for line in timed] == ["vision:", "audio:"]
    assert all(float(line.rsplit(" ", 1)[1]) < 1e-2 for line in timed)  # the outputs agree


def test_bench_kv_cache_dtype_runs():
    """The fp8 KV cache's benchmark: a row per cache type, each with its ratio to bf16 and half
    of bf16's bytes per token for fp8."""
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_kv_cache_dtype.py"), "--shapes", "qwen2.5-omni-3b",
         "--contexts", "2x64", "--repeats", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split(" | ") for line in result.stdout.splitlines() if "qwen2.5" in line]
    assert [row[2] for row in rows] == ["bf16", "fp8_e4m3", "fp8_e5m2"]
    assert rows[0][5] == "1.00x" and all(row[5].endswith("x") for row in rows)
    assert [row[6].rstrip(" |") for row in rows] == ["36", "18", "18"]


@pytest.mark.slow
def test_bench_video_pruning_runs(tiny_checkpoint):
    """A row per rate and one for transformers, each with the video tokens it took (the rate's
    share dropped, none by transformers) and a ratio to rate 0."""
    model_dir = str(tiny_checkpoint("Qwen2VLForConditionalGeneration"))
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_video_pruning.py"), "--model-dir", model_dir,
         "--rates", "0,0.75", "--frames", "8", "--size", "112", "--decode", "3", "--rounds", "1"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    rows = [line.split(" | ") for line in lines if line.startswith("| ") and "engine" not in line]
    assert [row[0] for row in rows] == ["| omniserve rate 0", "| omniserve rate 0.75",
                                        "| transformers generate"]  # fmt: skip
    video = [int(row[1]) for row in rows]
    assert video[1] == video[0] // 4 and video[2] == video[0]
    assert rows[0][4] == "1.00x" and "vs transformers" in result.stdout


@pytest.mark.slow
def test_bench_partial_prefills_runs(tiny_checkpoint):
    """A row per setting with the short and long prompts' time to first token and the ratios
    to no caps (1.00x for no caps itself)."""
    model_dir = str(tiny_checkpoint("Qwen3ForCausalLM"))
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_partial_prefills.py"), "--model-dir", model_dir,
         "--long", "2x300", "--short", "3x16", "--max-model-len", "2048",
         "--max-num-batched-tokens", "128", "--settings", "no caps,2 seats 1 long"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split(" | ") for line in result.stdout.splitlines()
            if line.startswith("| ") and "setting" not in line]  # fmt: skip
    assert [row[0] for row in rows] == ["| no caps", "| 2 seats 1 long"]
    assert rows[0][3] == "1.00x" and rows[1][3].endswith("x")
