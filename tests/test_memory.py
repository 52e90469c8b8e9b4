"""Host memory: a real-vocabulary bf16 checkpoint loads and serves within 1.2 x its weight bytes
+ the KV budget + 1 GiB (the front end and the engine-core process together), a model that
cannot fit fails at start-up with what it needs, and the CPU KV budget follows the memory
available.

Memory is the processes' summed PSS: RSS with each shared page split among the processes that
map it. Summed RSS would count torch's libraries twice (both processes import torch; with the
pinned wheel that is ~0.5 GB of RSS each, whatever the model), which is memory the machine
holds once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from omniserve.worker import memory

KV_BYTES = 256 << 20

# A fresh interpreter (the suite's own process holds far more than one engine), with the engine
# core in its own process as served; PSS of both summed every 20 ms while loading and serving.
_SERVE = textwrap.dedent("""
    import json, sys, threading, psutil
    peak = 0
    def sample(stop):
        global peak
        me = psutil.Process()
        while not stop.wait(0.02):
            total = 0
            for proc in (me, *me.children(recursive=True)):
                try:
                    total += proc.memory_full_info().pss
                except psutil.Error:
                    pass
            peak = max(peak, total)
    stop = threading.Event()
    threading.Thread(target=sample, args=(stop,), daemon=True).start()
    from omniserve import LLM, SamplingParams
    llm = LLM(sys.argv[1], max_model_len=1024, kv_cache_memory=int(sys.argv[2]))
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1000 + 7 * i + j for j in range(300)]} for i in range(8)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 32 for o in outputs)
    info = llm.llm_engine.engine_core.call_utility("get_model_info")
    stop.set()
    print(json.dumps({"peak": peak, **info}))
""")


@pytest.fixture(scope="module")
def realvocab_checkpoint() -> str:
    """Qwen2.5's real vocabulary (151,936 rows, untied) on a small decoder: ~350 MB in bf16,
    built once into the cache dir."""
    from omniserve.checkpoint_builder import build_realsize_checkpoint

    overrides = {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
    }
    return str(build_realsize_checkpoint("qwen2.5-1.5b", overrides=overrides))


@pytest.mark.slow
def test_peak_rss_while_loading_and_serving(realvocab_checkpoint: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _SERVE, realvocab_checkpoint, str(KV_BYTES)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    info = json.loads(result.stdout.strip().splitlines()[-1])
    from omniserve.cpu.build import has_native_bf16

    # auto follows the bf16 checkpoint where the CPU multiplies bf16 natively, else fp32
    assert info["dtype"] == ("bfloat16" if has_native_bf16() else "float32")
    assert info["weight_bytes"] > 300e6 and info["kv_cache_bytes"] <= KV_BYTES
    bound = 1.2 * info["weight_bytes"] + info["kv_cache_bytes"] + (1 << 30)
    assert info["peak"] <= bound, (
        f"peak {info['peak'] / 2**30:.2f} GiB > {bound / 2**30:.2f} GiB "
        f"(weights {info['weight_bytes'] / 2**30:.2f} GiB)"
    )


def test_a_model_that_cannot_fit_names_its_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 3 << 30)
    with pytest.raises(MemoryError) as error:
        memory.check_model_fits(6 << 30, 1 << 30, "float32", 32768)
    message = str(error.value)
    for expected in (
        "6.00 GiB in float32",
        "one 32768-token sequence needs 1.00 GiB",
        "only 3.00 GiB is available",
        "--max-model-len",
        "--dtype bfloat16",
    ):
        assert expected in message, message
    memory.check_model_fits(1 << 30, 1 << 29, "bfloat16", 4096)  # 2.5 GiB of 3: fits


def test_cpu_kv_budget_is_a_share_of_what_is_available(monkeypatch) -> None:
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 9 << 30)
    assert memory.default_cpu_kv_budget(1) == 4 << 30  # half of (9 - 1) GiB
    assert memory.default_cpu_kv_budget(2) == 2 << 30  # split between tensor-parallel workers
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 512 << 20)
    assert memory.default_cpu_kv_budget(1) == 0


def test_gpu_kv_budget_from_a_profile() -> None:
    """80 GiB at 0.9: 72 GiB, less the profiled peak (weights + activations), what lives outside
    torch and the encoder cache at capacity."""
    total = 80 << 30
    assert memory.gpu_kv_budget(total, 0.9, 20 << 30, 1 << 30, 1 << 30) == int(total * 0.9) - (
        22 << 30
    )
    with pytest.raises(MemoryError) as error:
        memory.gpu_kv_budget(total, 0.5, 39 << 30, 1 << 30, 1 << 29)
    message = str(error.value)
    for expected in (
        "--gpu-memory-utilization 0.5 of 80.00 GiB is 40.00 GiB",
        "took 39.00 GiB",
        "1.00 GiB is held outside torch",
        "encoder cache needs 0.50 GiB",
        "--max-num-batched-tokens",
    ):
        assert expected in message, message


def test_profile_run_takes_the_largest_items_and_step(tiny_checkpoint) -> None:
    """The profile's inputs on an omni thinker: one worst-case item per modality allowed (not
    one where --limit-mm-per-prompt forbids it), each as many embeddings as the processor's
    bound, through the encoders, then a full step; on CPU (no peak to read), it must run."""
    from omniserve.engine.arg_utils import EngineArgs
    from omniserve.worker.worker import Worker

    model_dir = str(tiny_checkpoint("Qwen2_5OmniThinkerForConditionalGeneration"))
    config = EngineArgs(model=model_dir, dtype="float32", max_model_len=2048,
                        max_num_batched_tokens=512, kv_cache_memory=8 << 20,
                        limit_mm_per_prompt='{"video": 0}').create_config()  # fmt: skip
    worker = Worker(config)
    items = worker.largest_media_items()
    assert sorted(item.modality for item in items) == ["audio", "image"]
    for item in items:
        assert item.mm_position.length > 100  # worst case, not a thumbnail
    worker.model_runner.profile_run(items)


def test_profile_items_take_the_sizes_limit_mm_per_prompt_asks_for(tiny_checkpoint, caplog):
    """vLLM's object form of --limit-mm-per-prompt: a count and the sizes of the profile's item
    per modality; a size over the largest the processor takes is logged and not used."""
    from omniserve.engine.arg_utils import EngineArgs
    from omniserve.worker.worker import Worker

    model_dir = str(tiny_checkpoint("Qwen2_5OmniThinkerForConditionalGeneration"))
    limits = {"image": {"count": 2, "width": 56, "height": 8}, "audio": {"length": 16000},
              "video": {"count": 1, "num_frames": 2, "width": 10**6}}  # fmt: skip
    config = EngineArgs(model=model_dir, dtype="float32", max_model_len=2048,
                        max_num_batched_tokens=512, kv_cache_memory=8 << 20,
                        limit_mm_per_prompt=limits).create_config()  # fmt: skip
    mm = config.multimodal_config
    assert mm.limit_mm_per_prompt == {"image": 2, "video": 1}
    assert mm.mm_profile_sizes == {"image": {"width": 56, "height": 8},
                                   "audio": {"length": 16000},
                                   "video": {"num_frames": 2, "width": 10**6}}  # fmt: skip
    worker = Worker(config)
    largest = {item.modality: item.mm_position.length
               for item in Worker(EngineArgs(model=model_dir, dtype="float32",
                                             max_model_len=2048).create_config())
               .largest_media_items()}  # fmt: skip
    with caplog.at_level("WARNING"):
        items = {item.modality: item for item in worker.largest_media_items()}
    assert caplog.text.count("is over the largest the processor takes") == 1, caplog.text
    assert "video width 1000000 is over the largest the processor takes" in caplog.text
    assert items["image"].mm_position.length < largest["image"]
    assert items["audio"].mm_position.length < largest["audio"]
    assert items["video"].mm_position.length < largest["video"]
    worker.model_runner.profile_run(list(items.values()))
    skipped = EngineArgs(model=model_dir, dtype="float32", max_model_len=2048,
                         skip_mm_profiling=True).create_config()  # fmt: skip
    assert Worker(skipped).largest_media_items() == []  # vLLM's --skip-mm-profiling


@pytest.mark.gpu
def test_memory_profile_on_gpu(monkeypatch) -> None:
    """The real profile on a device: the KV cache is what --gpu-memory-utilization leaves after
    the profiled peak, and serving a large image afterwards (CUDA graphs captured) stays inside
    that share of the card."""
    import torch
    from PIL import Image
    from transformers import AutoProcessor

    from omniserve import LLM, SamplingParams
    from omniserve.checkpoint_builder import build_tiny_checkpoint

    monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")  # this process holds the engine
    model_dir = str(build_tiny_checkpoint("Qwen2_5OmniThinkerForConditionalGeneration"))
    utilization, total = 0.05, torch.cuda.mem_get_info()[1]
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", max_model_len=2048,
              gpu_memory_utilization=utilization)  # fmt: skip
    info = llm.llm_engine.engine_core.call_utility("get_model_info")
    assert 0 < info["kv_cache_bytes"] < utilization * total - info["weight_bytes"]
    assert info["cuda_graph_sizes"]
    tok = AutoProcessor.from_pretrained(model_dir).tokenizer
    image = f"{tok.vision_bos_token}{tok.image_token}{tok.vision_eos_token}"
    prompt = {
        "prompt": f"<|im_start|>user\n{image}What is it?<|im_end|>\n<|im_start|>assistant\n",
        "multi_modal_data": {"image": Image.new("RGB", (1024, 768), "red")},
    }
    torch.cuda.reset_peak_memory_stats()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([prompt] * 4, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)
    assert torch.cuda.max_memory_allocated() <= utilization * total
