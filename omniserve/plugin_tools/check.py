"""``omniserve register-model ARCH --check CKPT``: validate a plugin on a real checkpoint.

Each step is a row of a pass/fail table, ordered from cheap and static to expensive:

1. interface — the classes import and implement every hook (``interface.py``);
2. per modality, on the dummy-inputs builder's worst-case items (two per prompt): the dummy inputs
   process; each item gets exactly one placeholder range; ``get_mm_max_tokens_per_item`` bounds
   the measured placeholder length;
3. the weights load with no missing or unexpected keys; the encoder's output rows equal each
   item's placeholder embeddings (what a wrong placeholder count breaks), and M-RoPE positions
   cover the prompt;
4. one request per modality (and one text-only) runs through a real engine (``check_runs.py``),
   and, when transformers knows the checkpoint's architecture, its greedy tokens and logprobs
   match transformers'.

A plugin being registered (``--model``) is checked before anything is recorded: it is put in a
temporary registry file (``OMNISERVE_CONFIG_DIR`` pointed at a temp dir for the duration), so
the spawned engine process finds it exactly as it will after registration. A checkpoint whose
config.json names another architecture (the family a plugin starts from) is checked through a
temporary view that names the plugin's.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omniserve import envs
from omniserve.plugin_tools import check_runs
from omniserve.plugin_tools.checkpoints import checkpoint_architecture, write_checkpoint_as
from omniserve.plugin_tools.interface import (
    PluginClasses,
    PluginError,
    add_to_sys_path,
    validate_plugin,
)
from omniserve.plugin_tools.report import CheckReport, ModalityCase
from omniserve.user_registry import UserModel, write_user_registry


def check_plugin(
    architecture: str,
    checkpoint: str | Path,
    *,
    model: str | None = None,
    processor: str | None = None,
    path: str | None = None,
    max_model_len: int = 4096,
    max_tokens: int = 8,
) -> CheckReport:
    """Validate ``architecture`` (registered, or the candidate ``model``/``processor``/``path``)
    on ``checkpoint``; the report's ``passed`` is False if any row failed."""
    checkpoint = Path(checkpoint).expanduser().resolve()
    source_architecture = checkpoint_architecture(checkpoint)
    candidate = None
    if model is not None:
        candidate = UserModel(model, processor, add_to_sys_path(path))
    report = CheckReport(architecture, str(checkpoint))
    try:
        classes = _plugin_classes(architecture, candidate)
    except PluginError as exc:
        report.add("interface", False, str(exc))
        return report
    report.add("interface", True, _describe(architecture, candidate, classes))
    with tempfile.TemporaryDirectory(prefix="omniserve-check-") as tmp:
        with _registered_for_check(architecture, candidate, Path(tmp) / "config"):
            model_dir = checkpoint
            if source_architecture != architecture:
                model_dir = write_checkpoint_as(
                    checkpoint, architecture, Path(tmp) / "view", link=True
                )
                report.add(
                    "checkpoint",
                    True,
                    f"config.json names {source_architecture}; "
                    f"checked as {architecture} through a view",
                )
            _run_checks(
                report,
                classes,
                model_dir,
                checkpoint,
                source_architecture,
                max_model_len,
                max_tokens,
            )
    return report


def _plugin_classes(architecture: str, candidate: UserModel | None) -> PluginClasses:
    if candidate is not None:
        return validate_plugin(candidate.model, candidate.processor)
    from omniserve.plugins import load_plugins
    from omniserve.registry import ModelRegistry

    load_plugins()
    entry = ModelRegistry.get_entry(architecture)
    if entry is None:
        raise ValueError(
            f"{architecture!r} is not registered; pass --model pkg.mod:Class to check a new plugin"
        )
    return validate_plugin(entry.target, entry.processor)


def _describe(architecture: str, candidate: UserModel | None, classes: PluginClasses) -> str:
    if candidate is not None:
        where = f"model {candidate.model}" + (
            f", processor {candidate.processor}" if candidate.processor else ""
        )
    else:
        where = f"registered {architecture}"
    modalities = classes.modalities
    shown = (
        "? (decided by the checkpoint)" if modalities is None else ", ".join(("text", *modalities))
    )
    return f"{where}; every hook implemented; inputs: {shown}"


@contextlib.contextmanager
def _registered_for_check(
    architecture: str, candidate: UserModel | None, config_dir: Path
) -> Iterator[None]:
    """Make a candidate visible to this process and to spawned engines, without touching the
    user's registry file: a temporary registry file holding only the candidate."""
    if candidate is None:
        yield
        return
    write_user_registry({architecture: candidate}, config_dir / "models.json")
    with envs.config_dir_override(config_dir):
        yield


def _run_checks(
    report: CheckReport,
    classes: PluginClasses,
    model_dir: Path,
    checkpoint: Path,
    source_architecture: str,
    max_model_len: int,
    max_tokens: int,
) -> None:
    from omniserve.config import ModelConfig
    from omniserve.tokenizer import get_tokenizer

    model_config = ModelConfig.from_path(str(model_dir))
    max_model_len = min(model_config.max_model_len, max_model_len)
    model_config = ModelConfig.from_path(str(model_dir), max_model_len=max_model_len)
    processor = None
    cases: list[ModalityCase] = []
    if classes.factories is not None:
        from omniserve.multimodal.registry import MULTIMODAL_REGISTRY

        try:
            processor = MULTIMODAL_REGISTRY.create_processor(
                model_config, get_tokenizer(model_config.tokenizer)
            )
        except Exception as exc:  # the plugin's info or processor constructor
            report.add("processor", False, f"cannot create it: {type(exc).__name__}: {exc}")
        else:
            cases = _processing_rows(report, processor, max_model_len)
    check_runs.model_rows(report, model_config, cases)
    if not report.passed:
        report.add("requests", None, "skipped: fix the failures above first")
        return
    check_runs.run_requests(
        report,
        model_dir,
        processor,
        checkpoint,
        source_architecture,
        max_model_len=max_model_len,
        max_tokens=max_tokens,
    )


def _processing_rows(report: CheckReport, processor: Any, seq_len: int) -> list[ModalityCase]:
    cases = []
    for modality, limit in processor.info.get_allowed_mm_limits().items():
        if limit == 0:
            continue
        case = ModalityCase(modality, 2 if limit is None else min(limit, 2))
        name = f"dummy inputs [{modality}]"
        try:
            case.inputs = processor.get_dummy_mm_inputs(seq_len, {modality: case.num_items})
        except Exception as exc:
            report.add(name, False, f"{type(exc).__name__}: {exc}")
            continue
        report.add(
            name,
            True,
            f"{case.num_items} items -> {len(case.inputs.prompt_token_ids)} prompt tokens",
        )
        case.features = list(case.inputs.mm_features)
        cases.append(case)
        report.add(f"placeholder ranges [{modality}]", *_range_problems(case))
        bound = processor.info.get_mm_max_tokens_per_item(seq_len, {modality: case.num_items})
        measured = max((f.mm_position.length for f in case.features), default=0)
        limit_tokens = bound.get(modality)
        report.add(
            f"max tokens per item [{modality}]",
            limit_tokens is not None and limit_tokens >= measured,
            f"get_mm_max_tokens_per_item gives {limit_tokens}, the dummy item measures {measured}",
        )
    return cases


def _range_problems(case: ModalityCase) -> tuple[bool, str]:
    """One non-empty range per item, in order, inside the prompt, not overlapping."""
    ranges = [f.mm_position for f in case.features]
    shown = ", ".join(f"[{r.offset}, {r.end})" for r in ranges)
    if any(f.modality != case.modality for f in case.features) or len(ranges) != case.num_items:
        return False, f"{case.num_items} {case.modality} items gave {len(ranges)} ranges: {shown}"
    num_tokens = len(case.inputs.prompt_token_ids)
    previous_end = 0
    for r in ranges:
        if r.length <= 0 or r.num_embeds <= 0 or r.offset < previous_end or r.end > num_tokens:
            return False, f"ranges {shown} are empty, overlap or leave the {num_tokens} tokens"
        previous_end = r.end
    return True, f"{case.num_items} items, one range each: {shown}"
