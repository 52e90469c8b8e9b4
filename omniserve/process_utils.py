"""Process helpers shared by the engine-core launcher and the tensor-parallel executor: how
children are spawned, and what a child does when its parent dies."""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import os
import sys
import threading
from collections.abc import Callable, Iterator


def spawn_context() -> multiprocessing.context.SpawnContext:
    """Children are spawned, never forked: fork is unsafe with CUDA and threads."""
    return multiprocessing.get_context("spawn")


@contextlib.contextmanager
def spawning(env: dict[str, str] | None = None) -> Iterator[None]:
    """Start children inside this: they inherit ``os.environ`` with ``env`` on top (as it is at
    that moment; callers start their children from one thread), and spawn does not re-run the
    user's script in them."""
    with _skip_main_reimport(), _environ(env or {}):
        yield


def on_parent_death(callback: Callable[[], None]) -> None:
    """Run ``callback`` on a daemon thread once this process's multiprocessing parent dies (a
    parent killed without cleanup must not leave its children behind); nothing without one."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        callback()

    threading.Thread(target=watch, name="omniserve-parent-watch", daemon=True).start()


@contextlib.contextmanager
def _environ(overrides: dict[str, str]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _skip_main_reimport() -> Iterator[None]:
    """spawn re-imports a script's ``__main__`` in the child, which re-runs unguarded top-level
    code (``LLM(...)`` without ``if __name__ == "__main__":``) and fails there. Children need
    nothing from ``__main__``; hiding its ``__file__`` while they are prepared makes spawn treat
    it like an interactive session's ``__main__``."""
    main = sys.modules["__main__"]
    main_file = getattr(main, "__file__", None)
    if main_file is None or getattr(main, "__spec__", None) is not None:
        yield  # interactive, or run with -m (spawn already skips a package's __main__)
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = main_file
