"""The ``omniserve`` command's offline subcommands, run as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMNISERVE_ENABLE_MULTIPROCESSING": "0"}


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "omniserve.entrypoints.cli", *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )


def test_make_tiny_and_generate(tmp_path):
    out = tmp_path / "ckpt"
    made = _run("make-tiny", "LlamaForCausalLM", "--out", str(out))
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == str(out)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    gen = _run(
        "generate",
        str(out),
        "--prompt",
        "Once upon a time",
        "--max-tokens",
        "5",
        "--dtype",
        "float32",
    )
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("'Once upon a time' -> ")


def test_models_lists_the_zoo():
    listed = _run("models")
    assert listed.returncode == 0, listed.stderr
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM"):
        assert arch in listed.stdout


def test_errors_are_one_line_and_nonzero(tmp_path):
    missing = _run("generate", str(tmp_path / "nope"))
    assert missing.returncode == 2
    assert "not a directory" in missing.stderr and "Traceback" not in missing.stderr
    unknown = _run("make-tiny", "NoSuchArch", "--out", str(tmp_path / "x"))
    assert unknown.returncode == 2 and "NoSuchArch" in unknown.stderr
