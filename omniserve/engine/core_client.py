"""EngineCoreClient: how a front end talks to its engine cores.

``InprocClient`` runs the core in the caller's process and steps it on demand (tests, debugging,
``OMNISERVE_ENABLE_MULTIPROCESSING=0``); the clients of engine cores in processes of their own
are in ``mp_client``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from omniserve.config import OmniConfig
from omniserve.engine.core import UTILITY_METHODS, EngineCore
from omniserve.messages import EngineCoreOutputs, EngineCoreRequest


class EngineCoreClient(ABC):
    talker_capacity: int
    """Talker positions each engine's speech KV pool holds (the smallest over the engines; 0:
    the model does not speak); the Processor checks audio requests against it."""

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    def add_requests(self, groups: list[list[EngineCoreRequest]]) -> None:
        """Add groups (each the ``n`` samples of one prompt) together, so that an engine core
        takes them into the same step; with data parallelism each group goes to one engine."""
        for group in groups:
            for request in group:
                self.add_request(request)

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next batch of outputs (blocks until there is one)."""

    @abstractmethod
    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        """Call one of the engine core's ``UTILITY_METHODS`` and return its result;
        TimeoutError after ``timeout`` seconds (the engine core still finishes the call)."""

    def reset_prefix_cache(self) -> bool:
        return self.call_utility("reset_prefix_cache")

    @abstractmethod
    def shutdown(self) -> None:
        """Release the engine core."""


class InprocClient(EngineCoreClient):
    """The engine core in this process; ``get_output`` runs one step."""

    def __init__(self, config: OmniConfig) -> None:
        num_engines = config.parallel_config.data_parallel_size
        if num_engines > 1:
            raise ValueError(
                f"data_parallel_size={num_engines} runs engine cores in processes of their own, "
                "but OMNISERVE_ENABLE_MULTIPROCESSING=0 keeps the engine in this process; unset "
                "it or use data_parallel_size=1."
            )
        self.engine_core = EngineCore(config)
        self.talker_capacity = self.engine_core.talker_capacity

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        if timeout is not None:
            raise ValueError("A timeout needs the engine core in a process of its own (unset "
                             "OMNISERVE_ENABLE_MULTIPROCESSING=0): here the call runs in this "
                             "one.")  # fmt: skip
        if method not in UTILITY_METHODS:
            raise AttributeError(f"{method!r} is not an engine core utility.")
        return getattr(self.engine_core, method)(*args)

    def shutdown(self) -> None:
        self.engine_core.shutdown()
