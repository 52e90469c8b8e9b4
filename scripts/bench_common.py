"""What the benchmark scripts share: timing a call (``best_of``), and running each setting in a
fresh process of the same script (``--worker``, with the same flags), one at a time, so no
engine's threads, allocator or caches slow another, each handing its figures back as one
``RESULT`` line (``run_workers`` / ``report``)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any


def best_of(repeats: int, fn: Callable[[], object], sync: Callable[[], object]) -> float:
    """The best seconds of ``repeats`` calls of ``fn``, each between two ``sync()`` calls (the
    device's, where work runs asynchronously)."""
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def run_workers(script: str, settings: list[str], model_dir: str) -> list[dict[str, Any]]:
    """Each setting's figures: ``script`` run with this process's flags and ``--worker
    [setting, model_dir]``; a failed worker stops the benchmark with its stderr."""
    results = []
    for setting in settings:
        proc = subprocess.run([sys.executable, script, *sys.argv[1:], "--worker",
                               json.dumps([setting, model_dir])],
                              capture_output=True, text=True)  # fmt: skip
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"{setting} failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(lines[-1].removeprefix("RESULT ")))
    return results


def report(result: dict[str, Any]) -> None:
    """A worker's figures, for ``run_workers``."""
    print("RESULT " + json.dumps(result), flush=True)
