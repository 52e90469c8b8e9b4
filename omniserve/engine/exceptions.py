"""Errors the front end raises about the engine core (as opposed to errors in a request's input)."""

from __future__ import annotations


class EngineGenerateError(Exception):
    """One request failed inside the engine; the engine itself is still healthy."""


class UnsatisfiableRequestError(ValueError):
    """The engine ended one request because the request's own rules left it no token to
    sample: the client's to fix (HTTP 400); the engine is healthy."""


class EngineStoppingError(Exception):
    """The engine is being stopped on purpose (the server is shutting down): in-flight requests
    end with this, and new ones are refused with it."""


class EngineSleepingError(Exception):
    """The engine sleeps (``sleep``): requests are refused until ``wake_up`` (HTTP 503)."""


SLEEPING = "The engine is asleep (sleep mode): wake_up() before sending requests."


class EngineDeadError(Exception):
    """The engine core process is gone. Every in-flight and later call fails with this; a new
    engine must be started."""

    def __init__(self, message: str = "The engine core process died unexpectedly.") -> None:
        super().__init__(message)


class EngineStartupError(RuntimeError):
    """The engine core process failed while starting (loading the model, sizing the KV cache).

    The message carries the child's traceback, so the cause is visible in the parent.
    """
