"""vLLM's sleep mode, ``collective_rpc``, ``reload_weights`` and ``--worker-extension-cls``.

On the tiny fp32 Qwen2, greedy: an engine woken from sleep (level 1: the KV cache released;
level 2: the weights too, read again on waking) answers exactly as before; requests are refused
while it sleeps; reloaded weights answer as an engine started on them, the prefix cache not
reused; the released memory really leaves the process (in process, a wider model); worker
methods and an extension's run by name on every worker, with a timeout; bad calls fail naming
what is wrong, and the engine serves on. The server's dev routes do the same over HTTP.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from omniserve import LLM, SamplingParams
from omniserve.config import ParallelConfig
from omniserve.engine.exceptions import EngineSleepingError
from omniserve.worker.worker import Worker, worker_class
from tests.hf_reference import make_prompts
from tests.server_utils import MODEL, assert_error, launch_server

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
WIDE = {"hidden_size": 512, "intermediate_size": 2048, "num_attention_heads": 8,
        "num_key_value_heads": 2, "num_hidden_layers": 4}  # fmt: skip
"""A wider Qwen2 (about 70 MB of fp32 weights)."""


class Probe:
    """A worker extension (``--worker-extension-cls tests.test_sleep_mode.Probe``)."""

    def probe(self, tensor: torch.Tensor, scale: float = 1.0) -> dict[str, Any]:
        worker: Any = self
        return {"rank": worker.rank, "sum": float(tensor.sum()) * scale}

    def model_dtype(self) -> torch.dtype:
        worker: Any = self
        return worker.dtype

    def nap(self, seconds: float) -> str:
        time.sleep(seconds)
        return "rested"


class Clashing:
    def sleep(self, level: int) -> None: ...


@pytest.fixture(scope="module")
def qwen2(tiny_checkpoint: Any) -> str:
    return str(tiny_checkpoint("Qwen2ForCausalLM"))


def _answers(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_sleep_and_wake_answer_as_before(qwen2: str, tiny_checkpoint: Any) -> None:
    other = str(tiny_checkpoint("Qwen2ForCausalLM", seed=1))
    wide_checkpoint = str(tiny_checkpoint("Qwen2ForCausalLM", overrides=WIDE))
    prompts = make_prompts(qwen2, [7, 12])
    reference = LLM(other, dtype="float32", max_model_len=128)
    try:
        other_answers = _answers(reference, prompts)
    finally:
        reference.shutdown()
    llm = LLM(qwen2, dtype="float32", max_model_len=128, enable_sleep_mode=True,
              worker_extension_cls="tests.test_sleep_mode.Probe",
              worker_cls="tests.test_sleep_mode.OwnWorker")  # fmt: skip
    try:
        assert llm.collective_rpc("own") == [0]  # --worker-cls's method
        before = _answers(llm, prompts)
        for level, tags in ((1, None), (2, None), (2, ["weights"])):
            llm.sleep(level)
            assert llm.llm_engine.is_sleeping()
            with pytest.raises(EngineSleepingError, match="wake_up"):
                llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, use_tqdm=False)
            if tags == ["weights"]:
                with pytest.raises(ValueError, match="needs the weights awake first"):
                    llm.wake_up(["kv_cache"])
                llm.wake_up(tags)
                assert llm.llm_engine.is_sleeping()  # its KV cache still sleeps
            llm.wake_up(None if tags is None else ["kv_cache"])
            assert not llm.llm_engine.is_sleeping()
            assert _answers(llm, prompts) == before, (level, tags)
        # Weights read from another checkpoint: its answers, although the prompts' blocks were
        # cached from the old weights.
        assert llm.collective_rpc("reload_weights", kwargs={"weights_path": other}) == [None]
        assert _answers(llm, prompts) == other_answers
        llm.collective_rpc("reload_weights", kwargs={"weights_path": qwen2})
        assert _answers(llm, prompts) == before
        for path, message in ((str(Path(qwen2).parent), "No model.safetensors"),
                              (wide_checkpoint, "is no checkpoint of this model")):  # fmt: skip
            with pytest.raises(ValueError, match=message):
                llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        assert _answers(llm, prompts) == before  # (nothing was dropped)
        llm.sleep(2)
        llm.collective_rpc("reload_weights")  # reads the weights (and the KV cache) again
        assert not llm.llm_engine.is_sleeping()
        assert _answers(llm, prompts) == before
        # Worker methods and the extension's, by name, tensors as arguments.
        (result,) = llm.collective_rpc("probe", args=(torch.ones(3),), kwargs={"scale": 2.0})
        assert result == {"rank": 0, "sum": 6.0}
        with pytest.raises(ValueError, match="A timeout needs the engine core in a process"):
            llm.collective_rpc("nap", timeout=0.2, args=(0.0,))
        for method, message in (("nowhere", "no method 'nowhere'"),
                                ("_load_model", "no method '_load_model'"),
                                ("sleep", "the engine core calls sleep itself")):  # fmt: skip
            with pytest.raises(ValueError, match=message):
                llm.collective_rpc(method)
        for call, message in (
            (lambda: llm.sleep(3), "sleep level must be 1 or 2"),
            (lambda: llm.wake_up(["everything"]), "wake_up tags are 'weights' and 'kv_cache'"),
        ):
            with pytest.raises(ValueError, match=message):
                call()
        assert _answers(llm, prompts) == before
    finally:
        llm.shutdown()


def test_collective_rpc_across_processes(qwen2: str, monkeypatch: Any) -> None:
    """The engine core in its own process: the extension travels by name, results as msgpack;
    a call past its timeout raises while the engine finishes it."""
    monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "1")
    llm = LLM(qwen2, dtype="float32", max_model_len=64,
              worker_extension_cls="tests.test_sleep_mode.Probe")  # fmt: skip
    try:
        (result,) = llm.collective_rpc("probe", args=(torch.ones(2),))
        assert result == {"rank": 0, "sum": 2.0}
        with pytest.raises(TimeoutError, match="did not finish within 0.2 s"):
            llm.collective_rpc("nap", timeout=0.2, args=(1.0,))
        assert llm.collective_rpc("nap", args=(0.0,)) == ["rested"]  # (after the first one)
        with pytest.raises(RuntimeError, match="Engine utility call failed: .*dtype"):
            llm.collective_rpc("model_dtype")  # (msgpack carries no torch.dtype)
        assert llm.collective_rpc("probe", args=(torch.ones(1),))[0]["sum"] == 1.0
    finally:
        llm.shutdown()


def test_tensor_parallel_workers_sleep_and_reload(qwen2: str) -> None:
    """Two tensor-parallel ranks (processes): each releases and re-reads its shards."""
    prompts = make_prompts(qwen2, [7, 12])
    llm = LLM(qwen2, dtype="float32", max_model_len=64, enable_sleep_mode=True,
              tensor_parallel_size=2,
              worker_extension_cls="tests.test_sleep_mode.Probe")  # fmt: skip
    try:
        before = _answers(llm, prompts)
        llm.sleep(2)
        llm.wake_up()
        assert _answers(llm, prompts) == before
        assert llm.collective_rpc("reload_weights") == [None, None]
        assert _answers(llm, prompts) == before
        results = llm.collective_rpc("probe", args=(torch.ones(2),))
        assert [r["rank"] for r in results] == [0, 1]
    finally:
        llm.shutdown()


def test_sleep_needs_the_mode_and_an_idle_engine(qwen2: str) -> None:
    llm = LLM(qwen2, dtype="float32", max_model_len=64)
    try:
        with pytest.raises(ValueError, match="needs the engine started with enable_sleep_mode"):
            llm.sleep()
    finally:
        llm.shutdown()
    llm = LLM(qwen2, dtype="float32", max_model_len=64, enable_sleep_mode=True)
    try:
        llm.llm_engine.add_request("r", {"prompt_token_ids": [1, 2, 3]}, GREEDY)
        with pytest.raises(ValueError, match="requests are unfinished"):
            llm.sleep()
        llm.llm_engine.abort_request(["r"])
        llm.sleep(1)
        llm.wake_up()
    finally:
        llm.shutdown()


def test_released_memory_leaves_the_process(tiny_checkpoint: Any, monkeypatch: Any) -> None:
    """In process (the RSS measured is the engine's), on a wider model (about 70 MB of fp32
    weights): level 2 gives the weights back to the OS, waking takes them again."""
    monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
    wide = str(tiny_checkpoint("Qwen2ForCausalLM", overrides=WIDE))
    llm = LLM(wide, dtype="float32", max_model_len=64, enable_sleep_mode=True,
              kv_cache_memory="16MiB")  # fmt: skip
    try:
        worker = llm.llm_engine.engine_core.engine_core.model_executor.worker
        before = _answers(llm, [[1, 2, 3, 4]])
        weights = worker.weight_bytes
        process = psutil.Process()
        awake = process.memory_info().rss
        llm.sleep(1)
        assert worker.model_runner.kv_caches == [] and worker.sleeping == {"kv_cache"}
        llm.wake_up()
        llm.sleep(2)
        assert not hasattr(worker, "model_runner") and worker.sleeping == {"kv_cache", "weights"}
        llm.sleep(1)  # (nothing more to release)
        with pytest.raises(ValueError, match="The model sleeps"):
            llm.llm_engine.engine_core.call_utility("get_model_info")
        asleep = process.memory_info().rss
        assert awake - asleep > 0.8 * weights, (awake, asleep, weights)
        llm.wake_up()
        assert process.memory_info().rss - asleep > 0.8 * weights
        assert _answers(llm, [[1, 2, 3, 4]]) == before
    finally:
        llm.shutdown()


class OwnWorker(Worker):
    """A --worker-cls: the engine's worker with a method of its own."""

    def own(self) -> int:
        return self.rank


def test_worker_classes() -> None:
    """--worker-extension-cls adds methods to the Worker, or to --worker-cls's subclass of it
    (vLLM's own worker class names mean this engine's)."""

    def parallel(**kwargs: str) -> ParallelConfig:
        return ParallelConfig(**kwargs)

    assert worker_class(parallel()) is Worker
    assert worker_class(parallel(worker_cls="vllm.v1.worker.gpu_worker.Worker")) is Worker
    combined = worker_class(parallel(worker_extension_cls="tests.test_sleep_mode:Probe"))
    assert issubclass(combined, Worker) and hasattr(combined, "probe")
    own = parallel(worker_cls="tests.test_sleep_mode.OwnWorker",
                   worker_extension_cls="tests.test_sleep_mode:Probe")  # fmt: skip
    assert issubclass(worker_class(own), OwnWorker) and hasattr(worker_class(own), "probe")
    for kwargs, message in (
        ({"worker_extension_cls": "tests.test_sleep_mode.Clashing"},
         "sleep would replace the worker's own"),
        ({"worker_extension_cls": "tests.nowhere.Probe"}, "cannot import 'tests.nowhere'"),
        ({"worker_cls": "tests.test_sleep_mode.Probe"},
         "Probe is not a subclass of omniserve.worker.worker.Worker"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            worker_class(parallel(**kwargs))


def test_server_dev_routes(qwen2: str, tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0.0}
    with launch_server(
        Path(qwen2), tmp_path, "--dtype", "float32", "--enable-sleep-mode"
    ) as server:
        want = server.post("/v1/completions", body).json()["choices"][0]["text"]
        assert server.post("/sleep?level=2").status_code == 200
        assert server.get("/is_sleeping").json() == {"is_sleeping": True}
        error = assert_error(server.post("/v1/completions", body), 503)
        assert error["code"] == "engine_sleeping"
        assert server.post("/wake_up?tags=weights").status_code == 200
        assert server.get("/is_sleeping").json() == {"is_sleeping": True}
        assert server.post("/wake_up?tags=kv_cache").status_code == 200
        assert server.get("/is_sleeping").json() == {"is_sleeping": False}
        assert server.post("/v1/completions", body).json()["choices"][0]["text"] == want
        rpc = server.post("/collective_rpc", {"method": "reload_weights"})
        assert rpc.status_code == 200 and rpc.json() == {"results": [None]}
        assert "level must be 1 or 2" in assert_error(server.post("/sleep?level=5"), 400)["message"]
        error = assert_error(server.post("/collective_rpc", {"method": "nowhere"}), 400)
        assert "no method 'nowhere'" in error["message"]
        assert server.post("/v1/completions", body).json()["choices"][0]["text"] == want


def test_a_speaking_model_sleeps_and_speaks_alike(tiny_checkpoint: Any) -> None:
    """A full omni checkpoint: the talker's KV cache and weights go to sleep with the
    thinker's, and the woken model speaks the same words and audio."""
    model_dir = str(tiny_checkpoint("Qwen3OmniMoeForConditionalGeneration"))
    speech = {"voice": "ethan", "temperature": 0.0, "max_tokens": 20}
    params = SamplingParams(temperature=0.0, max_tokens=6, output_modalities=["text", "audio"],
                            speech=speech)  # fmt: skip
    llm = LLM(model_dir, dtype="float32", max_model_len=512, kv_cache_memory=32 << 20,
              enable_sleep_mode=True)  # fmt: skip
    try:
        template = llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": "Say hello."}], add_generation_prompt=True, tokenize=False
        )
        prompt = {"prompt": template}
        before = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert before.audio is not None and before.audio.size
        for level in (1, 2):
            llm.sleep(level)
            llm.wake_up()
            after = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
            assert after.token_ids == before.token_ids
            assert after.audio is not None
            torch.testing.assert_close(torch.from_numpy(after.audio),
                                       torch.from_numpy(before.audio))  # fmt: skip
    finally:
        llm.shutdown()
