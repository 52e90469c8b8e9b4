"""The scheduler side is pure Python: importing it must not pull in torch (style.md 7.4)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

TORCH_FREE_MODULES = (
    "omniserve.core.scheduler",
    "omniserve.core.kv_cache_manager",
    "omniserve.core.block_pool",
    "omniserve.messages",
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


# --- import directions -----------------------------------------------------------------------

LAYERS: dict[str, int] = {
    # foundations: import no other unit (or only envs)
    "envs": 0, "config": 0, "field_types": 0, "registry": 0, "tokenizer": 0, "outputs": 0,
    "triton_utils": 0, "process_utils": 0, "transfers": 0,
    "logger": 1, "user_registry": 1, "forward_context": 1, "sampling_params": 1,
    "structured_output": 2, "logits_processor": 2,
    "plugins": 2, "attention": 2,
    "__init__": 2,  # the package: eagerly it imports logger alone (its public names are lazy)
    # inputs and the types that cross stage and process boundaries
    "multimodal": 3, "lora": 3,
    "inputs": 4, "messages": 4, "processors": 4,
    # the scheduler side and the model side, independent of each other
    "core": 5, "layers": 5, "metrics": 5, "tracing": 5, "spec_decode": 5,
    "cpu": 6, "cuda": 6,
    "model_zoo": 7,
    "worker": 8,
    "executor": 9,
    "engine": 10,
    "entrypoints": 11,
}  # fmt: skip
"""Each unit of the serving import graph (a subpackage or top-level module of omniserve, and the
model_zoo and processors packages) imports only units of lower layers."""
TOOLING = {"checkpoint_builder", "plugin_tools", "demo_model"}
"""Units the server never imports: only other tooling, and the CLI's commands (inside their
functions), may import them."""
ALLOWED_UPWARD = {("plugins", "model_zoo")}
"""plugins imports the built-in plugin (model_zoo) when running from a source tree that was
never installed: the same call its entry point makes."""
ROOTS = ("omniserve", "model_zoo", "processors")


def _unit(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "omniserve":
        return parts[0]
    return parts[1] if len(parts) > 1 else "__init__"


def _root_name(name: str) -> str:
    """``from omniserve import name``: a submodule, or a name the package itself exports."""
    package = REPO_ROOT / "omniserve"
    is_module = (package / f"{name}.py").exists() or (package / name).is_dir()
    return f"omniserve.{name}" if is_module else "omniserve"


def _imports(path: Path) -> list[tuple[ast.stmt, str, bool]]:
    """(node, imported module, inside a function) for every import outside TYPE_CHECKING."""
    found: list[tuple[ast.stmt, str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # annotations only
            if isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                names = (
                    [_root_name(a.name) for a in child.names]
                    if child.module == "omniserve"
                    else [child.module]
                )
                found.extend((child, name, in_function) for name in names)
            elif isinstance(child, ast.Import):
                found.extend((child, alias.name, in_function) for alias in child.names)
            visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    visit(ast.parse(path.read_text()), False)
    return [(node, name, fn) for node, name, fn in found if name.split(".")[0] in ROOTS]


def test_imports_run_down_the_layers() -> None:
    wrong = []
    for root in ROOTS:
        for path in sorted((REPO_ROOT / root).rglob("*.py")):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            source = _unit(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
            for node, module, in_function in _imports(path):
                target = _unit(module)
                where = f"{path.relative_to(REPO_ROOT)}:{node.lineno} imports {module}"
                if target == source or (source, target) in ALLOWED_UPWARD:
                    continue
                if source in TOOLING:
                    continue
                if target in TOOLING:
                    if not (path.name == "cli.py" and source == "entrypoints" and in_function):
                        wrong.append(f"{where}: tooling, which the server never imports")
                    continue
                for unit in (source, target):
                    if unit not in LAYERS:
                        wrong.append(f"{where}: place unit {unit!r} in LAYERS (or TOOLING)")
                if source in LAYERS and target in LAYERS and LAYERS[target] >= LAYERS[source]:
                    wrong.append(f"{where}: layer {LAYERS[target]} from layer {LAYERS[source]}")
    assert wrong == []
