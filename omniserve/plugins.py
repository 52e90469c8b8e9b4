"""Load plugins from the ``omniserve.plugins`` entry-point group, once per process.

The built-in model zoo registers itself through this same group, so third-party models are
first-class. Every process that builds a model (the engine core too) calls ``load_plugins``.
"""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

logger = logging.getLogger(__name__)

PLUGIN_GROUP = "omniserve.plugins"
_loaded = False


def load_plugins() -> None:
    """Call every registered plugin function. Idempotent; a broken plugin is logged and skipped."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    found = entry_points(group=PLUGIN_GROUP)
    names = {ep.name for ep in found}
    if "builtin" not in names:
        # Running from a source tree that was never installed: still register the zoo.
        import model_zoo

        model_zoo.register()
    for ep in found:
        try:
            ep.load()()
        except Exception:
            logger.exception("omniserve plugin %r (%s) failed to load", ep.name, ep.value)
