"""vLLM's ``--kv-events-config``: publish the prefix cache's changes (blocks stored, removed,
all cleared) for KV-aware routers, in vLLM's wire format (``omniserve/core/kv_events.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    """Record the events at all (nothing is recorded or sent without it)."""
    publisher: str = "zmq"
    """"zmq": a ZeroMQ PUB socket at ``endpoint``; "null": recorded and dropped."""
    endpoint: str = "tcp://*:5557"
    """Where the PUB socket binds (or, for a ``tcp://host:port`` without ``*``, connects); with
    data parallelism each engine's port is this one plus its index."""
    replay_endpoint: str | None = None
    """A ROUTER socket answering a sequence number with the buffered batches from it on."""
    buffer_steps: int = 10_000
    """Batches kept for replay."""
    hwm: int = 100_000
    """The PUB socket's send high-water mark (messages queued per subscriber)."""
    max_queue_size: int = 100_000
    """Batches waiting for the publishing thread; more are dropped (logged)."""
    topic: str = ""
    """The first frame of every message (subscribers filter on it)."""

    def __post_init__(self) -> None:
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher must be one of {PUBLISHERS}, not "
                             f"{self.publisher!r}.")  # fmt: skip
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv_events_config.{name} must be an integer >= 1, got "
                                 f"{value!r}.")  # fmt: skip
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv_events_config.{name} must be a string.")

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> KVEventsConfig | None:
        """vLLM's dict; None when events are off."""
        known = set(cls.__dataclass_fields__)
        if unknown := sorted(value.keys() - known):
            raise ValueError(f"kv_events_config: unknown key(s) {unknown}; it takes "
                             f"{sorted(known)}.")  # fmt: skip
        config = cls(**{k: v for k, v in value.items() if v is not None})  # None: the default
        return config if config.enable_kv_cache_events else None

    def endpoint_of(self, engine_index: int, endpoint: str | None = None) -> str:
        """``endpoint`` (default: the PUB one) for data-parallel engine ``engine_index``: the
        port moved up by the index (other transports are left as they are)."""
        address = self.endpoint if endpoint is None else endpoint
        head, _, port = address.rpartition(":")
        if engine_index == 0 or not address.startswith("tcp://") or not port.isdigit():
            return address
        return f"{head}:{int(port) + engine_index}"
