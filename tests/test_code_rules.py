"""The code rules CI keeps: ruff's lint rules and formatting, mypy on the modules pyproject.toml
lists, and a size cap per module, on the whole repository."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 600
"""style.md §7.2's hard ceiling: a module past it has more than one job; split it by
responsibility."""


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_ruff_lint_is_clean() -> None:
    result = _ruff("check", ".")
    assert result.returncode == 0, result.stdout[-4000:]


def test_ruff_format_leaves_every_file_as_it_is() -> None:
    result = _ruff("format", "--check", ".")
    assert result.returncode == 0, f"run `ruff format .`:\n{result.stdout[-4000:]}"


def test_mypy_finds_no_type_errors() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_modules_stay_under_the_size_cap() -> None:
    sizes = {
        path: len(path.read_text().splitlines())
        for root in ("omniserve", "model_zoo", "processors")
        for path in (REPO_ROOT / root).rglob("*.py")
    }
    assert {
        str(p.relative_to(REPO_ROOT)): n for p, n in sizes.items() if n > MAX_MODULE_LINES
    } == {}


def test_the_gpu_checks_run_every_module_with_gpu_tests() -> None:
    """A GPU session runs ``scripts/gpu_checks.sh``: a module of ``gpu`` tests missing from its
    default groups would never run on a GPU."""
    script = (REPO_ROOT / "scripts" / "gpu_checks.sh").read_text()
    with_gpu_tests = {
        f"tests/{path.name}"
        for path in (REPO_ROOT / "tests").glob("test_*.py")
        if re.search(r"^@pytest\.mark\.gpu$", path.read_text(), re.MULTILINE)
    }
    assert with_gpu_tests, "no gpu tests found"
    assert {name for name in with_gpu_tests if name not in script} == set()
