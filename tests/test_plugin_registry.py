"""The model registry and its CLI: `omniserve register-model`, `unregister-model` and `models`,
run in process against a private registry file (OMNISERVE_CONFIG_DIR = tmp_path), good and bad
input alike; and a registered plugin running inside the spawned engine process."""

from __future__ import annotations

import itertools
import json
import logging
import os
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from omniserve.entrypoints.cli import main
from omniserve.plugin_tools.checkpoints import tiny_checkpoint_as
from omniserve.plugins import load_plugins
from omniserve.registry import ModelRegistry
from omniserve.user_registry import read_user_registry

FORCED_TOKEN = 42
_module_ids = itertools.count()

TEXT_PLUGIN = f"""
from model_zoo.qwen2 import Qwen2ForCausalLM


class ForcedLM(Qwen2ForCausalLM):
    # Every logit row peaks at one token, so its outputs prove this class ran.
    def compute_logits(self, hidden_states):
        logits = super().compute_logits(hidden_states)
        logits[:, {FORCED_TOKEN}] += 1e4
        return logits


class NoWeights:
    pass
"""
BROKEN_PLUGIN = """
import torch


class HalfModel(torch.nn.Module):
    def forward(self, input_ids, positions, inputs_embeds=None):
        return input_ids
"""
VL_PLUGIN = """
from model_zoo.qwen2_vl import Qwen2VLForConditionalGeneration
from processors.qwen2_vl import (
    Qwen2VLDummyInputsBuilder,
    Qwen2VLMultiModalProcessor,
    Qwen2VLProcessingInfo,
)


class VL(Qwen2VLForConditionalGeneration):
    pass


class Processor(Qwen2VLMultiModalProcessor):
    info_cls = Qwen2VLProcessingInfo
    dummy_inputs_cls = Qwen2VLDummyInputsBuilder


class NoCompanions(Qwen2VLMultiModalProcessor):
    pass
"""


@pytest.fixture(autouse=True)
def config_dir(tmp_path, monkeypatch) -> Iterator[Path]:
    """A private registry dir, so no test reads or writes the user's real one."""
    path = tmp_path / "config"
    monkeypatch.setenv("OMNISERVE_CONFIG_DIR", str(path))
    yield path
    # Forget this test's user-file models even if it failed half-way (e.g. an overridden
    # built-in); the next load_plugins() reads whatever file is current then.
    ModelRegistry.set_user_entries([])


def _plugin(tmp_path: Path, source: str) -> tuple[str, Path]:
    """Write ``source`` as a uniquely named module under tmp_path/src; (module, src dir)."""
    module = f"omniserve_test_plugin_{os.getpid()}_{next(_module_ids)}"
    src = tmp_path / "src"
    src.mkdir(parents=True, exist_ok=True)
    (src / f"{module}.py").write_text(textwrap.dedent(source))
    return module, src


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _models(capsys) -> dict[str, dict[str, str]]:
    """`omniserve models` as architecture -> {"class", "source", "inputs"}."""
    code, out, err = _run(capsys, "models")
    assert code == 0, err
    header, *lines = out.splitlines()
    starts = [header.index(column) for column in ("class", "source", "inputs")]
    rows = {}
    for line in lines:
        cells = [line[a:b].strip() for a, b in zip([0, *starts], [*starts, None], strict=True)]
        rows[cells[0]] = dict(zip(("class", "source", "inputs"), cells[1:], strict=True))
    return rows


def _registry_bytes(config_dir: Path) -> bytes | None:
    file = config_dir / "models.json"
    return file.read_bytes() if file.exists() else None


def test_register_list_unregister(tmp_path, capsys, config_dir):
    module, src = _plugin(tmp_path, TEXT_PLUGIN)
    code, out, err = _run(
        capsys, "register-model", "ForcedLM", "--model", f"{module}:ForcedLM", "--path", str(src)
    )
    assert code == 0, err
    assert "Registered ForcedLM" in out and "inputs: text" in out
    saved = json.loads((config_dir / "models.json").read_text())
    assert saved == {
        "version": 1,
        "models": {
            "ForcedLM": {
                "model": f"{module}:ForcedLM",
                "processor": None,
                "path": str(src.resolve()),
                "modalities": [],
            }
        },
    }
    rows = _models(capsys)
    assert rows["ForcedLM"] == {
        "class": f"{module}:ForcedLM",
        "source": "user file",
        "inputs": "text",
    }
    assert rows["Qwen2VLForConditionalGeneration"]["inputs"] == "text, image, video"
    assert rows["Qwen2ForCausalLM"]["source"] == "built-in"
    assert ModelRegistry.resolve_model_cls("ForcedLM").__name__ == "ForcedLM"

    code, out, err = _run(capsys, "unregister-model", "ForcedLM")
    assert code == 0, err
    assert "Removed ForcedLM" in out
    assert read_user_registry() == {}
    assert "ForcedLM" not in _models(capsys)
    with pytest.raises(ValueError, match="not supported"):
        ModelRegistry.resolve_model_cls("ForcedLM")


def test_register_with_a_processor(tmp_path, capsys):
    from omniserve.config import ModelConfig
    from omniserve.multimodal.registry import MULTIMODAL_REGISTRY

    module, src = _plugin(tmp_path, VL_PLUGIN)
    code, out, err = _run(
        capsys,
        "register-model",
        "MyVL",
        "--model",
        f"{module}:VL",
        "--processor",
        f"{module}:Processor",
        "--path",
        str(src),
    )
    assert code == 0, err
    assert "inputs: text, image, video" in out
    row = _models(capsys)["MyVL"]
    assert row["class"] == f"{module}:VL + {module}:Processor"
    assert row["inputs"] == "text, image, video"
    config = ModelConfig(model="unused", architecture="MyVL", max_model_len=64, tokenizer="unused")
    factories = MULTIMODAL_REGISTRY.get_factories(config)
    assert factories.processor.__name__ == "Processor"
    assert factories.info.__name__ == "Qwen2VLProcessingInfo"


# name -> (argv after "register-model", words the one-line error must contain)
BAD_REGISTRATIONS = {
    "no colon": (["X", "--model", "{module}"], "must look like 'package.module:Class'"),
    "unknown module": (["X", "--model", "no_such_pkg.mod:Cls"], "No module named 'no_such_pkg'"),
    "missing --path": (["X", "--model", "{module}:ForcedLM", "--no-path"], "pass --path"),
    "unknown class": (["X", "--model", "{module}:Nope"], "has no attribute 'Nope'"),
    "not a module": (["X", "--model", "{module}:NoWeights"], "is not a torch.nn.Module"),
    "missing hooks": (
        ["X", "--model", "{broken}:HalfModel"],
        "is missing compute_logits, load_weights, get_input_embeddings",
    ),
    "processor without companions": (
        ["X", "--model", "{vl}:VL", "--processor", "{vl}:NoCompanions"],
        "has no info_cls (a BaseProcessingInfo subclass)",
    ),
    "text model with a processor": (
        ["X", "--model", "{module}:ForcedLM", "--processor", "{vl}:Processor"],
        "is missing get_multimodal_embeddings, get_placeholder_str",
    ),
    "existing entry": (["Taken", "--model", "{module}:ForcedLM"], "pass --force to replace it"),
    "built-in": (
        ["Qwen2ForCausalLM", "--model", "{module}:ForcedLM"],
        "already registered (built-in: model_zoo.qwen2:Qwen2ForCausalLM); pass --force",
    ),
    "bad --path": (
        ["X", "--model", "{module}:ForcedLM", "--path", "/no/such/dir"],
        "is not a directory",
    ),
}


@pytest.mark.parametrize("case", list(BAD_REGISTRATIONS))
def test_bad_registration_is_one_line_and_leaves_the_file(case, tmp_path, capsys, config_dir):
    module, src = _plugin(tmp_path, TEXT_PLUGIN)
    broken, _ = _plugin(tmp_path, BROKEN_PLUGIN)
    vl, _ = _plugin(tmp_path, VL_PLUGIN)
    assert (
        _run(
            capsys, "register-model", "Taken", "--model", f"{module}:ForcedLM", "--path", str(src)
        )[0]
        == 0
    )
    before = _registry_bytes(config_dir)
    argv, expected = BAD_REGISTRATIONS[case]
    argv = [a.format(module=module, broken=broken, vl=vl) for a in argv]
    if "--no-path" in argv:  # a module no sys.path entry reaches
        argv.remove("--no-path")
        fresh, _ = _plugin(tmp_path / "elsewhere", TEXT_PLUGIN)
        argv[2] = f"{fresh}:ForcedLM"
    elif "--path" not in argv:
        argv += ["--path", str(src)]
    code, out, err = _run(capsys, "register-model", *argv)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("omniserve: error: "), err
    assert expected in err
    assert _registry_bytes(config_dir) == before


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b'{"version": 99, "models": {}}',
        b'{"version": 1, "models": {"A": {"model": "a:B", "path": 3}}}',
    ],
)
def test_unreadable_registry_file(content, tmp_path, capsys, config_dir, caplog):
    module, src = _plugin(tmp_path, TEXT_PLUGIN)
    config_dir.mkdir()
    (config_dir / "models.json").write_bytes(content)
    for argv in (
        ["models"],
        ["unregister-model", "A"],
        ["register-model", "A", "--model", f"{module}:ForcedLM", "--path", str(src)],
    ):
        code, _, err = _run(capsys, *argv)
        assert code == 2 and err.count("\n") == 1, err
        assert "models.json" in err
        assert (config_dir / "models.json").read_bytes() == content
    # Serving is not blocked by a broken file: load_plugins logs it and keeps the built-ins.
    with caplog.at_level(logging.ERROR, logger="omniserve.plugins"):
        load_plugins()
    assert "models.json" in caplog.text
    assert ModelRegistry.is_supported("Qwen2ForCausalLM")


def test_force_replaces_and_overrides_a_builtin(tmp_path, capsys):
    module, src = _plugin(tmp_path, TEXT_PLUGIN)
    vl, _ = _plugin(tmp_path, VL_PLUGIN)
    path = ["--path", str(src)]
    assert _run(capsys, "register-model", "Mine", "--model", f"{module}:ForcedLM", *path)[0] == 0
    assert _run(capsys, "register-model", "Mine", "--model", f"{vl}:VL", "--force", *path)[0] == 0
    assert read_user_registry()["Mine"].model == f"{vl}:VL"
    assert read_user_registry()["Mine"].modalities == ("image", "video")

    code, _, err = _run(
        capsys,
        "register-model",
        "Qwen2ForCausalLM",
        "--model",
        f"{module}:ForcedLM",
        "--force",
        *path,
    )
    assert code == 0, err
    assert _models(capsys)["Qwen2ForCausalLM"]["source"] == "user file (overrides built-in)"
    assert ModelRegistry.resolve_model_cls("Qwen2ForCausalLM").__name__ == "ForcedLM"
    code, out, _ = _run(capsys, "unregister-model", "Qwen2ForCausalLM")
    assert code == 0 and "built-in model_zoo.qwen2:Qwen2ForCausalLM applies again" in out
    assert ModelRegistry.resolve_model_cls("Qwen2ForCausalLM").__module__ == "model_zoo.qwen2"


def test_failed_write_leaves_the_old_file(tmp_path, capsys, config_dir, monkeypatch):
    module, src = _plugin(tmp_path, TEXT_PLUGIN)
    assert (
        _run(capsys, "register-model", "A", "--model", f"{module}:ForcedLM", "--path", str(src))[0]
        == 0
    )
    before = _registry_bytes(config_dir)

    def no_replace(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_replace)
    code, _, err = _run(
        capsys, "register-model", "B", "--model", f"{module}:ForcedLM", "--path", str(src)
    )
    assert code == 2 and "No space left on device" in err
    assert _registry_bytes(config_dir) == before
    assert sorted(p.name for p in config_dir.iterdir()) == ["models.json"]  # no temp file left


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["unregister-model", "Qwen2ForCausalLM"], "comes from built-in"),
        (["unregister-model", "NoSuchArch"], "NoSuchArch is not in"),
        (["register-model"], "needs ARCH"),
        (["register-model", "X"], "pass --model pkg.mod:Class to register ARCH, or --check"),
        (["register-model", "X", "--processor", "a.b:C"], "--processor goes with --model"),
        (["register-model", "X", "--out", "d"], "--out goes with --scaffold"),
        (["register-model", "--scaffold", "pkg"], "--scaffold NAME needs --out DIR"),
        (
            ["register-model", "--scaffold", "pkg", "--out", "d", "--model", "a:B"],
            "--model does not go with --scaffold",
        ),
        (["register-model", "--scaffold", "Bad-Name", "--out", "d"], "lowercase Python package"),
        (
            ["register-model", "--scaffold", "pkg", "--out", "d", "--from", "NoSuchArch"],
            "--from NoSuchArch: not a registered architecture",
        ),
        (["register-model", "NoSuchArch", "--check", "{ckpt}"], "'NoSuchArch' is not registered"),
        (
            ["register-model", "Qwen2ForCausalLM", "--check", "/no/such/ckpt"],
            "config.json is missing",
        ),
    ],
)
def test_usage_errors(argv, expected, capsys, tmp_path, tiny_checkpoint):
    argv = [a.format(ckpt=tiny_checkpoint("Qwen2ForCausalLM")) for a in argv]
    code, _, err = _run(capsys, *argv)
    assert code == 2 and err.count("\n") == 1, err
    assert expected in err
    assert not (tmp_path / "d").exists()


def test_builtin_modalities_match_their_processors():
    """`omniserve models` reads the zoo's declared modalities without importing torch; they
    must be what each processor's get_supported_mm_limits says."""
    from omniserve.plugin_tools.interface import validate_plugin

    load_plugins()
    for entry in ModelRegistry.entries():
        if entry.source == "built-in":
            assert validate_plugin(entry.target).modalities == entry.modalities, entry


def test_make_tiny_as_architecture(tmp_path, capsys):
    out = tmp_path / "ckpt"
    code, printed, err = _run(
        capsys, "make-tiny", "Qwen2ForCausalLM", "--as-architecture", "ForcedLM", "--out", str(out)
    )
    assert code == 0, err
    assert printed.strip() == str(out)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["ForcedLM"]
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors").is_symlink()


@pytest.mark.slow
def test_registered_plugin_runs_inside_the_engine_process(tmp_path, capsys, monkeypatch):
    """The engine core is a spawned process: it finds the plugin only by reading the registry
    file (and its recorded --path) itself; the forced token proves the plugin's code ran."""
    from omniserve import LLM, SamplingParams

    monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "1")  # the suite's default is 0

    module, src = _plugin(tmp_path, TEXT_PLUGIN)
    assert (
        _run(
            capsys,
            "register-model",
            "ForcedLM",
            "--model",
            f"{module}:ForcedLM",
            "--path",
            str(src),
        )[0]
        == 0
    )
    checkpoint = tiny_checkpoint_as("Qwen2ForCausalLM", "ForcedLM")
    llm = LLM(str(checkpoint), dtype="float32", max_model_len=256, max_num_seqs=2)
    try:
        assert type(llm.llm_engine.engine_core).__name__ == "SyncMPClient"
        out = llm.generate("Hello", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[
            0
        ]
    finally:
        llm.shutdown()
    assert out.outputs[0].token_ids == [FORCED_TOKEN] * 4
