"""Data parallelism (``--data-parallel-size``): N engine cores behind one front end.

The balancer, the combination of the engines' answers and the per-engine environment are pure
Python and tested alone. A DP=2 offline ``LLM`` and a DP=2 server must give the greedy answers of
one engine, spread requests over both engines (as the engines themselves count them), free KV on
each engine when streams are cancelled, and go down whole and clean when one engine dies.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from omniserve.engine.arg_utils import EngineArgs
from omniserve.engine.data_parallel import (
    LoadBalancer,
    combine_results,
    combine_stats,
    engine_env,
)
from omniserve.engine.mp_client import SyncMPClient
from omniserve.entrypoints.llm import LLM
from omniserve.sampling_params import SamplingParams
from tests.server_utils import (
    MODEL,
    Server,
    assert_kill_fails_cleanly,
    launch_server,
    metric,
)

ARCH = "Qwen3ForCausalLM"
MAX_MODEL_LEN = 1024  # long enough that a max-length answer outlives an engine kill
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
CHATS = [[{"role": "user", "content": f"Tell me about the number {i}."}] for i in range(8)]
TOKEN_PROMPTS = [[(7 * i + j) % 200 + 10 for j in range(5 + i)] for i in range(8)]
RECEIVED = "omniserve:num_requests_received_total"


# ---- pure Python: balancing, combining, placement ----


def test_balancer_routes_to_the_least_loaded_engine_lowest_rank_first() -> None:
    balancer = LoadBalancer(3)
    assert [balancer.route([f"r{i}"]) for i in range(4)] == [0, 1, 2, 0]
    assert balancer.num_outstanding == [2, 1, 1]
    assert balancer.release(["r1"]) == {1: ["r1"]}  # engine 1 is now the least loaded
    assert balancer.route(["r4"]) == 1
    assert balancer.release(["r0", "r3", "r2"]) == {0: ["r0", "r3"], 2: ["r2"]}
    assert balancer.num_outstanding == [0, 1, 0]
    assert balancer.route(["r5"]) == 0  # tie between 0 and 2: the lower rank
    with pytest.raises(ValueError, match="num_engines"):
        LoadBalancer(0)


def test_balancer_keeps_a_group_together_and_releases_each_request_once() -> None:
    balancer = LoadBalancer(2)
    assert balancer.route(["solo"]) == 0
    group = ["0_p", "1_p", "2_p"]  # the n=3 samples of one prompt
    assert balancer.route(group) == 1
    assert balancer.num_outstanding == [1, 3]
    assert balancer.route(["next"]) == 0  # 1 < 3 outstanding
    # A finish racing an abort: the second release knows the id no more.
    assert balancer.release(["1_p"]) == {1: ["1_p"]}
    assert balancer.release(["1_p", "unknown"]) == {}
    assert balancer.num_outstanding == [2, 2]
    balancer.release(["solo", "next", "0_p", "2_p"])
    assert balancer.num_outstanding == [0, 0] and not balancer.request_to_engine


def test_combine_stats_sums_counts_and_averages_usage() -> None:
    engine_stats = [
        {
            "num_running": 2.0,
            "num_waiting": 1.0,
            "kv_cache_usage": 0.5,
            "num_kv_blocks": 100.0,
            "encoder_cache_usage": 0.2,
            "prefix_cache_hits": 3.0,
            "num_requests_received": 5.0,
        },
        {
            "num_running": 1.0,
            "num_waiting": 0.0,
            "kv_cache_usage": 0.0,
            "num_kv_blocks": 300.0,
            "encoder_cache_usage": 0.4,
            "prefix_cache_hits": 4.0,
            "num_requests_received": 7.0,
        },
    ]
    combined = combine_stats(engine_stats)
    assert combined == pytest.approx(
        {
            "num_running": 3.0,
            "num_waiting": 1.0,
            "kv_cache_usage": 50 / 400,
            "num_kv_blocks": 400.0,
            "encoder_cache_usage": 0.3,
            "prefix_cache_hits": 7.0,
            "num_requests_received": 12.0,
        }
    )
    assert combine_results("get_stats", engine_stats) == combined
    assert combine_results("get_stats", engine_stats[:1]) is engine_stats[0]
    assert combine_results("reset_prefix_cache", [True, False]) is False
    assert combine_results("has_unfinished_requests", [False, True]) is True
    assert combine_results("some_new_utility", [1, 2]) == [1, 2]  # by rank


def test_engine_env_splits_cpu_threads_and_gpus() -> None:
    assert engine_env(0, 1, 1, 8, None, None) == {}  # one engine: the machine as it is
    # 2 engines on 2 cores: one torch thread each, never 0; the user's own setting wins.
    assert engine_env(1, 2, 1, 2, None, None) == {"OMNISERVE_NUM_THREADS": "1"}
    assert engine_env(0, 4, 1, 2, None, None) == {"OMNISERVE_NUM_THREADS": "1"}
    assert engine_env(0, 2, 2, 16, None, None) == {"OMNISERVE_NUM_THREADS": "8"}  # per engine
    assert engine_env(0, 2, 1, 16, 3, None) == {}
    gpus = ["3", "5", "6", "7"]
    assert engine_env(1, 2, 2, 8, 1, gpus) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    assert engine_env(1, 2, 1, 8, 1, gpus) == {"CUDA_VISIBLE_DEVICES": "5"}
    with pytest.raises(ValueError, match="needs 6 GPUs, but 4 are visible"):
        engine_env(0, 3, 2, 8, 1, gpus)


# ---- offline: LLM(data_parallel_size=2) ----


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint: Any) -> Path:
    return tiny_checkpoint(ARCH)


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> dict[str, list[str]]:
    """Greedy answers of one engine (in this process) for the chats and the token prompts."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
        llm = LLM(str(model_dir), max_model_len=MAX_MODEL_LEN, kv_cache_memory="64MiB")
    try:
        chats = llm.chat(CHATS, GREEDY, use_tqdm=False)
        tokens = llm.generate(
            [{"prompt_token_ids": ids} for ids in TOKEN_PROMPTS], GREEDY, use_tqdm=False
        )
    finally:
        llm.shutdown()
    return {
        "chat": [o.outputs[0].text for o in chats],
        "tokens": [o.outputs[0].text for o in tokens],
    }


def test_in_process_engine_rejects_data_parallel(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
    with pytest.raises(ValueError, match="data_parallel_size=2 .*OMNISERVE_ENABLE_MULTI"):
        LLM(str(model_dir), max_model_len=MAX_MODEL_LEN, data_parallel_size=2)


@pytest.mark.slow
def test_offline_dp2_matches_one_engine_and_uses_both(
    model_dir: Path, expected: dict[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "1")  # the suite's default is 0
    llm = LLM(
        str(model_dir), max_model_len=MAX_MODEL_LEN, kv_cache_memory="64MiB", data_parallel_size=2
    )
    client = llm.llm_engine.engine_core
    procs = list(client.resources.procs)
    try:
        assert len(procs) == 2 and client.is_alive()
        assert client.num_kv_blocks == sum(client.engine_num_kv_blocks)

        def received() -> list[float]:
            return [s["num_requests_received"] for s in client.call_utility_per_engine("get_stats")]

        # The n samples of one prompt stay on one engine (they share its prefix cache).
        [sampled] = llm.generate(
            {"prompt_token_ids": TOKEN_PROMPTS[0]},
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=4),
            use_tqdm=False,
        )
        assert [c.text for c in sampled.outputs] == [expected["tokens"][0]] * 4
        assert received() == [4, 0]

        outputs = llm.generate(
            [{"prompt_token_ids": ids} for ids in TOKEN_PROMPTS], GREEDY, use_tqdm=False
        )
        assert [o.outputs[0].text for o in outputs] == expected["tokens"]
        chats = llm.chat(CHATS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].text for o in chats] == expected["chat"]
        assert received() == [4 + 4 + 4, 0 + 4 + 4]  # an idle pair alternates

        stats = client.call_utility("get_stats")
        assert stats["num_requests_received"] == 20 and stats["num_running"] == 0
        assert stats["num_kv_blocks"] == client.num_kv_blocks
        assert client.balancer.num_outstanding == [0, 0]
        assert llm.llm_engine.reset_prefix_cache() is True
    finally:
        llm.shutdown()
    assert all(not proc.is_alive() and proc.exitcode == 0 for proc in procs)


@pytest.mark.slow
def test_startup_failure_of_two_engines_is_precise_and_leaves_no_process(
    model_dir: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    for weights in broken.glob("*.safetensors"):
        weights.unlink()
    config = EngineArgs(
        model=str(broken), max_model_len=MAX_MODEL_LEN, data_parallel_size=2
    ).create_config()
    before = set(multiprocessing.active_children())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        SyncMPClient(config)
    assert set(multiprocessing.active_children()) == before


# ---- the server: --data-parallel-size 2 ----


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with launch_server(
        model_dir,
        tmp_path_factory.mktemp("dp_server"),
        "--data-parallel-size",
        "2",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory",
        "64MiB",
    ) as running:
        yield running


def _engine_pids(server_pid: int) -> list[int]:
    """The server's engine cores (its spawned children), by pid: rank 0 started first."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == server_pid and b"spawn_main" in cmdline:
            pids.append(int(entry.name))
    return sorted(pids)


def _environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in entries if b"=" in e)


@pytest.mark.slow
def test_dp_server_spreads_32_concurrent_requests_and_matches_one_engine(
    server: Server, expected: dict[str, list[str]]
) -> None:
    pids = _engine_pids(server.proc.pid)
    assert len(pids) == 2
    # On CPU the engines split the cores instead of each taking all of them.
    threads = os.environ.get("OMNISERVE_NUM_THREADS") or str(
        max(1, len(os.sched_getaffinity(0)) // 2)
    )
    assert [_environ(pid).get("OMNISERVE_NUM_THREADS") for pid in pids] == [threads] * 2

    before = server.metrics()
    greedy: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "extra_body": {"ignore_eos": True},
    }

    async def run() -> list[str]:
        client = server.async_client()

        async def chat(i: int) -> str:
            reply = await client.chat.completions.create(messages=CHATS[i], **greedy)
            return reply.choices[0].message.content

        async def complete(i: int) -> str:  # streamed
            chunks = await client.completions.create(prompt=TOKEN_PROMPTS[i], stream=True, **greedy)
            return "".join([c.choices[0].text async for c in chunks if c.choices])

        results = await asyncio.gather(
            *(chat(i % 8) if i % 2 else complete(i % 8) for i in range(32))
        )
        await client.close()
        return list(results)

    results = asyncio.run(run())
    assert results == [
        expected["chat"][i % 8] if i % 2 else expected["tokens"][i % 8] for i in range(32)
    ]
    after = server.metrics()
    # Counted by the engines themselves, reported per engine on /metrics.
    served = [
        metric(after, RECEIVED, engine=e) - metric(before, RECEIVED, engine=e) for e in ("0", "1")
    ]
    assert sum(served) == 32 and min(served) >= 8, served
    for engine in ("0", "1"):
        assert metric(after, "omniserve:prefix_cache_queries_total", engine=engine) > 0
    assert (
        metric(after, "omniserve:request_success_total", finished_reason="length")
        - metric(before, "omniserve:request_success_total", finished_reason="length")
    ) == 32


def _wait_for_idle(server: Server, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        values = server.metrics()
        busy = sum(
            metric(values, f"omniserve:{name}")
            for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        )
        if busy == 0 or time.monotonic() > deadline:
            return values
        time.sleep(0.2)


@pytest.mark.slow
def test_dp_server_cancelled_streams_free_kv_on_each_engine(server: Server) -> None:
    before = server.metrics()

    async def run() -> None:
        client = server.async_client()

        async def read_two_chunks_then_leave(i: int) -> None:
            stream = await client.completions.create(
                model=MODEL,
                prompt=f"Keep talking, number {i}",
                stream=True,
                max_tokens=MAX_MODEL_LEN - 32,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )
            received = 0
            async for _ in stream:
                received += 1
                if received == 2:
                    break
            await stream.close()

        await asyncio.gather(*(read_two_chunks_then_leave(i) for i in range(16)))
        await client.close()

    asyncio.run(run())
    after = _wait_for_idle(server)
    for engine in ("0", "1"):
        assert metric(after, RECEIVED, engine=engine) > metric(before, RECEIVED, engine=engine)
        for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            assert metric(after, f"omniserve:{gauge}", engine=engine) == 0, (gauge, engine)
    assert (
        metric(after, "omniserve:request_success_total", finished_reason="abort")
        - metric(before, "omniserve:request_success_total", finished_reason="abort")
    ) == 16


def _running(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_dp_server_one_engine_dies_all_go_down_cleanly(server: Server) -> None:
    """Runs last: it kills one of the module's engines."""
    engine_0, engine_1 = _engine_pids(server.proc.pid)
    # An idle pair routes to rank 0; then engine 1, which holds no request, is killed.
    assert_kill_fails_cleanly(
        server,
        engine_1,
        max_tokens=MAX_MODEL_LEN - 32,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    deadline = time.monotonic() + 10
    while _running(engine_0):  # the survivor is stopped, not orphaned
        assert time.monotonic() < deadline, "the other engine core outlived the dead one"
        time.sleep(0.1)
    assert server.proc.poll() is None  # the server itself stays up, reporting 503
