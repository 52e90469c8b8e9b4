"""`omniserve register-model --check` on a plugin whose processor puts one placeholder token too
few per item: the check names the failing rows, exits 1 and records nothing; the same plugin,
registered without the check, fails `--check` alone in the same way. (A passing check, through a
spawned engine and against transformers, runs in test_plugin_scaffold.py.)"""

from __future__ import annotations

import json
import textwrap

from omniserve.entrypoints.cli import main
from omniserve.plugin_tools.report import CheckReport, CheckRow

ARCH = "OffByOneVL"
PLUGIN = """
from model_zoo.qwen2_vl import Qwen2VLForConditionalGeneration
from omniserve.multimodal.processing import PromptReplacement
from omniserve.multimodal.registry import MULTIMODAL_REGISTRY
from processors.qwen2_vl import (
    Qwen2VLDummyInputsBuilder,
    Qwen2VLMultiModalProcessor,
    Qwen2VLProcessingInfo,
)


class OffByOneProcessor(Qwen2VLMultiModalProcessor):
    # Each item's placeholder gets one token fewer than the vision tower returns embeddings.
    def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_items):
        updates = super()._get_prompt_updates(mm_items, hf_processor_mm_kwargs, out_items)
        return [PromptReplacement(u.modality, u.target, lambda i, u=u: u.replacement(i)[:-1])
                for u in updates]


@MULTIMODAL_REGISTRY.register_processor(
    OffByOneProcessor, info=Qwen2VLProcessingInfo, dummy_inputs=Qwen2VLDummyInputsBuilder
)
class OffByOneVL(Qwen2VLForConditionalGeneration):
    pass
"""


def check_rows(stdout: str) -> dict[str, tuple[str, str]]:
    """The printed table as row name -> (status, detail)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["check", "result"])
    header = lines[start]
    status_at, detail_at = header.index("result"), header.index("detail")
    rows = {}
    for line in lines[start + 1 :]:
        if not line.startswith("  "):
            break
        rows[line[:status_at].strip()] = (
            line[status_at:detail_at].strip(),
            line[detail_at:].strip(),
        )
    return rows


def _assert_placeholder_failure(stdout: str) -> None:
    rows = check_rows(stdout)
    assert rows["interface"][0] == "PASS"
    assert rows["checkpoint"][0] == "PASS"  # the Qwen2-VL checkpoint, seen as OffByOneVL
    # The processor alone cannot tell: ranges are well formed and under the analytic bound ...
    assert rows["placeholder ranges [image]"][0] == "PASS"
    assert rows["max tokens per item [image]"][0] == "PASS"
    assert rows["weights load"][0] == "PASS"
    # ... the encoder's output is what exposes the wrong count.
    assert rows["encoder vs placeholders [image]"] == (
        "FAIL",
        "placeholder embeds per item [112, 112], encoder rows [113, 113]",
    )
    assert rows["encoder vs placeholders [video]"][0] == "FAIL"
    assert rows["M-RoPE positions [image]"][0] == "FAIL"
    assert rows["requests"] == ("SKIP", "skipped: fix the failures above first")
    assert "the plugin FAILS." in stdout


def test_check_catches_a_wrong_placeholder_count(tmp_path, monkeypatch, capsys, tiny_checkpoint):
    config_dir = tmp_path / "config"
    monkeypatch.setenv("OMNISERVE_CONFIG_DIR", str(config_dir))
    src = tmp_path / "src"
    src.mkdir()
    (src / "offbyone_plugin.py").write_text(textwrap.dedent(PLUGIN))
    checkpoint = str(tiny_checkpoint("Qwen2VLForConditionalGeneration"))
    register = ["register-model", ARCH, "--model", f"offbyone_plugin:{ARCH}", "--path", str(src)]

    assert main([*register, "--check", checkpoint]) == 1
    out = capsys.readouterr().out
    _assert_placeholder_failure(out)
    assert f"{ARCH} was not registered" in out
    assert not (config_dir / "models.json").exists()

    # Without --check only the interface is checked, which this plugin fulfils ...
    assert main(register) == 0
    capsys.readouterr()
    assert ARCH in json.loads((config_dir / "models.json").read_text())["models"]
    # ... and `--check` alone then validates the registered entry.
    assert main(["register-model", ARCH, "--check", checkpoint]) == 1
    _assert_placeholder_failure(capsys.readouterr().out)


def test_report_table_and_verdict():
    report = CheckReport("Arch", "/ckpt")
    assert report.add("interface", True, "fine")
    assert report.add("matches transformers", None, "transformers has no Arch class")
    assert report.passed
    assert not report.add("weights load", False, "2 parameter(s)\nwere not loaded")
    assert not report.passed
    assert report.row("weights load") == CheckRow(
        "weights load", "FAIL", "2 parameter(s) were not loaded"
    )
    assert report.table().splitlines() == [
        "Arch on /ckpt",
        "  check                 result  detail",
        "  interface             PASS    fine",
        "  matches transformers  SKIP    transformers has no Arch class",
        "  weights load          FAIL    2 parameter(s) were not loaded",
        "1 passed, 1 failed, 1 skipped: the plugin FAILS.",
    ]
