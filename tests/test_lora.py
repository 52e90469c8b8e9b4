"""LoRA adapters against PEFT on transformers (the same adapter files, fp32, greedy): several
adapters and the base model in one batch, one slot shared by turns, tensor parallelism, a
vision-language model; bad adapters get a precise error and leave the engine serving; the
server's ``--lora-modules``, ``model`` routing, ``/v1/models`` and runtime loading."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

from omniserve import LLM, SamplingParams
from omniserve.checkpoint_builder.lora import build_random_adapter
from omniserve.lora.adapter import read_adapter
from omniserve.lora.request import LoRARequest, adapter_fits, lora_stats, parse_lora_modules
from omniserve.metrics import PrometheusStatLogger
from tests.hf_reference import assert_matches_reference, hf_greedy, make_prompts
from tests.server_utils import assert_error, launch_server
from tests.test_fidelity_mm import VL_CASES, _engine_prompt, _hf_reference
from tests.utils import make_requests, make_runner_output, make_scheduler, run_to_completion

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3)
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class WithAdapter:
    """A transformers class whose ``from_pretrained`` returns the model with a PEFT adapter."""

    def __init__(self, model_cls: Any, adapter: Path) -> None:
        self.model_cls, self.adapter = model_cls, adapter

    def from_pretrained(self, model_dir: str, dtype: torch.dtype) -> Any:
        base = self.model_cls.from_pretrained(model_dir, dtype=dtype)
        return PeftModel.from_pretrained(base, str(self.adapter))


def save_adapter(model_cls: Any, model_dir: str, path: Path, seed: int, **config: Any) -> Path:
    """A PEFT adapter with random (non-zero) A and B, as PEFT saves it."""
    torch.manual_seed(seed)
    base = model_cls.from_pretrained(model_dir, dtype=torch.float32)
    get_peft_model(base, LoraConfig(init_lora_weights=False, **config)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def text_case(tiny_checkpoint, tmp_path_factory):
    """A Qwen2 checkpoint, two adapters (all projections at rank 8; q/v/down at rank 4 with
    rsLoRA and a per-module alpha), and transformers' greedy outputs with each and without."""
    model_dir = str(tiny_checkpoint("Qwen2ForCausalLM"))
    root = tmp_path_factory.mktemp("lora")
    wide = save_adapter(AutoModelForCausalLM, model_dir, root / "wide", 1, r=8, lora_alpha=16,
                        target_modules=ALL_PROJECTIONS)  # fmt: skip
    narrow = save_adapter(AutoModelForCausalLM, model_dir, root / "narrow", 2, r=4, lora_alpha=8,
                          use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"],
                          alpha_pattern={"down_proj": 2})  # fmt: skip
    prompts = make_prompts(model_dir, [5, 19, 36])
    reference = {
        None: hf_greedy(model_dir, prompts, MAX_TOKENS),
        "wide": hf_greedy(model_dir, prompts, MAX_TOKENS, WithAdapter(AutoModelForCausalLM, wide)),
        "narrow": hf_greedy(
            model_dir, prompts, MAX_TOKENS, WithAdapter(AutoModelForCausalLM, narrow)
        ),
    }
    loras = {
        "wide": LoRARequest("wide", 1, str(wide)),
        "narrow": LoRARequest("narrow", 2, str(narrow)),
    }
    return model_dir, prompts, reference, loras, root


def _mixed(text_case: Any) -> tuple[list[dict], list[LoRARequest | None], list]:
    """Every prompt with each adapter and with none, interleaved in one batch."""
    _, prompts, reference, loras, _ = text_case
    engine_prompts, requests, expected = [], [], []
    for i, prompt in enumerate(prompts):
        for name in ("wide", None, "narrow"):
            engine_prompts.append({"prompt_token_ids": prompt})
            requests.append(loras[name] if name else None)
            expected.append(reference[name][i])
    return engine_prompts, requests, expected


@pytest.mark.slow
def test_adapters_and_base_in_one_batch_match_peft(text_case):
    model_dir = text_case[0]
    prompts, requests, expected = _mixed(text_case)
    assert expected[0].token_ids != expected[1].token_ids  # the adapters change the output
    llm = LLM(model_dir, dtype="float32", enable_lora=True, max_loras=2)
    info = llm.llm_engine.engine_core.call_utility("get_model_info")
    assert info["lora_layers"] == {"C kernel up to 32 rows": 8, "torch": 0}  # 2 layers x 4
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests)
    assert_matches_reference(outputs, expected)
    # Again: prefix-cache hits, each only within its own adapter (the id is in the hashes).
    again = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests)
    assert sum(o.num_cached_tokens for o in again) > 0
    assert_matches_reference(again, expected)
    assert llm.list_loras() == {1, 2}


@pytest.mark.slow
def test_one_slot_takes_adapters_in_turn(text_case):
    """max_loras=1: the scheduler runs one adapter's requests at a time (with base requests
    beside them), and the slot is refilled; max_cpu_loras=1 reads an adapter again. With async
    scheduling (each step launched before the last is read back) and chunked prefill."""
    model_dir = text_case[0]
    prompts, requests, expected = _mixed(text_case)
    llm = LLM(model_dir, dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1,
              max_num_batched_tokens=32, async_scheduling=True)  # fmt: skip
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests)
    assert_matches_reference(outputs, expected)


@pytest.mark.slow
def test_tensor_parallel_adapters_match_peft(text_case):
    model_dir = text_case[0]
    prompts, requests, expected = _mixed(text_case)
    llm = LLM(model_dir, dtype="float32", enable_lora=True, max_loras=2, tensor_parallel_size=2)
    try:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests)
    finally:
        llm.shutdown()
    assert_matches_reference(outputs, expected)


@pytest.mark.slow
def test_vision_language_adapter_matches_peft(tiny_checkpoint, tmp_path):
    """Qwen2-VL: the adapter's names are transformers' (model.language_model.layers...)."""
    model_dir = str(tiny_checkpoint("Qwen2VLForConditionalGeneration"))
    targets = r".*language_model.*\.(q_proj|up_proj|o_proj)"
    adapter = save_adapter(AutoModelForImageTextToText, model_dir, tmp_path / "vl", 3, r=8,
                           lora_alpha=16, target_modules=targets)  # fmt: skip
    cases = VL_CASES[:2]
    processor = AutoProcessor.from_pretrained(model_dir)
    texts = [processor.apply_chat_template(c.messages, add_generation_prompt=True, tokenize=False)
             for c in cases]  # fmt: skip
    expected = _hf_reference(
        WithAdapter(AutoModelForImageTextToText, adapter), model_dir, texts, cases
    )
    llm = LLM(model_dir, dtype="float32", enable_lora=True)
    outputs = llm.generate(
        [_engine_prompt(t, c.media) for t, c in zip(texts, cases, strict=True)],
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=3),
        use_tqdm=False,
        lora_request=LoRARequest("vl", 1, str(adapter)),
    )
    assert_matches_reference(outputs, expected)
    tower = save_adapter(AutoModelForImageTextToText, model_dir, tmp_path / "tower", 4, r=4,
                         target_modules=["qkv"])  # fmt: skip
    with pytest.raises(ValueError, match=r"adapts model\.visual\.blocks\.0\.attn\.qkv"):
        llm.add_lora(LoRARequest("tower", 2, str(tower)))


@pytest.mark.gpu
def test_adapters_on_gpu_match_peft(text_case):
    """On CUDA (eager decode: LoRA turns the graphs off), fp32 against PEFT's fp32 on the CPU."""
    prompts, requests, expected = _mixed(text_case)
    llm = LLM(text_case[0], dtype="float32", device="cuda", enable_lora=True, max_loras=2)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests)
    assert_matches_reference(outputs, expected, atol=1e-3)


def _broken(root: Path, source: Path, name: str, config: dict | None = None,
            tensors: dict | None = None) -> Path:  # fmt: skip
    path = root / name
    shutil.copytree(source, path)
    if config is not None:
        data = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**data, **config}))
    if tensors is not None:
        save_file(tensors, path / "adapter_model.safetensors")
    return path


@pytest.fixture(scope="module")
def random_adapter(tiny_checkpoint, tmp_path_factory) -> Path:
    """The benchmarks' random adapter of the tiny Qwen2 (rank 8, every projection)."""
    model_dir = tiny_checkpoint("Qwen2ForCausalLM")
    return build_random_adapter(model_dir, tmp_path_factory.mktemp("random") / "adapter", 8)


@pytest.mark.parametrize(
    ("config", "q_a", "message"),
    [
        ({"lora_alpha": "x"}, None, "adapter_config.json lora_alpha must be a finite number, "
         "got 'x'."),
        ({"lora_alpha": None}, None, "lora_alpha must be a finite number, got None"),
        ({"lora_alpha": [1]}, None, "lora_alpha must be a finite number, got [1]"),
        ({"lora_alpha": True}, None, "lora_alpha must be a finite number, got True"),
        ({"alpha_pattern": "x"}, None, "alpha_pattern must be an object (module pattern -> value)"),
        ({"alpha_pattern": {"q_proj": "x"}}, None, "alpha_pattern['q_proj'] must be a finite "
         "number, got 'x'."),
        ({"alpha_pattern": {"(": 2}}, None, "alpha_pattern key '(' is not a regular expression"),
        ({"rank_pattern": [8]}, None, "rank_pattern must be an object"),
        ({"rank_pattern": {"q_proj": 2.5}}, None, "rank_pattern['q_proj'] must be an integer >= 1"),
        ({"rank_pattern": {"q_proj": 4}}, None, "q_proj has rank 8, but adapter_config.json "
         "gives it r=4."),
        ({"r": "8"}, None, "adapter_config.json r must be an integer >= 1, got '8'"),
        ({"modules_to_save": ["lm_head"]}, None, "adapter_config.json modules_to_save=['lm_head'] "
         "is not supported (omniserve applies only low-rank deltas"),
        (None, lambda a: a[:0], f"adapter_model.safetensors tensor {Q_A} has rank 0."),
        (None, lambda a: a * float("nan"), f"tensor {Q_A} holds non-finite values (NaN/Inf)."),
        (None, lambda a: a * float("inf"), f"tensor {Q_A} holds non-finite values (NaN/Inf)."),
        (None, lambda a: a.to(torch.int8), f"{Q_A} is int8; LoRA weights must be floating point"),
    ],
    ids=["alpha-str", "alpha-null", "alpha-list", "alpha-bool", "alpha_pattern-str",
         "alpha_pattern-value", "alpha_pattern-regex", "rank_pattern-list", "rank_pattern-float",
         "rank_pattern-mismatch", "r-str", "modules_to_save", "rank0", "nan", "inf", "int8"],
)  # fmt: skip
def test_bad_adapter_files_are_refused_when_read(random_adapter, tmp_path, config, q_a, message):
    """Config values of the wrong type, tensors that would fail (or quietly change) requests
    later, and replaced modules: a ValueError naming the adapter, the file and the key."""
    tensors = None
    if q_a is not None:  # replaces layer 0's q_proj lora_A
        tensors = load_file(random_adapter / "adapter_model.safetensors")
        tensors[Q_A] = q_a(tensors[Q_A]).contiguous()
    path = _broken(tmp_path, random_adapter, "a", config, tensors)
    with pytest.raises(ValueError, match=rf"^LoRA adapter 'a': .*{re.escape(message)}"):
        read_adapter(LoRARequest("a", 1, str(path)), max_rank=8)


@pytest.mark.slow
def test_bad_adapters_are_refused_and_the_engine_serves_on(text_case, tiny_checkpoint):
    model_dir, prompts, reference, loras, root = text_case
    wide, narrow = Path(loras["wide"].lora_path), Path(loras["narrow"].lora_path)
    weights = load_file(narrow / "adapter_model.safetensors")  # rank 4
    key = Q_A
    head = {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
            "base_model.model.lm_head.lora_B.weight": torch.zeros(2048, 4)}  # fmt: skip
    other = tiny_checkpoint("Qwen2ForCausalLM", overrides={"hidden_size": 96})
    cases = {
        "missing": (root / "nowhere", "has no adapter_config.json"),
        "dora": (_broken(root, narrow, "dora", {"use_dora": True}), "use_dora=True"),
        "bias": (_broken(root, narrow, "bias", {"bias": "all"}), "bias='all'"),
        "saved": (
            _broken(
                root,
                narrow,
                "saved",
                tensors={**weights, "base_model.model.lm_head.weight": torch.zeros(4, 4)},
            ),
            "modules_to_save",
        ),  # fmt: skip
        "half": (
            _broken(root, narrow, "half", tensors={k: v for k, v in weights.items() if k != key}),
            "lacks its lora_A",
        ),
        "rank": (wide, "above --max-lora-rank 4"),
        "shape": (
            save_adapter(
                AutoModelForCausalLM, str(other), root / "shape", 4, r=4, target_modules=["q_proj"]
            ),  # fmt: skip
            "does not fit this model",
        ),
        "head": (_broken(root, narrow, "head", tensors={**weights, **head}), "adapts lm_head"),
        "nan": (
            _broken(root, narrow, "nan", tensors={**weights, key: weights[key] * float("nan")}),
            "holds non-finite values",
        ),
    }
    llm = LLM(model_dir, dtype="float32", enable_lora=True, max_lora_rank=4)
    prompt = {"prompt_token_ids": prompts[0]}
    for i, (name, (path, message)) in enumerate(cases.items(), start=1):
        with pytest.raises(ValueError, match=message):
            llm.generate(prompt, GREEDY, use_tqdm=False,
                         lora_request=LoRARequest(name, i, str(path)))  # fmt: skip
    assert llm.list_loras() == set()
    llm.add_lora(LoRARequest("narrow", 20, str(narrow)))
    with pytest.raises(ValueError, match="lora_int_id 20 is adapter .narrow."):
        llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 20, "/x"))
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("zero", 0, str(wide))
    outputs = llm.generate(prompt, GREEDY, use_tqdm=False)
    assert_matches_reference(outputs, reference[None][:1])
    plain = LLM(model_dir, dtype="float32")
    with pytest.raises(ValueError, match="--enable-lora"):
        plain.generate(prompt, GREEDY, use_tqdm=False, lora_request=loras["wide"])


def test_adapter_slots_per_step_and_module_flags():
    class Req:
        def __init__(self, lora: LoRARequest | None) -> None:
            self.lora_request = lora

    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    running = [Req(a), Req(None)]
    assert adapter_fits(Req(a), running, 1) and adapter_fits(Req(None), running, 1)
    assert not adapter_fits(Req(b), running, 1) and adapter_fits(Req(b), running, 2)
    assert parse_lora_modules(["x=/p", '{"name": "y", "path": "/q", "base_model_name": "m"}']) == [
        ("x", "/p", None),
        ("y", "/q", "m"),
    ]
    for bad in ("x", "=/p", '{"name": "y"}'):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules([bad])


@pytest.mark.slow
def test_server_routes_models_to_adapters_and_logs_requests(text_case, tmp_path, monkeypatch):
    model_dir, prompts, _, loras, root = text_case
    wide, narrow = loras["wide"].lora_path, loras["narrow"].lora_path
    offline = LLM(model_dir, dtype="float32", enable_lora=True, max_loras=2)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    expected = {
        name: offline.generate("Hello there", params, use_tqdm=False, lora_request=lora)[0]
        .outputs[0]
        .text
        for name, lora in (("tiny", None), ("wide", loras["wide"]), ("narrow", loras["narrow"]))
    }
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    with launch_server(Path(model_dir), tmp_path, "--dtype", "float32", "--enable-lora",
                       "--max-loras", "2", "--lora-modules", f"wide={wide}",
                       "--enable-log-requests", "--enable-log-outputs") as server:  # fmt: skip
        client = server.client()
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"tiny", "wide"} and cards["wide"].parent == "tiny"
        assert cards["wide"].root == wide

        def complete(model: str) -> Any:
            return client.completions.create(model=model, prompt="Hello there",
                                             max_tokens=MAX_TOKENS, temperature=0.0)  # fmt: skip

        for model in ("tiny", "wide"):
            response = complete(model)
            assert response.model == model and response.choices[0].text == expected[model]
        assert_error(server.post("/v1/completions", {"model": "narrow", "prompt": "x"}), 404)
        loaded = server.post("/v1/load_lora_adapter", {"lora_name": "narrow", "lora_path": narrow})
        assert loaded.status_code == 200, loaded.text
        assert complete("narrow").choices[0].text == expected["narrow"]
        chat = client.chat.completions.create(
            model="narrow", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert chat.model == "narrow"
        again = server.post("/v1/load_lora_adapter", {"lora_name": "narrow", "lora_path": wide})
        assert "already been loaded" in assert_error(again, 400)["message"]
        bad = server.post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(root)})
        assert "adapter_config.json" in assert_error(bad, 400)["message"]
        alpha = _broken(root, Path(narrow), "alpha-str", {"lora_alpha": "x"})
        bad = server.post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(alpha)})
        error = assert_error(bad, 400)  # read in the engine core, raised here as a ValueError
        assert error["param"] == "lora_path"
        assert "lora_alpha must be a finite number, got 'x'" in error["message"]
        assert server.post("/v1/unload_lora_adapter", {"lora_name": "narrow"}).status_code == 200
        assert_error(server.post("/v1/completions", {"model": "narrow", "prompt": "x"}), 404)
        assert_error(server.post("/v1/unload_lora_adapter", {"lora_name": "narrow"}), 404)
        assert complete("wide").choices[0].text == expected["wide"]  # still serving
    log = server.log.read_text()  # --enable-log-requests names each request's adapter
    assert "lora_request: wide." in log and "lora_request: narrow." in log
    assert f"output: {expected['wide']!r}" in log


def test_scheduler_passes_over_a_request_whose_adapter_has_no_slot():
    """max_loras=1: a request for another adapter waits (in its place) while requests behind it
    run, with the running adapter or none; it runs once the slot is free."""
    scheduler = make_scheduler(max_loras=1)
    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    requests = make_requests(4, 8, max_tokens=2)
    for request, lora in zip(requests, (a, b, None, a), strict=True):
        request.lora_request = lora
        scheduler.add_request(request)
    first = scheduler.schedule()
    assert set(first.num_scheduled_tokens) == {"req-0", "req-2", "req-3"}
    assert [r.request_id for r in scheduler.waiting] == ["req-1"]
    assert {r.req_id: r.lora_request for r in first.scheduled_new_reqs}["req-3"] == a
    scheduler.update_from_output(first, make_runner_output(scheduler, first))
    tokens = run_to_completion(scheduler)  # finishes the first three, then runs req-1
    assert set(tokens) == {"req-0", "req-1", "req-2", "req-3"}
    with pytest.raises(ValueError, match="names a LoRA adapter; LoRA is off"):
        make_scheduler().add_request(requests[0])


def test_lora_requests_info_metric_names_the_adapters_in_use():
    class Req:
        def __init__(self, lora: LoRARequest | None) -> None:
            self.lora_request = lora

    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    stats = lora_stats([Req(a), Req(a), Req(None)], [Req(b)])
    assert stats == {"lora_running:a": 2.0, "lora_waiting:b": 1.0}
    metrics = PrometheusStatLogger("m", max_loras=2)
    metrics.record_scheduler_stats(stats)
    metrics.record_scheduler_stats({"lora_running:b": 1.0})  # replaces the label set

    def series() -> list[dict[str, str]]:
        families = text_string_to_metric_families(metrics.render()[0].decode())
        return [s.labels for f in families if f.name == "omniserve:lora_requests_info"
                for s in f.samples]  # fmt: skip

    assert series() == [{"model_name": "m", "engine": "0", "max_lora": "2",
                         "running_lora_adapters": "b", "waiting_lora_adapters": ""}]  # fmt: skip
    assert "lora_requests_info" not in PrometheusStatLogger("m").render()[0].decode()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_adds_the_product_as_torch_does(dtype):
    """csrc/lora.c against float64: rows 1 to MAX_ROWS, slot widths of one to three slices,
    output widths with a partial last block; more rows are left to torch."""
    from omniserve.cpu.lora import MAX_ROWS, CpuLoRA

    kernel = CpuLoRA(dtype)
    generator = torch.Generator().manual_seed(0)
    for rows, k, width, n in ((1, 64, 16, 100), (5, 1536, 48, 2048), (MAX_ROWS, 256, 32, 64)):
        x = torch.randn(rows, k, generator=generator).to(dtype)
        a = (torch.randn(width, k, generator=generator) / k**0.5).to(dtype)
        bt = (torch.randn(width, n, generator=generator) * 0.1).to(dtype)
        y = torch.randn(rows, n, generator=generator).to(dtype)
        assert CpuLoRA.supports(a, bt)
        expected = y.double() + (x.double() @ a.double().T) @ bt.double()
        assert kernel.add(x, a, kernel.pack(bt), y)
        # fp32: summation order only; bf16: y is rounded once (the shrink stays in fp32)
        tol = 1e-5 if dtype == torch.float32 else 2**-8 * expected.abs().max().item()
        torch.testing.assert_close(y.double(), expected, atol=tol, rtol=0)
    x, y = torch.zeros(MAX_ROWS + 1, k, dtype=dtype), torch.zeros(MAX_ROWS + 1, n, dtype=dtype)
    assert not kernel.add(x, a, kernel.pack(bt), y)  # a prefill's rows: torch's GEMMs


def test_default_mm_loras_pick_the_adapter_of_the_prompts_modality(tiny_checkpoint, tmp_path):
    """vLLM's ``default_mm_loras``: a prompt with an image and no adapter runs with the image
    adapter, exactly as when it names that adapter (id 1, named "image"); a text prompt and a
    video prompt run on the base model; a named adapter wins."""
    model_dir = str(tiny_checkpoint("Qwen2VLForConditionalGeneration"))
    adapter = str(build_random_adapter(model_dir, tmp_path / "image", 4))
    other = str(build_random_adapter(model_dir, tmp_path / "other", 4, seed=1))
    processor = AutoProcessor.from_pretrained(model_dir)
    image, _, video = VL_CASES[:3]
    prompts = [_engine_prompt(processor.apply_chat_template(c.messages, add_generation_prompt=True,
                                                            tokenize=False), c.media)
               for c in (image, video)] + ["Hello there"]  # fmt: skip

    def run(lora: LoRARequest, **settings: Any) -> tuple[list, Any]:
        """The prompts' outputs, and the first prompt's with ``lora`` named."""
        llm = LLM(model_dir, dtype="float32", enable_lora=True, **settings)
        try:
            return (
                llm.generate(prompts, GREEDY, use_tqdm=False),
                llm.generate(prompts[0], GREEDY, use_tqdm=False, lora_request=lora)[0],
            )
        finally:
            llm.shutdown()

    plain, named = run(LoRARequest("image", 1, adapter))
    got, mine = run(LoRARequest("other", 2, other), default_mm_loras={"image": adapter})

    def close(a: Any, b: Any) -> bool:  # (other batches: other GEMM shapes, 1e-7 apart)
        pairs = zip(a, b, strict=True)
        return all(x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4
                                                 for t in x) for x, y in pairs)  # fmt: skip

    sample = got[0].outputs[0]
    assert sample.token_ids == named.outputs[0].token_ids
    assert close(sample.logprobs, named.outputs[0].logprobs)
    assert not close(sample.logprobs, plain[0].outputs[0].logprobs)  # the adapter is at work
    for i in (1, 2):
        assert got[i].outputs[0].token_ids == plain[i].outputs[0].token_ids
        assert close(got[i].outputs[0].logprobs, plain[i].outputs[0].logprobs)
    assert not close(mine.outputs[0].logprobs, sample.logprobs)


def test_default_mm_lora_choice_and_settings(random_adapter, tiny_checkpoint, tmp_path):
    from omniserve.config.lora import LoRAConfig
    from omniserve.engine.arg_utils import EngineArgs
    from omniserve.lora.request import default_mm_lora_requests, with_default_mm_lora

    defaults = default_mm_lora_requests(LoRAConfig(default_mm_loras={"video": "/v", "audio": "/a"}))
    assert defaults == {
        "audio": LoRARequest("audio", 1, "/a"),
        "video": LoRARequest("video", 2, "/v"),
    }
    own = LoRARequest("mine", 9, "/m")
    assert with_default_mm_lora(own, ["audio"], defaults) is own
    assert with_default_mm_lora(None, ["audio", "image"], defaults) == defaults["audio"]
    assert with_default_mm_lora(None, ["audio", "video"], defaults) is None  # one adapter each
    assert with_default_mm_lora(None, ["image"], defaults) is None
    assert with_default_mm_lora(None, [], {}) is None
    model_dir, adapter = tiny_checkpoint("Qwen2ForCausalLM"), str(random_adapter)
    on = {"enable_lora": True}
    for settings, message in (
        ({"default_mm_loras": {"image": adapter}}, "--default-mm-loras needs --enable-lora"),
        ({**on, "default_mm_loras": {"picture": adapter}}, "'picture' is no modality"),
        ({**on, "default_mm_loras": {"image": str(tmp_path)}}, "adapter_config.json"),
        ({**on, "max_lora_rank": 2, "default_mm_loras": json.dumps({"image": adapter})}, "rank"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            EngineArgs(model_dir, **settings).create_config()


def test_server_serves_default_mm_loras_under_their_modality() -> None:
    """As vLLM's server: each default adapter is also a model named after its modality (so
    ``model: "audio"`` picks it and ``/v1/models`` lists it); loaded adapters take the next ids."""
    import asyncio
    from types import SimpleNamespace

    from omniserve.entrypoints.openai.serving_models import OpenAIServingModels

    added: list[LoRARequest] = []

    async def add_lora(lora: LoRARequest) -> None:
        added.append(lora)

    defaults = {"audio": LoRARequest("audio", 1, "/a")}
    engine = SimpleNamespace(default_mm_loras=defaults, model_config=SimpleNamespace(model="/m"),
                             add_lora=add_lora)  # fmt: skip
    models = OpenAIServingModels(engine, ["tiny"])  # type: ignore[arg-type]
    assert models.resolve("audio") == LoRARequest("audio", 1, "/a", "tiny")
    assert [card.id for card in models.cards(64, {})] == ["tiny", "audio"]
    asyncio.run(models.load("mine", "/p"))
    assert added == [LoRARequest("mine", 2, "/p", "tiny")]
