"""Tensor parallelism over gloo (MultiprocExecutor): TP=2 gives the greedy tokens of TP=1 and of
transformers for a text model (with replicated KV heads), a vision-language model, the
Qwen3-Omni-MoE thinker with image + audio and 4-bit MoE experts; bad parallel settings fail with
a precise error; a killed worker ends the server cleanly and leaves no process behind.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import httpx
import numpy as np
import psutil
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForImageTextToText, AutoProcessor

from omniserve import LLM, SamplingParams
from omniserve.checkpoint_builder.quantized import build_quantized_checkpoint
from omniserve.config import ModelConfig, OmniConfig, ParallelConfig
from omniserve.engine.core import EngineCore
from omniserve.executor.abstract import Executor
from omniserve.executor.multiproc import MultiprocExecutor
from omniserve.layers.weight_utils import SafetensorsFile, copy_weight
from omniserve.sampling_params import StructuredOutputsParams
from tests.hf_reference import ReferenceOutput, assert_matches_reference, hf_greedy, make_prompts
from tests.server_utils import launch_server
from tests.test_fidelity_mm import (
    IMAGE,
    TEXT,
    VIDEO,
    Case,
    _engine_prompt,
    _hf_reference,
    _image,
    _user,
    _video,
)
from tests.test_fidelity_omni import THINKERS, _hf_inputs, _media, _text
from tests.test_fidelity_omni import _engine_prompt as _omni_engine_prompt

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3)


def _tokens(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _generate(model_dir: str, prompts: list, tp: int, **kwargs) -> list:
    llm = LLM(model_dir, dtype="float32", tensor_parallel_size=tp, **kwargs)
    try:
        return llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_text_model_tp2_matches_tp1_and_hf(tiny_checkpoint):
    # One KV head for two ranks: both ranks hold a replica of it.
    model_dir = str(tiny_checkpoint("Qwen3ForCausalLM", overrides={"num_key_value_heads": 1}))
    prompts = make_prompts(model_dir, [5, 23, 40])
    reference = hf_greedy(model_dir, prompts, MAX_TOKENS)
    engine_prompts = [{"prompt_token_ids": p} for p in prompts]
    tp1 = _generate(model_dir, engine_prompts, tp=1)
    # A small token budget: chunked prefill and mixed prefill/decode steps under TP too.
    tp2 = _generate(model_dir, engine_prompts, tp=2, max_num_batched_tokens=16)
    assert _tokens(tp2) == _tokens(tp1)
    # Async scheduling: each step is sent to the ranks before the last one's reply is read.
    ahead = _generate(model_dir, engine_prompts, tp=2, max_num_batched_tokens=16,
                      async_scheduling=True)  # fmt: skip
    assert _tokens(ahead) == _tokens(tp1)
    assert_matches_reference(tp2, reference)


@pytest.mark.slow
def test_calls_between_steps_in_flight_leave_their_replies(tiny_checkpoint, monkeypatch):
    """Async scheduling over two ranks, with a call to every rank while a step is in flight
    before each read-back: its collection keeps the step's reply for the step's own."""
    monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
    model_dir = str(tiny_checkpoint("Qwen3ForCausalLM"))
    prompts = [{"prompt_token_ids": p} for p in make_prompts(model_dir, [5, 23, 40])]
    tp1 = _generate(model_dir, prompts, tp=1)
    original = EngineCore._finish_oldest_step
    calls = []

    def finish(self: EngineCore) -> Any:
        calls.append(self.model_executor.model_info())  # sent after the steps in flight
        return original(self)

    monkeypatch.setattr(EngineCore, "_finish_oldest_step", finish)
    assert _tokens(_generate(model_dir, prompts, tp=2, async_scheduling=True)) == _tokens(tp1)
    assert len(calls) >= MAX_TOKENS  # one per step: a prefill and 7 decodes


@pytest.mark.slow
def test_async_grammars_and_penalties_over_two_ranks(tiny_checkpoint, monkeypatch):
    """Async scheduling over two ranks: a step with a grammar is launched on the ranks before
    the step before it is read back, and sampled after; penalties and bad words read the last
    token back on each rank. The tokens of one rank, synchronous."""
    monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
    launched = []
    original = MultiprocExecutor.launch_model
    monkeypatch.setattr(MultiprocExecutor, "launch_model",
                        lambda self, so: launched.append(so) or original(self, so))  # fmt: skip
    model_dir = str(tiny_checkpoint("Qwen3ForCausalLM"))
    prompts = [{"prompt_token_ids": p} for p in make_prompts(model_dir, [5, 23, 40])]
    base = SamplingParams(temperature=0.0, max_tokens=12)
    params = [
        base.clone(structured_outputs=StructuredOutputsParams(regex="[a-z]{3,9}-[0-9]{2,5}")),
        base.clone(repetition_penalty=1.3, frequency_penalty=0.5, ignore_eos=True),
        base.clone(bad_words_token_ids=[[7], [8, 9]], min_tokens=6, logprobs=1),
    ]
    tokens = []
    for tp, ahead in ((1, False), (2, True)):
        llm = LLM(model_dir, dtype="float32", tensor_parallel_size=tp, async_scheduling=ahead)
        try:
            tokens.append(_tokens(llm.generate(prompts, params, use_tqdm=False)))
        finally:
            llm.shutdown()
    assert tokens[1] == tokens[0]
    assert len(launched) >= 3


@pytest.mark.slow
@pytest.mark.parametrize(
    ("architecture", "voice"),
    [
        ("Qwen3OmniMoeForConditionalGeneration", "chelsie"),
        ("Qwen2_5OmniForConditionalGeneration", "Ethan"),
    ],
)
def test_speech_tp2_matches_tp1(tiny_checkpoint, architecture, voice):
    """The talker's layers split over two ranks (its one KV head replicated), the vocoder on
    each: the same text and the same waveform (to fp32 reduction order) as one rank."""
    model_dir = str(tiny_checkpoint(architecture))
    prompt = "<|im_start|>user\nHello there say<|im_end|>\n<|im_start|>assistant\n"
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        output_modalities=["text", "audio"],
        speech={"voice": voice, "temperature": 0.0, "max_tokens": 20, "seed": 1},
    )
    outputs = []
    for tp in (1, 2):
        llm = LLM(
            model_dir,
            dtype="float32",
            tensor_parallel_size=tp,
            max_model_len=1024,
            kv_cache_memory=16 << 20,
        )
        try:
            outputs.append(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0])
        finally:
            llm.shutdown()
    one, two = outputs
    assert two.token_ids == one.token_ids and two.num_audio_tokens == one.num_audio_tokens
    assert two.audio.shape == one.audio.shape and np.std(one.audio) > 1e-2
    np.testing.assert_allclose(two.audio, one.audio, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_vision_language_model_tp2_matches_hf(tiny_checkpoint):
    model_dir = str(tiny_checkpoint("Qwen2VLForConditionalGeneration"))
    processor = AutoProcessor.from_pretrained(model_dir)
    cases = [Case("image", [_user(IMAGE, TEXT)], {"image": [_image(1, 112, 140)]})]
    texts = [
        processor.apply_chat_template(c.messages, add_generation_prompt=True, tokenize=False)
        for c in cases
    ]
    reference = [
        ReferenceOutput(r.token_ids[:MAX_TOKENS], r.logprobs[:MAX_TOKENS])
        for r in _hf_reference(AutoModelForImageTextToText, model_dir, texts, cases)
    ]
    prompts = [_engine_prompt(t, c.media) for t, c in zip(texts, cases, strict=True)]
    outputs = _generate(model_dir, prompts, tp=2)
    assert sum(outputs[0].num_mm_tokens.values()) > 0
    assert_matches_reference(outputs, reference)


@pytest.mark.slow
def test_towers_split_their_items_between_ranks(tiny_checkpoint, monkeypatch):
    """--mm-encoder-tp-mode data: three images of different sizes and two pruned videos
    (--video-pruning-rate, split by their rows before pruning) split between two ranks
    (balanced by embeddings), each rank encoding its share, the outputs gathered: the answers
    of TP=1, which encodes them all itself."""
    from omniserve.worker import encoder_runner

    assert encoder_runner.balanced_owners([10, 40, 25, 5], 2) == [1, 0, 1, 1]
    assert encoder_runner.balanced_owners([7], 3) == [0]
    model_dir = str(tiny_checkpoint("Qwen2VLForConditionalGeneration"))
    processor = AutoProcessor.from_pretrained(model_dir)
    messages = [_user(IMAGE, IMAGE, IMAGE, VIDEO, VIDEO, TEXT)]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    media = {"image": [_image(1, 112, 140), _image(2, 56, 56), _image(3, 84, 112)],
             "video": [_video(4), _video(5, frames=6)]}  # fmt: skip
    prompts = [_engine_prompt(text, media)]
    want = _generate(model_dir, prompts, tp=1, video_pruning_rate=0.5)
    got = _generate(model_dir, prompts, tp=2, mm_encoder_tp_mode="data", video_pruning_rate=0.5)
    assert _tokens(got) == _tokens(want)
    for ours, ref in zip(got[0].outputs[0].logprobs, want[0].outputs[0].logprobs, strict=True):
        assert all(abs(ours[t].logprob - ref[t].logprob) < 1e-4 for t in ref)


@pytest.mark.slow
def test_omni_moe_thinker_tp2_with_image_and_audio_matches_hf(tiny_checkpoint):
    arch = "Qwen3OmniMoeThinkerForConditionalGeneration"
    model_dir = str(tiny_checkpoint(arch))
    processor = AutoProcessor.from_pretrained(model_dir)
    items, text = _media(["image", "audio"], seed=7), _text(processor, ["image", "audio"])
    model = THINKERS[arch].from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        inputs = _hf_inputs(processor, text, items)
        out = model.generate(
            **inputs,
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    generated = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    logprobs = [torch.log_softmax(s[0].float(), dim=-1) for s in out.logits]
    reference = [ReferenceOutput(generated, logprobs[: len(generated)])]
    outputs = _generate(model_dir, [_omni_engine_prompt(text, items)], tp=2)
    assert sum(outputs[0].num_mm_tokens.values()) > 0
    # ~700 prompt tokens through sharp random weights and an all-reduce per layer: fp32 sums in
    # a different order move logprobs by ~1e-4 (as batching does in test_fidelity_omni).
    assert_matches_reference(outputs, reference, atol=5e-4)


@pytest.mark.slow
def test_quantized_moe_experts_tp2_match_hf(tiny_checkpoint):
    """AWQ experts kept 4-bit over two ranks (each rank's half of every expert's width holds
    whole groups: 64 wide in groups of 32), against transformers on the dequantized twin."""
    model_dir = str(tiny_checkpoint("Qwen3MoeForCausalLM", overrides={"moe_intermediate_size": 64}))
    quantized, twin = build_quantized_checkpoint(model_dir, "awq", 32)
    prompts = make_prompts(model_dir, [5, 19])
    llm = LLM(str(quantized), dtype="float32", tensor_parallel_size=2)
    try:
        info = llm.llm_engine.engine_core.call_utility("get_model_info")
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert info["layer_kernels"]["MoE: C 4-bit, float32 activations"] == 2
    assert_matches_reference(outputs, hf_greedy(str(twin), prompts, MAX_TOKENS))


class ExpertProbe:
    """A worker extension: the experts of the worker's first MoE layer."""

    def held_experts(self) -> list[int]:
        from omniserve.layers.fused_moe import FusedMoE

        worker: Any = self
        model = worker.model_runner.model
        return next(m for m in model.modules() if isinstance(m, FusedMoE)).expert_ids


@pytest.mark.slow
def test_expert_parallel_moe_tp2_matches_hf(tiny_checkpoint):
    """--enable-expert-parallel: each rank holds half the experts whole (its 4 of 8, in blocks
    and, for the AWQ twin, every other one), skips the pairs routed to the other's, and the
    all-reduce adds the parts; against transformers."""
    model_dir = str(tiny_checkpoint("Qwen3MoeForCausalLM", overrides={"moe_intermediate_size": 64}))
    quantized, twin = build_quantized_checkpoint(model_dir, "awq", 32)
    prompts = make_prompts(model_dir, [5, 19])
    engine_prompts = [{"prompt_token_ids": p} for p in prompts]
    for path, reference, placement, held in (
        (model_dir, model_dir, "linear", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        (str(quantized), str(twin), "round_robin", [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ):
        llm = LLM(path, dtype="float32", tensor_parallel_size=2, enable_expert_parallel=True,
                  expert_placement_strategy=placement,
                  worker_extension_cls="tests.test_tensor_parallel.ExpertProbe")  # fmt: skip
        try:
            assert llm.collective_rpc("held_experts") == held
            outputs = llm.generate(engine_prompts, GREEDY, use_tqdm=False)
        finally:
            llm.shutdown()
        assert_matches_reference(outputs, hf_greedy(reference, prompts, MAX_TOKENS))


@pytest.mark.slow
def test_heads_that_do_not_divide_give_a_clear_error(tiny_checkpoint, monkeypatch):
    model_dir = str(tiny_checkpoint("Qwen3ForCausalLM"))  # 4 heads, 128 MLP features
    monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")  # the error in this process
    with pytest.raises(
        ValueError,
        match=r"\d+ \(.+\) is not divisible by the tensor-parallel "
        r"size 3; choose a --tensor-parallel-size",
    ):
        LLM(model_dir, dtype="float32", tensor_parallel_size=3)


def test_lazy_checkpoint_tensor_reads_slices(tmp_path):
    weight = torch.randn(6, 4)
    save_file({"w": weight, "b": weight.bfloat16()[0]}, str(tmp_path / "model.safetensors"))
    with SafetensorsFile(tmp_path / "model.safetensors") as f:
        lazy = f.tensor("w")
        assert lazy.shape == weight.shape and lazy.dtype == torch.float32
        assert torch.equal(lazy.narrow(0, 2, 3), weight[2:5])  # a column-parallel rank's rows
        assert torch.equal(lazy.narrow(-1, 2, 2), weight[:, 2:])  # a row-parallel rank's columns
        assert torch.equal(lazy.narrow(0, 0, 6), weight)
        assert torch.equal(lazy.materialize(), weight)
        rows, cols, cast = torch.empty(3, 4), torch.empty(6, 2), torch.empty(6, 4).bfloat16()
        copy_weight(rows, lazy, 0, 2)  # read in place
        copy_weight(cols, lazy, 1, 2)  # staged: not one byte range
        copy_weight(cast, lazy)  # staged: a dtype cast
        assert torch.equal(rows, weight[2:5]) and torch.equal(cols, weight[:, 2:])
        assert torch.equal(cast, weight.bfloat16())
        assert torch.equal(f.tensor("b").materialize(), weight.bfloat16()[0])
        # A single rank's "columns" are the whole tensor: read in place, never staged.
        whole = torch.empty(6, 4)
        lazy.narrow = lazy.materialize = None  # staging would call them
        copy_weight(whole, lazy, 1, 0)
        assert torch.equal(whole, weight)


def test_truncated_or_foreign_checkpoint_files_are_named(tmp_path):
    save_file({"w": torch.randn(64, 64)}, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "short.safetensors").write_bytes(data[:-100])
    with SafetensorsFile(tmp_path / "short.safetensors") as f:
        with pytest.raises(ValueError, match="short.safetensors is truncated"):
            f.tensor("w").materialize()
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match="junk.safetensors is not a valid safetensors file"):
        SafetensorsFile(tmp_path / "junk.safetensors")


def _config(model_dir: str, **parallel) -> OmniConfig:
    return OmniConfig(ModelConfig.from_path(model_dir), parallel_config=ParallelConfig(**parallel))


def test_executor_class_per_backend(tiny_checkpoint):
    from omniserve.executor.multiproc import MultiprocExecutor
    from omniserve.executor.uniproc import UniProcExecutor

    model_dir = str(tiny_checkpoint("Qwen3ForCausalLM"))
    assert Executor.get_class(_config(model_dir)) is UniProcExecutor
    assert Executor.get_class(_config(model_dir, tensor_parallel_size=2)) is MultiprocExecutor
    assert Executor.get_class(_config(model_dir, distributed_executor_backend="mp")) is (
        MultiprocExecutor
    )
    with pytest.raises(ValueError, match="needs the 'mp' or 'ray' backend"):
        Executor.get_class(
            _config(model_dir, tensor_parallel_size=2, distributed_executor_backend="uni")
        )
    with pytest.raises(ValueError, match="Pipeline parallelism"):
        Executor.get_class(_config(model_dir, pipeline_parallel_size=2))
    with pytest.raises(ValueError, match="must be 'uni', 'mp' or 'ray'"):
        ParallelConfig(distributed_executor_backend="slurm")


def _workers(server_pid: int) -> list[psutil.Process]:
    """The TP worker processes: spawned grandchildren of the server (under the engine core)."""
    server = psutil.Process(server_pid)
    return [
        p
        for engine in server.children()
        for p in engine.children()
        if "resource_tracker" not in " ".join(p.cmdline())
    ]


@pytest.mark.slow
def test_killed_worker_ends_the_engine_cleanly(tiny_checkpoint, tmp_path):
    model_dir = tiny_checkpoint("Qwen3ForCausalLM")
    with launch_server(model_dir, tmp_path, "-tp", "2", "--dtype", "float32") as server:
        client = server.client()
        assert client.completions.create(model="tiny", prompt="hello", max_tokens=4).choices
        tree = [
            psutil.Process(server.proc.pid),
            *psutil.Process(server.proc.pid).children(recursive=True),
        ]
        workers = _workers(server.proc.pid)
        assert len(workers) == 2
        workers[1].send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 60
        while httpx.get(server.url + "/health", timeout=5).status_code == 200:
            assert time.monotonic() < deadline, "the server stayed healthy without a worker"
            time.sleep(0.3)
        response = server.post(
            "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4}
        )
        assert response.status_code == 503, response.text
    gone, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, f"orphan processes: {alive}"
    log = server.log.read_text()
    assert "Tensor-parallel worker rank" in log and "killed by SIGKILL" in log, log[-3000:]
