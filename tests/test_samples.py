"""The sample notebooks run clean top to bottom in a fresh kernel (CPU, offline), and are stored
in git without outputs."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

SAMPLES = Path(__file__).resolve().parents[1] / "samples"
NOTEBOOKS = sorted(SAMPLES.glob("*.ipynb"))
CELL_TIMEOUT_S = 300


def test_the_three_samples_exist():
    assert [p.name for p in NOTEBOOKS] == [
        "01_offline_multimodal.ipynb",
        "02_online_openai.ipynb",
        "03_custom_plugin.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]
    assert nb.metadata.kernelspec.name == "python3"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_clean(path, tmp_path, monkeypatch):
    # The kernel inherits the suite's environment: offline Hugging Face, the shared checkpoint
    # cache, and here a private registry dir, so no notebook sees the user's registered models.
    monkeypatch.setenv("OMNISERVE_CONFIG_DIR", str(tmp_path / "config"))
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error
    errors = [
        out for cell in nb.cells for out in cell.get("outputs", []) if out.output_type == "error"
    ]
    assert errors == []
