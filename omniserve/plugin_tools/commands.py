"""What ``omniserve register-model``, ``unregister-model`` and ``models`` do (cli.py parses).

Bad input raises ``ValueError`` subclasses with one-line messages, and always before the registry
file is written, so a failed command leaves the file as it was. Overriding a built-in or an
entry-point architecture is deliberate: it needs ``--force``, and then the user file's entry
wins until ``unregister-model`` removes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from omniserve.plugin_tools.interface import PluginError, add_to_sys_path, validate_plugin
from omniserve.registry import USER_FILE_SOURCE, ModelRegistry
from omniserve.user_registry import (
    UserModel,
    read_user_registry,
    registry_file,
    write_user_registry,
)

Echo = Callable[[str], None]


def register_model(
    architecture: str,
    model: str,
    *,
    processor: str | None = None,
    path: str | None = None,
    force: bool = False,
    check: str | None = None,
    echo: Echo = print,
) -> bool:
    """Validate and record ``architecture``; with ``check``, only if the check passes.
    Returns False (nothing recorded) when the check fails."""
    if not architecture or architecture != architecture.strip() or " " in architecture:
        raise PluginError(f"ARCH {architecture!r} must be a name without spaces")
    _require_free(architecture, force)
    abs_path = add_to_sys_path(path)
    classes = validate_plugin(model, processor)
    if check is not None:
        from omniserve.plugin_tools.check import check_plugin

        report = check_plugin(architecture, check, model=model, processor=processor, path=abs_path)
        echo(report.table())
        if not report.passed:
            echo(f"{architecture} was not registered: fix the failed checks and run again.")
            return False
    models = read_user_registry()  # again: the check may have taken minutes
    models[architecture] = UserModel(model, processor, abs_path, classes.modalities)
    file = write_user_registry(models)
    inputs = "?" if classes.modalities is None else ", ".join(("text", *classes.modalities))
    echo(
        f"Registered {architecture} -> {model}"
        + (f" (processor {processor})" if processor else "")
        + f"; inputs: {inputs}; in {file}"
    )
    return True


def _require_free(architecture: str, force: bool) -> None:
    from omniserve.plugins import load_plugins

    models = read_user_registry()  # raises for an unreadable file, before anything else
    if force:
        return
    if architecture in models:
        raise PluginError(
            f"{architecture} is already in {registry_file()} ({models[architecture].model}); "
            "pass --force to replace it"
        )
    load_plugins()
    entry = ModelRegistry.get_code_entry(architecture)
    if entry is not None:
        raise PluginError(
            f"{architecture} is already registered ({entry.source}: {entry.target}); pass "
            f"--force to override it (your entry then wins until `omniserve unregister-model "
            f"{architecture}`)"
        )


def check_registered(architecture: str, checkpoint: str, *, echo: Echo = print) -> bool:
    """``register-model ARCH --check CKPT`` on an architecture that is already registered."""
    from omniserve.plugin_tools.check import check_plugin

    read_user_registry()  # a corrupt file is an error here too, not a silent skip
    report = check_plugin(architecture, checkpoint)
    echo(report.table())
    return report.passed


def unregister_model(architecture: str) -> str:
    """Remove a user-file entry; built-ins and entry points cannot be removed."""
    from omniserve.plugins import load_plugins

    models = read_user_registry()
    if architecture not in models:
        load_plugins()
        entry = ModelRegistry.get_code_entry(architecture)
        if entry is not None:
            raise PluginError(
                f"{architecture} comes from {entry.source}, not from {registry_file()}; only "
                "models added with `omniserve register-model` can be removed"
            )
        raise PluginError(f"{architecture} is not in {registry_file()}")
    del models[architecture]
    write_user_registry(models)
    load_plugins()
    restored = ModelRegistry.get_code_entry(architecture)
    suffix = f"; {restored.source} {restored.target} applies again" if restored else ""
    return f"Removed {architecture} from {registry_file()}{suffix}"


@dataclass(frozen=True)
class ModelRow:
    architecture: str
    target: str
    source: str
    inputs: str


def list_models() -> list[ModelRow]:
    """Every architecture as a lookup resolves it, with where it comes from and its inputs."""
    from omniserve.plugin_tools.interface import entry_modalities
    from omniserve.plugins import load_plugins

    read_user_registry()  # load_plugins only logs a corrupt file; listing it must fail loudly
    load_plugins()
    rows = []
    for entry in ModelRegistry.entries():
        source = entry.source
        overridden = ModelRegistry.get_code_entry(entry.architecture)
        if entry.source == USER_FILE_SOURCE and overridden is not None:
            source = f"{USER_FILE_SOURCE} (overrides {overridden.source})"
        target = entry.target + (f" + {entry.processor}" if entry.processor else "")
        rows.append(ModelRow(entry.architecture, target, source, entry_modalities(entry)))
    return rows


def format_rows(rows: list[ModelRow]) -> str:
    header = ModelRow("architecture", "class", "source", "inputs")
    table = [header, *rows]
    widths = [max(len(getattr(r, f)) for r in table) for f in ("architecture", "target", "source")]
    return "\n".join(
        f"{r.architecture:{widths[0]}}  {r.target:{widths[1]}}  {r.source:{widths[2]}}  {r.inputs}"
        for r in table
    )
