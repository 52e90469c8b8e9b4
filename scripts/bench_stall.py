"""Does one heavy request stall everyone else? Time to first token of small requests, idle and
while another client keeps sending a heavy one (a 60 s audio clip, a 600-frame video), on one
`omniserve serve`.

A probe client sends small streamed chats one after another (a new one every ``--gap`` s) and
times each to its first content chunk, and /health beside it. The heavy client sends its request
back to back for the whole window. Printed: p50/p99 TTFT and /health latency per phase, the
ratio to idle (target: p99 within 2x), and how long the heavy requests took.

    python scripts/bench_stall.py                     # the default model
    python scripts/bench_stall.py --model DIR --probes 100
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import av
import httpx
import numpy as np
import soundfile

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.server_utils import API_KEY, MODEL, launch_server  # noqa: E402

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def audio_clip(seconds: float, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    soundfile.write(
        buf,
        rng.uniform(-0.3, 0.3, int(16000 * seconds)).astype(np.float32),
        16000,
        format="WAV",
        subtype="PCM_16",
    )
    return {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(), "format": "wav"},
    }


def video_clip(
    num_frames: int, seed: int, width: int = 320, height: int = 240, fps: int = 30
) -> dict:
    buf = io.BytesIO()
    rng = np.random.default_rng(seed)
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        base = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(np.roll(base, i, axis=1), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    url = "data:video/mp4;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"type": "video_url", "video_url": {"url": url}}


def chat(content: object, max_tokens: int) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }


async def probe(client: httpx.AsyncClient, num: int, gap: float) -> tuple[list[float], list[float]]:
    ttfts, healths = [], []
    for i in range(num):
        start = time.perf_counter()
        async with client.stream(
            "POST", "/v1/chat/completions", json={**chat(f"Hi {i}", 4), "stream": True}
        ) as response:
            lines = response.aiter_lines()
            async for line in lines:
                if '"content":"' in line and '"content":""' not in line:
                    ttfts.append(time.perf_counter() - start)
                    break
            async for _ in lines:
                pass
        start = time.perf_counter()
        (await client.get("/health")).raise_for_status()
        healths.append(time.perf_counter() - start)
        await asyncio.sleep(gap)
    return ttfts, healths


async def heavy_loop(
    url: str, bodies: Callable[[int], dict], stop: threading.Event, took: list[float]
) -> None:
    async with httpx.AsyncClient(base_url=url, headers=HEADERS, timeout=600) as client:
        i = 0
        while not stop.is_set():
            start = time.perf_counter()
            response = await client.post("/v1/chat/completions", json=bodies(i))
            if response.status_code != 200:
                print(f"heavy request refused: {response.status_code} {response.text[:300]}")
                return
            took.append(time.perf_counter() - start)
            i += 1


def run_phase(url: str, heavy: Callable[[int], dict] | None, num: int, gap: float) -> dict:
    stop, took = threading.Event(), []
    thread = None
    if heavy is not None:  # its own thread and loop: a second client, as a user would be
        thread = threading.Thread(target=lambda: asyncio.run(heavy_loop(url, heavy, stop, took)))
        thread.start()
        time.sleep(1.0)  # let the first heavy request get going

    async def main() -> tuple[list[float], list[float]]:
        async with httpx.AsyncClient(base_url=url, headers=HEADERS, timeout=600) as client:
            return await probe(client, num, gap)

    ttfts, healths = asyncio.run(main())
    stop.set()
    if thread is not None:
        thread.join()
    return {"ttft": ttfts, "health": healths, "heavy": took}


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="Checkpoint dir (default: the built-in).")
    parser.add_argument("--probes", type=int, default=40, help="Small requests per phase.")
    parser.add_argument("--gap", type=float, default=0.1, help="Seconds between probes.")
    parser.add_argument("--audio-seconds", type=float, default=60.0)
    parser.add_argument(
        "--video-frames",
        type=int,
        default=600,
        help="Frames in the video (320x240, 30 fps), all of them decoded.",
    )
    parser.add_argument(
        "--sampled-frames",
        type=int,
        default=16,
        help="Frames sampled from it (num_frames), so it fits the context.",
    )
    parser.add_argument("--variants", type=int, default=4, help="Distinct clips and videos.")
    parser.add_argument(
        "--flags",
        nargs=argparse.REMAINDER,
        default=[],
        help="Extra `omniserve serve` flags (last).",
    )
    args = parser.parse_args()
    # Built before the server starts, so the client spends no CPU on them meanwhile; the
    # server runs without its processor and prefix caches, so every heavy request does all
    # of its work again.
    videos = [video_clip(args.video_frames, seed) for seed in range(args.variants)]
    clips = [audio_clip(args.audio_seconds, seed) for seed in range(args.variants)]
    text = {"type": "text", "text": "Describe it."}
    heavy: dict[str, Callable[[int], dict]] = {
        f"{args.audio_seconds:g} s audio clip": lambda i: chat([clips[i % len(clips)], text], 8),
        f"{args.video_frames}-frame video": lambda i: {
            **chat([videos[i % len(videos)], text], 8),
            "mm_processor_kwargs": {"num_frames": args.sampled_frames},
        },
    }
    log_dir = Path("/tmp/omniserve-bench-stall")
    log_dir.mkdir(exist_ok=True)
    model = Path(args.model) if args.model else None
    with launch_server(
        model, log_dir, "--mm-processor-cache-gb", "0", "--no-enable-prefix-caching", *args.flags
    ) as server:
        run_phase(server.url, None, 5, 0.0)  # warm-up
        for bodies in heavy.values():  # warm-up of each heavy path
            run_phase(server.url, lambda i, bodies=bodies: bodies(10_000 + i), 1, 0.0)
        phases = {"idle": run_phase(server.url, None, args.probes, args.gap)}
        for name, bodies in heavy.items():
            phases[f"while a {name} is sent"] = run_phase(server.url, bodies, args.probes, args.gap)
    idle_p99 = pct(phases["idle"]["ttft"], 99)
    print(
        f"{'phase':<40} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'p99/idle':>9} {'health p99':>11} "
        f"{'heavy requests':>14}"
    )
    for name, result in phases.items():
        heavy_s = (
            f"{len(result['heavy'])} x {statistics.mean(result['heavy']):.2f} s"
            if result["heavy"]
            else "-"
        )
        print(
            f"{name:<40} {pct(result['ttft'], 50):7.1f}ms {pct(result['ttft'], 90):6.1f}ms "
            f"{pct(result['ttft'], 99):6.1f}ms "
            f"{pct(result['ttft'], 99) / idle_p99:8.2f}x {pct(result['health'], 99):9.1f}ms "
            f"{heavy_s:>14}"
        )


if __name__ == "__main__":
    main()
