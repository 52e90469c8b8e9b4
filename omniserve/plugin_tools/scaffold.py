"""``omniserve register-model --scaffold NAME --out DIR [--from ARCH]``: a plugin package to edit.

The package subclasses a registered model (and its processor classes), so it runs and passes
``--check`` unchanged on a checkpoint of the family it starts from; the user then edits the
hooks that differ. Files: pyproject.toml (the "omniserve.plugins" entry point), README.md,
``NAME/__init__.py`` (``register``), ``NAME/model.py``, ``NAME/processor.py`` (multimodal bases
only) and ``tests/test_NAME.py`` (runs the check on a tiny checkpoint).
"""

from __future__ import annotations

import keyword
import re
import shutil
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from omniserve.plugin_tools import scaffold_templates as templates
from omniserve.plugin_tools.interface import PluginClasses, PluginError, validate_plugin

DEFAULT_BASE_ARCHITECTURE = "Qwen2VLForConditionalGeneration"
_LINE_LENGTH = 100


@dataclass(frozen=True)
class ScaffoldResult:
    project_dir: Path
    architecture: str
    files: list[Path]
    """Relative to ``project_dir``."""


def scaffold_plugin(
    name: str,
    out_dir: str | Path,
    *,
    base_architecture: str = DEFAULT_BASE_ARCHITECTURE,
    architecture: str | None = None,
) -> ScaffoldResult:
    """Write the package into ``out_dir`` (new or empty), all files or none."""
    from omniserve.plugins import load_plugins
    from omniserve.registry import ModelRegistry

    if not re.fullmatch(r"[a-z_][a-z0-9_]*", name) or keyword.iskeyword(name):
        raise PluginError(f"NAME {name!r} must be a lowercase Python package name, e.g. my_vlm")
    load_plugins()
    base = ModelRegistry.get_entry(base_architecture)
    if base is None:
        raise PluginError(
            f"--from {base_architecture}: not a registered architecture (see `omniserve models`)"
        )
    prefix = "".join(part.capitalize() for part in name.split("_") if part)
    architecture = architecture or prefix + _architecture_suffix(base_architecture)
    if not architecture.isidentifier() or ModelRegistry.is_supported(architecture):
        raise PluginError(
            f"{architecture!r} must be a new architecture name (a Python identifier that is not "
            "registered yet)"
        )
    out = Path(out_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PluginError(f"--out {out} exists and is not an empty directory")
    classes = validate_plugin(base.target, base.processor)
    files = _render(name, prefix, architecture, base_architecture, classes)
    _write_all(out, files)
    return ScaffoldResult(out, architecture, sorted(Path(p) for p in files))


def _architecture_suffix(base_architecture: str) -> str:
    """The part from "For": Qwen2VLForConditionalGeneration -> ForConditionalGeneration."""
    index = base_architecture.find("For")
    return base_architecture[index:] if index > 0 else "ForCausalLM"


def _render(
    name: str, prefix: str, architecture: str, base_architecture: str, classes: PluginClasses
) -> dict[str, str]:
    model_cls, factories = classes.model_cls, classes.factories
    values = {
        "name": name,
        "dist_name": name.replace("_", "-"),
        "prefix": prefix,
        "architecture": architecture,
        "base_arch": base_architecture,
        "base_class": model_cls.__name__,
        "model_imports": _imports({model_cls.__module__: [model_cls.__name__]}),
        "common_methods": templates.COMMON_METHODS,
    }
    files = {
        "pyproject.toml": templates.PYPROJECT.substitute(values),
        "README.md": templates.README.substitute(values),
        f"{name}/__init__.py": templates.INIT.substitute(values),
        f"tests/test_{name}.py": templates.TEST.substitute(values),
    }
    if factories is None:
        files[f"{name}/model.py"] = templates.MODEL_TEXT.substitute(values)
        return files
    modules: dict[str, list[str]] = defaultdict(list)
    modules["omniserve.multimodal.parse"].append("MultiModalDataItems")
    modules["omniserve.multimodal.processing"] += ["MultiModalFieldConfig", "PromptUpdate"]
    for cls in (factories.info, factories.dummy_inputs, factories.processor):
        modules[cls.__module__].append(cls.__name__)
    values.update(
        processor_imports=_imports(modules),
        info_base=factories.info.__name__,
        dummy_base=factories.dummy_inputs.__name__,
        processor_base=factories.processor.__name__,
    )
    files[f"{name}/model.py"] = templates.MODEL_MULTIMODAL.substitute(values)
    files[f"{name}/processor.py"] = templates.PROCESSOR.substitute(values)
    return files


def _imports(modules: dict[str, list[str]]) -> str:
    """isort-ordered ``from module import names`` lines, wrapped as ruff formats them."""
    lines = []
    for module in sorted(modules):
        names = sorted(set(modules[module]))
        line = f"from {module} import {', '.join(names)}"
        if len(line) > _LINE_LENGTH:
            line = f"from {module} import (\n" + "".join(f"    {n},\n" for n in names) + ")"
        lines.append(line)
    return "\n".join(lines)


def _write_all(out: Path, files: dict[str, str]) -> None:
    """Build next to ``out`` and move into place, so a failure leaves nothing half-written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for relative, text in files.items():
            path = staging / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        if out.exists():
            out.rmdir()  # empty, checked above
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
