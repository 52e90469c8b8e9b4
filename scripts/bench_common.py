"""What the one-setting-per-process benchmarks share: each setting runs in a fresh process of the
same script (``--worker``, with the same flags), one at a time, so no engine's threads, allocator
or caches slow another, and hands its figures back as one ``RESULT`` line."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


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
