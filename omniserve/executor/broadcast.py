"""A one-writer, many-reader message queue: how the executor hands each call to every worker.

A call (a step's ``SchedulerOutput`` included) is pickled once and sent once, over a ZMQ PUB socket
on an ipc:// address; every worker process receives the same bytes, whatever the number of ranks.
The writer is an XPUB in verbose mode, which reports each reader's subscription, so it can wait
until every reader is connected and no message is lost to PUB/SUB's slow-joiner race. High-water
marks are off on both ends: PUB would otherwise drop messages once a slow reader fell 1000 behind.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from typing import Any

import zmq

_POLL_MS = 100
_SUBSCRIBE = b"\x01"
"""First byte of the subscription event an XPUB receives when a reader subscribes."""


class BroadcastSender:
    def __init__(self, context: zmq.Context, address: str) -> None:
        self._socket = context.socket(zmq.XPUB)
        self._socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # one event per reader, not per topic
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.bind(address)
        self.num_readers = 0

    def wait_for_readers(
        self, num_readers: int, timeout_s: float, check: Callable[[], None] = lambda: None
    ) -> None:
        """Block until ``num_readers`` readers subscribed; ``check`` may raise (e.g. a reader
        process died) and runs between polls."""
        deadline = time.monotonic() + timeout_s
        while self.num_readers < num_readers:
            if self._socket.poll(_POLL_MS):
                if self._socket.recv()[:1] == _SUBSCRIBE:
                    self.num_readers += 1
                continue
            check()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"Only {self.num_readers} of {num_readers} broadcast readers connected "
                    f"within {timeout_s:.0f} s."
                )

    def send(self, message: Any) -> None:
        self._socket.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), copy=False)

    def close(self) -> None:
        self._socket.close(linger=0)


class BroadcastReceiver:
    def __init__(self, context: zmq.Context, address: str) -> None:
        self._socket = context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(address)

    def recv(self) -> Any:
        """The next message, in send order (blocks)."""
        return pickle.loads(self._socket.recv(copy=False).buffer)

    def poll(self, timeout_ms: int) -> bool:
        """Whether a message is in, waiting up to ``timeout_ms``."""
        return bool(self._socket.poll(timeout_ms, zmq.POLLIN))

    def close(self) -> None:
        self._socket.close(linger=0)
