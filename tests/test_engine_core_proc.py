"""EngineCoreProc and its clients: same tokens as in process, utilities, death, clean shutdown."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from omniserve.config import OmniConfig
from omniserve.engine.arg_utils import EngineArgs
from omniserve.engine.core_client import InprocClient
from omniserve.engine.exceptions import EngineDeadError, EngineStartupError
from omniserve.engine.mp_client import AsyncMPClient, SyncMPClient
from omniserve.entrypoints.llm import LLM
from omniserve.messages import EngineCoreOutputs, EngineCoreRequest, FinishReason
from omniserve.sampling_params import SamplingParams

ARCH = "Qwen3ForCausalLM"
PROMPTS = [[5, 17, 42, 8, 99, 3], list(range(10, 50)), [7] * 21, [300, 301]]


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint(ARCH)


def _config(model_dir: Path, **kwargs: object) -> OmniConfig:
    args = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
    args.update(kwargs)
    return EngineArgs(model=str(model_dir), **args).create_config()  # type: ignore[arg-type]


def _request(i: int, max_tokens: int = 6) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(
        f"req-{i}",
        PROMPTS[i % len(PROMPTS)],
        params,
        eos_token_id=None,
        arrival_time=time.time(),
        max_tokens=max_tokens,
    )


def _collect(
    get_output: Callable[[], EngineCoreOutputs | None],
    num_requests: int,
) -> dict[str, list[int]]:
    """Drive ``get_output`` until ``num_requests`` requests finished; their tokens by id."""
    tokens: dict[str, list[int]] = {}
    finished = 0
    for _ in range(1000):
        outputs = get_output()
        for output in outputs.outputs if outputs is not None else []:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            finished += output.finished
        if finished == num_requests:
            return tokens
    raise AssertionError("requests did not finish")


def _assert_gone(proc: multiprocessing.process.BaseProcess) -> None:
    assert not proc.is_alive()
    assert proc not in multiprocessing.active_children()


@pytest.mark.slow
def test_llm_through_engine_process_matches_in_process(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = ["Hello there", "The quick brown fox", "1 2 3 4"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, n=2, seed=1),
        SamplingParams(temperature=0.8, max_tokens=12, seed=7, ignore_eos=True),
    ]

    def run(multiprocessing_on: str) -> list[tuple[list[int], str, str | None]]:
        monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", multiprocessing_on)
        llm = LLM(str(model_dir), max_model_len=256, max_num_seqs=8)
        client = llm.llm_engine.engine_core
        assert isinstance(client, SyncMPClient if multiprocessing_on == "1" else InprocClient)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        if isinstance(client, SyncMPClient):
            proc = client.proc
            del llm, client
            gc.collect()  # no shutdown(): the client's finalizer must stop the engine
            _assert_gone(proc)
        else:
            llm.shutdown()
        return [(c.token_ids, c.text, c.finish_reason) for o in outputs for c in o.outputs]

    in_process = run("0")
    assert len(in_process) == 4 and all(len(ids) > 0 for ids, _, _ in in_process)
    assert run("1") == in_process


@pytest.mark.slow
def test_sync_mp_client_matches_inproc_and_shuts_down_cleanly(model_dir: Path) -> None:
    config = _config(model_dir)
    inproc = InprocClient(config)
    for i in range(len(PROMPTS)):
        inproc.add_request(_request(i))
    expected = _collect(inproc.get_output, len(PROMPTS))
    inproc.shutdown()

    client = SyncMPClient(config)
    try:
        assert client.is_alive() and client.num_kv_blocks > 0
        for i in range(len(PROMPTS)):
            client.add_request(_request(i))
        assert _collect(client.get_output, len(PROMPTS)) == expected

        stats = client.call_utility("get_stats")
        assert stats["num_kv_blocks"] == client.num_kv_blocks and stats["num_running"] == 0
        assert client.reset_prefix_cache() is True
        with pytest.raises(RuntimeError, match="not an engine core utility"):
            client.call_utility("shutdown")

        # An aborted request stops producing; the engine keeps serving the others.
        client.add_request(_request(0, max_tokens=200))
        client.add_request(_request(1))
        client.abort_requests(["req-0"])
        tokens = _collect(client.get_output, 1)  # req-0 may have run a step before the abort
        assert tokens["req-1"] == expected["req-1"] and len(tokens.get("req-0", [])) < 200
        assert client.call_utility("has_unfinished_requests") is False

        # A request the scheduler refuses (longer than max_model_len) ends at once as an error.
        too_long = _request(0)
        too_long.prompt_token_ids = [5] * 300
        client.add_request(too_long)
        [output] = client.get_output().outputs
        assert output.request_id == "req-0" and output.finish_reason is FinishReason.ERROR
        assert client.is_alive()
    finally:
        client.shutdown()
    _assert_gone(client.proc)
    assert client.proc.exitcode == 0  # stopped by the SHUTDOWN request, not a signal
    assert not Path(client.resources.tmpdir).exists()
    client.shutdown()  # idempotent
    with pytest.raises(EngineDeadError, match="shut down"):
        client.get_output()


@pytest.mark.slow
def test_engine_death_raises_engine_dead_error(model_dir: Path) -> None:
    client = SyncMPClient(_config(model_dir))
    try:
        errors: list[BaseException] = []
        waiter = threading.Thread(target=lambda: _record_error(client.get_output, errors))
        waiter.start()
        time.sleep(0.2)  # the waiter is now blocked in get_output
        killed_at = time.monotonic()
        os.kill(client.proc.pid, signal.SIGKILL)
        waiter.join(timeout=5)
        assert not waiter.is_alive(), "get_output still blocked after the engine died"
        assert time.monotonic() - killed_at < 3
        assert len(errors) == 1 and isinstance(errors[0], EngineDeadError)
        assert "died unexpectedly" in str(errors[0])
        assert not client.is_alive()
        with pytest.raises(EngineDeadError):
            client.get_output()
        with pytest.raises(EngineDeadError):
            client.add_request(_request(0))
        with pytest.raises(EngineDeadError):
            client.call_utility("get_stats")
        client.abort_requests(["req-0"])  # nothing left to abort: a no-op, not an error
    finally:
        client.shutdown()
    _assert_gone(client.proc)


def _record_error(call: Callable[[], object], errors: list[BaseException]) -> None:
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - the test inspects it
        errors.append(exc)


@pytest.mark.slow
def test_bad_model_dir_fails_clearly_at_startup(model_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    for weights in broken.glob("*.safetensors"):
        weights.unlink()
    before = set(multiprocessing.active_children())
    # A user mistake keeps its precise type; the child's traceback rides along as the cause.
    with pytest.raises(FileNotFoundError, match="model.safetensors") as info:
        SyncMPClient(_config(broken))
    cause = info.value.__cause__
    assert isinstance(cause, EngineStartupError) and "Traceback" in str(cause)
    assert set(multiprocessing.active_children()) == before


@pytest.mark.slow
def test_async_mp_client(model_dir: Path) -> None:
    config = _config(model_dir)
    expected_client = InprocClient(config)
    expected_client.add_request(_request(2))
    expected = _collect(expected_client.get_output, 1)
    expected_client.shutdown()

    client = AsyncMPClient(config)

    async def run() -> None:
        await client.add_request_async(_request(2))
        tokens: dict[str, list[int]] = {}
        while True:
            outputs = await asyncio.wait_for(client.get_output_async(), timeout=30)
            for output in outputs.outputs:
                tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if any(output.finished for output in outputs.outputs):
                break
        assert tokens == expected
        stats = await client.call_utility_async("get_stats")
        assert stats["num_kv_blocks"] == client.num_kv_blocks
        await client.abort_requests_async(["unknown"])  # ignored by the engine

        pending = asyncio.ensure_future(client.get_output_async())
        await asyncio.sleep(0.1)
        os.kill(client.proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(pending, timeout=3)
        with pytest.raises(EngineDeadError):
            await client.add_request_async(_request(0))
        with pytest.raises(EngineDeadError):
            await client.call_utility_async("get_stats")

    try:
        asyncio.run(run())
    finally:
        client.shutdown()
    _assert_gone(client.proc)


@pytest.mark.slow
def test_engine_exits_when_parent_is_killed(model_dir: Path) -> None:
    script = textwrap.dedent(f"""
        import os, signal
        from omniserve.engine.arg_utils import EngineArgs
        from omniserve.engine.mp_client import SyncMPClient
        config = EngineArgs(model={str(model_dir)!r}, max_model_len=256,
                            max_num_seqs=8).create_config()
        client = SyncMPClient(config)
        print(client.proc.pid, client.resources.tmpdir, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no finalizers
    """)
    parent = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert parent.returncode == -signal.SIGKILL, parent.stderr
    engine_pid, ipc_dir = parent.stdout.split()
    deadline = time.monotonic() + 8
    while _process_running(int(engine_pid)):
        assert time.monotonic() < deadline, "the engine outlived its parent"
        time.sleep(0.1)
    assert not Path(ipc_dir).exists()


def _process_running(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited; only its reaper is missing


@pytest.mark.parametrize("other_process", [True, False])
def test_front_end_featurizes_on_one_thread_beside_an_engine_process(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, other_process: bool
) -> None:
    """With the core in another process, the front end's featurization takes one torch thread
    (the core's OpenMP threads own the cores) and gives the rest back afterwards."""
    import torch

    from omniserve.engine.processor import Processor

    processor = Processor(_config(model_dir), engine_in_other_process=other_process)
    seen: list[int] = []
    preprocess = processor.input_preprocessor.preprocess

    def record(prompt: object) -> object:
        seen.append(torch.get_num_threads())
        return preprocess(prompt)  # type: ignore[arg-type]

    monkeypatch.setattr(processor.input_preprocessor, "preprocess", record)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        prompt = {"prompt_token_ids": PROMPTS[0]}
        processor.process_inputs("r", prompt, SamplingParams(max_tokens=2))
        assert seen == [1 if other_process else 2]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
