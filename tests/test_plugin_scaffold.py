"""`omniserve register-model --scaffold`: the package is complete and ruff-clean, passes `--check`
(spawned engine and transformers included) on a tiny checkpoint of its base family, and, pip
installed into a temporary site dir, is found through its entry point by `omniserve serve` in a
subprocess, whose engine process runs the plugin's own code to answer a chat request."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from PIL import Image
from transformers import AutoTokenizer

from omniserve.entrypoints.cli import main
from omniserve.plugin_tools.checkpoints import tiny_checkpoint_as
from tests.server_utils import MODEL, launch_server
from tests.test_plugin_check import check_rows

BASE = "Qwen2VLForConditionalGeneration"
NAME = "acme_vl"
ARCH = "AcmeVlForConditionalGeneration"
FORCED_TOKEN = 42
# What a user's edit looks like: the served replies then prove the plugin's code ran.
EDIT = f"""
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        logits[:, {FORCED_TOKEN}] += 1e4
        return logits
"""


def _ruff(project: Path) -> None:
    for args in (["check", "."], ["format", "--check", "."]):
        result = subprocess.run(
            [sys.executable, "-m", "ruff", *args], cwd=project, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stdout + result.stderr


def _scaffold(capsys, out: Path, *extra: str) -> str:
    assert main(["register-model", "--scaffold", NAME, "--out", str(out), *extra]) == 0
    return capsys.readouterr().out


def test_scaffold_writes_a_complete_ruff_clean_package(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMNISERVE_CONFIG_DIR", str(tmp_path / "config"))
    project = tmp_path / NAME
    printed = _scaffold(capsys, project)
    assert f"Wrote the {ARCH} plugin to {project}" in printed
    files = sorted(str(p.relative_to(project)) for p in project.rglob("*") if p.is_file())
    assert files == [
        "README.md",
        "acme_vl/__init__.py",
        "acme_vl/model.py",
        "acme_vl/processor.py",
        "pyproject.toml",
        "tests/test_acme_vl.py",
    ]
    pyproject = tomllib.loads((project / "pyproject.toml").read_text())
    assert pyproject["project"]["entry-points"]["omniserve.plugins"] == {NAME: f"{NAME}:register"}
    model = (project / NAME / "model.py").read_text()
    assert f"class {ARCH}({BASE}):" in model
    assert f"from model_zoo.qwen2_vl import {BASE}" in model
    assert (
        "class AcmeVlMultiModalProcessor(Qwen2VLMultiModalProcessor):"
        in (project / NAME / "processor.py").read_text()
    )
    _ruff(project)

    # A text-only base gets no processor module; the architecture name is the user's.
    text = tmp_path / "text"
    _scaffold(capsys, text, "MyLM", "--from", "Qwen2ForCausalLM")
    assert not (text / NAME / "processor.py").exists()
    assert "class MyLM(Qwen2ForCausalLM):" in (text / NAME / "model.py").read_text()
    _ruff(text)

    # Never over an existing project, never under a registered architecture's name.
    for argv, expected in (
        ([], "exists and is not an empty directory"),
        (["Qwen2ForCausalLM"], "must be a new architecture name"),
    ):
        out = project if not argv else tmp_path / "other"
        assert main(["register-model", *argv, "--scaffold", NAME, "--out", str(out)]) == 2
        assert expected in capsys.readouterr().err
    assert not (tmp_path / "other").exists()


@pytest.mark.slow
def test_scaffolded_plugin_passes_the_check_and_serves(
    tmp_path, monkeypatch, capsys, tiny_checkpoint
):
    monkeypatch.setenv("OMNISERVE_CONFIG_DIR", str(tmp_path / "config"))
    project = tmp_path / NAME
    _scaffold(capsys, project)

    # 1. Unchanged, it passes every row of the check on the base family's tiny checkpoint.
    checkpoint = tiny_checkpoint(BASE)
    assert (
        main(
            [
                "register-model",
                ARCH,
                "--model",
                f"{NAME}.model:{ARCH}",
                "--path",
                str(project),
                "--check",
                str(checkpoint),
            ]
        )
        == 0
    ), capsys.readouterr()
    out = capsys.readouterr().out
    rows = check_rows(out)
    assert {name: status for name, (status, _) in rows.items() if status != "PASS"} == {}, out
    assert {
        "encoder vs placeholders [video]",
        "request [image]",
        "matches transformers [text]",
        "matches transformers [image]",
        "matches transformers [video]",
    } <= rows.keys()
    assert f"Registered {ARCH}" in out and "the plugin passes." in out

    # 2. Edited and pip-installed into a private site dir: the entry point registers it.
    with (project / NAME / "model.py").open("a") as f:
        f.write(EDIT)
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(site),
            str(project),
        ],
        check=True,
        capture_output=True,
    )
    monkeypatch.setenv("OMNISERVE_CONFIG_DIR", str(tmp_path / "empty-config"))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    )
    listed = subprocess.run(
        [sys.executable, "-m", "omniserve.entrypoints.cli", "models"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    row = next(line for line in listed.splitlines() if line.startswith(ARCH))
    assert f"entry point {NAME}" in row and row.endswith("text, image, video")

    # 3. `omniserve serve` on a checkpoint naming the plugin: both processes resolve it.
    served = tiny_checkpoint_as(BASE, ARCH)
    png = io.BytesIO()
    Image.new("RGB", (64, 48), "teal").save(png, format="PNG")
    image_url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    with launch_server(served, tmp_path, "--max-model-len", "1024", "--dtype", "float32") as s:
        reply = s.client().chat.completions.create(
            model=MODEL,
            max_tokens=4,
            temperature=0.0,
            extra_body={"ignore_eos": True},
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": image_url}},
                        {"type": "text", "text": "What colour is it?"},
                    ],
                }
            ],
        )
    forced = AutoTokenizer.from_pretrained(served).decode([FORCED_TOKEN] * 4)
    assert reply.choices[0].message.content == forced
    assert reply.usage.prompt_tokens_details.image_tokens > 0
    assert json.loads((served / "config.json").read_text())["architectures"] == [ARCH]
