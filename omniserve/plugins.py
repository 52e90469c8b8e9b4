"""Load plugins from the ``omniserve.plugins`` entry-point group, and the user's registry file.

The built-in model zoo registers itself through this same group, so third-party models are
first-class. Every process that builds a model (the engine core too) calls ``load_plugins``:
entry points run once per process; the user's registry file (``omniserve register-model``) is
re-read whenever it changed, so a model registered from a notebook or a second shell is seen by
the next engine started in a long-lived process, and a spawned engine process sees the same file
as its parent.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from importlib.metadata import entry_points
from pathlib import Path

from omniserve.registry import ModelRegistry

logger = logging.getLogger(__name__)

PLUGIN_GROUP = "omniserve.plugins"
BUILTIN_PLUGIN = "builtin"
_entry_points_loaded = False
_user_file_state: tuple[str, int, int, int] | None = None
"""(path, inode, mtime_ns, size) of the registry file last read; size -1 when it was absent."""


def load_plugins() -> None:
    """Call every registered plugin function once and sync the user's registry file.

    Idempotent and cheap after the first call (one ``stat``); a broken plugin or an unreadable
    registry file is logged and skipped, so one bad plugin never takes the server down.
    """
    _load_entry_points()
    _load_user_registry()


def run_plugin_file(path: str, flag: str) -> None:
    """Run a parser plugin file (``--tool-parser-plugin``, ``--reasoning-parser-plugin``),
    which registers what it defines; ValueError naming the flag and file when it is missing or
    raises."""
    file = Path(path).expanduser()
    spec = importlib.util.spec_from_file_location(f"omniserve_plugin_{file.stem}", file)
    if not file.is_file() or spec is None or spec.loader is None:
        raise ValueError(f"{flag} {path}: not a Python file.")
    try:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except Exception as exc:
        raise ValueError(f"{flag} {path} failed to load: {exc!r}") from exc


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    found = entry_points(group=PLUGIN_GROUP)
    if BUILTIN_PLUGIN not in {ep.name for ep in found}:
        # Running from a source tree that was never installed: still register the zoo.
        import model_zoo

        model_zoo.register()
    for ep in found:
        source = "built-in" if ep.name == BUILTIN_PLUGIN else f"entry point {ep.name}"
        try:
            with ModelRegistry.registering_as(source):
                ep.load()()
        except Exception:
            logger.exception("omniserve plugin %r (%s) failed to load", ep.name, ep.value)


def _load_user_registry() -> None:
    global _user_file_state
    from omniserve.user_registry import (
        UserRegistryError,
        read_user_registry,
        registry_file,
    )

    path = registry_file()
    state = _file_state(path)
    if state == _user_file_state:
        return
    _user_file_state = state
    try:
        models = read_user_registry(path)
    except UserRegistryError as exc:
        logger.error("Ignoring the user's registered models: %s", exc)
        models = {}
    for model in models.values():
        if model.path and model.path not in sys.path:
            # Like a PYTHONPATH entry: ahead of site-packages, so the user's package wins.
            sys.path.insert(0, model.path)
    ModelRegistry.set_user_entries(model.to_entry(arch) for arch, model in models.items())


def _file_state(path: Path) -> tuple[str, int, int, int]:
    try:
        stat = path.stat()
    except OSError:
        return (str(path), 0, 0, -1)
    # Atomic writes replace the inode, so a rewrite within the clock's resolution still shows.
    return (str(path), stat.st_ino, stat.st_mtime_ns, stat.st_size)
