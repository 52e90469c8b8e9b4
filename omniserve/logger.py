"""omniserve's log output: INFO lines (load progress, the ready line, the CPU backend's report)
on stderr, as vLLM prints them, unless the application configures logging itself."""

from __future__ import annotations

import logging

from omniserve import envs


def configure_logging() -> None:
    """Give the ``omniserve`` logger a stderr handler at ``OMNISERVE_LOGGING_LEVEL`` (INFO).

    Nothing happens when ``OMNISERVE_CONFIGURE_LOGGING=0`` or when the root logger already has
    handlers (the application's, or pytest's): records still propagate to them.
    """
    logger = logging.getLogger("omniserve")
    if not envs.configure_logging() or logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%m-%d %H:%M:%S")
    )
    logger.addHandler(handler)
    logger.setLevel(envs.logging_level())
