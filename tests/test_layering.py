"""The scheduler side is pure Python: importing it must not pull in torch (style.md 7.4)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

TORCH_FREE_MODULES = (
    "omniserve.core.scheduler",
    "omniserve.core.kv_cache_manager",
    "omniserve.core.block_pool",
    "omniserve.engine.messages",
)


def test_core_imports_leave_torch_unloaded() -> None:
    code = "; ".join(
        [
            "import sys",
            *(f"import {module}" for module in TORCH_FREE_MODULES),
            "loaded = sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules)",
            "print(','.join(loaded))",
        ]
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert "torch" not in result.stdout.strip().split(",")
    assert result.stdout.strip() == "", f"heavy modules imported: {result.stdout.strip()}"
