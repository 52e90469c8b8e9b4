"""Online serving benchmark: omniserve vs `transformers serve` on the same checkpoint, in one run.

Starts each server on loopback in turn (never both at once, so they do not share the CPU), sends
streamed chat completions at each concurrency level, and prints TTFT, TPOT and ITL (p50/p99),
requests/s and output tokens/s per system, then the ratios. Latencies are measured at the client:
TTFT = request sent -> first content chunk; ITL = gaps between content chunks; TPOT = (last chunk -
first chunk) / (output tokens - 1), per request.

`transformers serve` needs `accelerate` (pip install accelerate) to load a model on a device.

    python scripts/bench_serving.py                      # bench-size Qwen3, sweep 1 4 16 64
    python scripts/bench_serving.py --size tiny --concurrency 1 4 --output-len 16
    python scripts/bench_serving.py --playground-ablation   # omniserve with vs without it
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 300


@dataclass
class RequestResult:
    ttft: float
    e2e: float
    itls: list[float]
    num_output_tokens: int


@dataclass
class LevelResult:
    system: str
    concurrency: int
    wall_time: float
    results: list[RequestResult] = field(default_factory=list)

    @property
    def requests_per_s(self) -> float:
        return len(self.results) / self.wall_time

    @property
    def output_tokens_per_s(self) -> float:
        return sum(r.num_output_tokens for r in self.results) / self.wall_time

    def percentile(self, name: str, q: float) -> float:
        if name == "itl":
            values = [x for r in self.results for x in r.itls]
        elif name == "tpot":
            values = [
                (r.e2e - r.ttft) / (r.num_output_tokens - 1)
                for r in self.results
                if r.num_output_tokens > 1
            ]
        else:
            values = [getattr(r, name) for r in self.results]
        if not values:
            return float("nan")
        values.sort()
        return values[min(len(values) - 1, round(q * (len(values) - 1)))]


@dataclass
class ServerSpec:
    name: str
    command: list[str]
    model_name: str
    extra_body: dict


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_prompts(model_dir: Path, num: int, input_len: int, seed: int) -> list[str]:
    """Random vocabulary text of about ``input_len`` tokens each (same prompts for both)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    return [tokenizer.decode([rng.choice(vocab) for _ in range(input_len)]) for _ in range(num)]


class RunningServer:
    """A server subprocess on a free loopback port, stopped (with its children) on exit."""

    def __init__(self, spec: ServerSpec, log_dir: Path) -> None:
        self.spec = spec
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{spec.name}.log"
        command = [part.format(port=self.port) for part in spec.command]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                command,
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.spec.name} did not start in {STARTUP_TIMEOUT_S}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the engine child too
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


async def one_request(
    client: httpx.AsyncClient, server: RunningServer, prompt: str, output_len: int
) -> RequestResult:
    body = {
        "model": server.spec.model_name,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **server.spec.extra_body,
    }
    start = time.perf_counter()
    chunk_times: list[float] = []
    usage_tokens = None
    async with client.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(
                f"{server.spec.name}: HTTP {response.status_code}: "
                f"{(await response.aread())[:500]!r}"
            )
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            data = json.loads(line[5:])
            if data.get("usage"):
                usage_tokens = data["usage"]["completion_tokens"]
            if any(c.get("delta", {}).get("content") for c in data.get("choices") or []):
                chunk_times.append(time.perf_counter())
    if not chunk_times:
        raise RuntimeError(f"{server.spec.name} streamed no content")
    return RequestResult(
        ttft=chunk_times[0] - start,
        e2e=chunk_times[-1] - start,
        itls=[b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False)],
        num_output_tokens=usage_tokens or len(chunk_times),
    )


async def run_level(
    server: RunningServer, prompts: list[str], concurrency: int, output_len: int
) -> LevelResult:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    level = LevelResult(server.spec.name, concurrency, 0.0)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                level.results.append(await one_request(client, server, prompt, output_len))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        level.wall_time = time.perf_counter() - start
    return level


def bench_system(
    spec: ServerSpec, prompts: list[str], args: argparse.Namespace, log_dir: Path
) -> list[LevelResult]:
    server = RunningServer(spec, log_dir)
    try:
        server.wait_ready()
        asyncio.run(run_level(server, prompts[:2], 1, args.output_len))  # warm-up
        levels = []
        for concurrency in args.concurrency:
            num = max(args.min_requests, args.requests_per_slot * concurrency)
            level = asyncio.run(run_level(server, prompts[:num], concurrency, args.output_len))
            print(
                f"  {spec.name:>12s} c={concurrency:<3d} {len(level.results)} requests in "
                f"{level.wall_time:.1f}s",
                flush=True,
            )
            levels.append(level)
        return levels
    finally:
        server.stop()


def bench_interleaved(
    specs: list[ServerSpec], prompts: list[str], args: argparse.Namespace, log_dir: Path
) -> dict[str, list[LevelResult]]:
    """Each system twice, in the order A B B A, each level's two runs merged: whichever server
    runs first meets a colder machine (16-22 % slower at concurrency 1 on 2 cores), and this
    order gives both systems that place once."""
    results: dict[str, list[LevelResult]] = {}
    for spec in [*specs, *reversed(specs)]:
        levels = bench_system(spec, prompts, args, log_dir)
        earlier = results.get(spec.name)
        results[spec.name] = levels if earlier is None else [
            merge_levels(a, b) for a, b in zip(earlier, levels, strict=True)
        ]  # fmt: skip
    return {spec.name: results[spec.name] for spec in specs}


def merge_levels(a: LevelResult, b: LevelResult) -> LevelResult:
    """Two runs of one level as one: rates over their summed wall time, percentiles over all
    their requests."""
    return LevelResult(a.system, a.concurrency, a.wall_time + b.wall_time, a.results + b.results)


def print_tables(results: dict[str, list[LevelResult]]) -> None:
    columns = [
        ("req/s", lambda r: r.requests_per_s),
        ("out tok/s", lambda r: r.output_tokens_per_s),
    ]
    for name in ("ttft", "tpot", "itl"):
        for q in (0.5, 0.99):
            columns.append(
                (
                    f"{name.upper()} p{round(q * 100)} ms",
                    lambda r, n=name, q=q: 1000 * r.percentile(n, q),
                )
            )
    header = f"{'system':>12s} {'conc':>4s} " + " ".join(f"{c:>12s}" for c, _ in columns)
    print("\n" + header + "\n" + "-" * len(header))
    for levels in results.values():
        for level in levels:
            print(
                f"{level.system:>12s} {level.concurrency:>4d} "
                + " ".join(f"{fn(level):12.2f}" for _, fn in columns)
            )
    if len(results) != 2:
        return
    (ours_name, ours), (base_name, base) = results.items()
    print(
        f"\n{ours_name} / {base_name}: throughput ratios (>1: {ours_name} more), "
        f"latency ratios as {base_name} / {ours_name} (>1: {ours_name} faster)"
    )
    print(f"{'conc':>4s} " + " ".join(f"{c:>12s}" for c, _ in columns))
    for a, b in zip(ours, base, strict=True):
        cells = []
        for i, (_, fn) in enumerate(columns):
            x, y = fn(a), fn(b)
            cells.append((x / y if i < 2 else y / x) if x and y else float("nan"))
        print(f"{a.concurrency:>4d} " + " ".join(f"{c:12.2f}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="Checkpoint dir (default: built tiny Qwen3).")
    parser.add_argument("--size", default="bench", choices=["tiny", "bench"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument(
        "--requests-per-slot",
        type=int,
        default=2,
        help="Requests per concurrency slot at each level.",
    )
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128, help="Prompt tokens (about).")
    parser.add_argument("--output-len", type=int, default=64, help="Generated tokens.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype", default="float32", help="Both servers' dtype (the same for a fair comparison)."
    )
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument(
        "--playground-ablation",
        action="store_true",
        help="Compare omniserve with its web playground (the default) against "
        "omniserve --no-playground, instead of against transformers (run A B B A).",
    )
    parser.add_argument(
        "--hf-continuous-batching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Run `transformers serve --continuous-batching`.",
    )
    parser.add_argument("--log-dir", default="/tmp/omniserve-bench-serving")
    args = parser.parse_args()

    if args.model:
        model = Path(args.model)
    else:
        from omniserve.checkpoint_builder import build_tiny_checkpoint

        model = build_tiny_checkpoint("Qwen3ForCausalLM", size=args.size)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    most = max(args.min_requests, args.requests_per_slot * max(args.concurrency))
    prompts = make_prompts(model, most, args.input_len, args.seed)
    specs = [
        ServerSpec(
            "omniserve",
            [
                sys.executable,
                "-m",
                "omniserve.entrypoints.cli",
                "serve",
                str(model),
                "--port",
                "{port}",
                "--served-model-name",
                "bench",
                "--dtype",
                args.dtype,
                "--uvicorn-log-level",
                "warning",
            ],
            "bench",
            {"ignore_eos": True},
        )
    ]
    if args.playground_ablation:
        specs.append(
            ServerSpec(
                "no-playground",
                [*specs[0].command, "--no-playground"],
                "bench",
                {"ignore_eos": True},
            )
        )
    elif not args.skip_transformers:
        hf = shutil.which("transformers") or "transformers"
        command = [
            hf,
            "serve",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            "{port}",
            "--device",
            "cpu",
            "--dtype",
            args.dtype,
            "--log-level",
            "warning",
        ]
        if args.hf_continuous_batching:
            command.append("--continuous-batching")
        specs.append(ServerSpec("transformers", command, str(model), {}))
    print(
        f"model {model}; prompts ~{args.input_len} tokens, {args.output_len} output tokens; "
        f"logs in {log_dir}",
        flush=True,
    )
    if args.playground_ablation:  # two near-equal systems: the run order would decide
        results = bench_interleaved(specs, prompts, args, log_dir)
    else:
        results = {spec.name: bench_system(spec, prompts, args, log_dir) for spec in specs}
    print_tables(results)


if __name__ == "__main__":
    main()
