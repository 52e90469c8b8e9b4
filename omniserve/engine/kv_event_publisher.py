"""Publishes the engine core's KV events (``--kv-events-config``, vLLM's) on ZeroMQ, from a
thread of its own so no step waits on a socket.

Each batch of a step's events goes out on the PUB socket as three frames, as vLLM sends them:
the topic, the batch's sequence number (8 bytes, big-endian, from 0) and the msgpack-encoded
``KVEventBatch``. The last ``buffer_steps`` batches are kept: a client of the replay socket (a
ROUTER) that sends a sequence number gets every kept batch from it on, one ``[seq, payload]``
reply each, then ``[-1, b""]``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time

import msgspec
import zmq

from omniserve.config.kv_events import KVEventsConfig
from omniserve.core.kv_events import KVCacheEvent, KVEventBatch

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def _binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address or a local transport is bound, others are connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, engine_index: int = 0,
                 data_parallel: bool = False) -> None:  # fmt: skip
        """``data_parallel``: batches name ``engine_index`` as their ``data_parallel_rank``."""
        self.config = config
        self.rank = engine_index if data_parallel else None
        self.endpoint = config.endpoint_of(engine_index)
        self.replay_endpoint = (
            config.endpoint_of(engine_index, config.replay_endpoint)
            if config.replay_endpoint
            else None
        )
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(config.max_queue_size)
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            (self._pub.bind if _binds(self.endpoint) else self._pub.connect)(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._context.destroy(linger=0)
            raise ValueError(f"--kv-events-config: cannot open {self.endpoint}"
                             f"{' / ' + self.replay_endpoint if self.replay_endpoint else ''}: "
                             f"{exc}") from exc  # fmt: skip
        self._dropped = 0
        self._thread = threading.Thread(target=self._run, name="omniserve-kv-events", daemon=True)
        self._thread.start()
        replay = f", replay on {self.replay_endpoint}" if self.replay_endpoint else ""
        logger.info("KV events: on %s (topic %r)%s.", self.endpoint, config.topic, replay)

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one step's events (a full queue drops them, logged once in a while)."""
        try:
            self._queue.put_nowait(KVEventBatch(time.time(), events, self.rank))  # type: ignore[arg-type]
        except queue.Full:
            self._dropped += 1
            if self._dropped in (1, 10, 100) or self._dropped % 1000 == 0:
                logger.warning("KV events: the queue is full; %d batches dropped.", self._dropped)

    def _run(self) -> None:
        try:
            self._publish_queued()
        except Exception:  # the engine goes on without its events
            logger.exception("KV events: publishing stopped")
        finally:
            self._context.destroy(linger=0)

    def _publish_queued(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        topic = self.config.topic.encode()
        kept: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=self.config.buffer_steps
        )
        seq = 0
        while True:
            self._answer_replays(kept)
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                break
            payload = encoder.encode(batch)
            number = seq.to_bytes(8, "big")
            try:
                self._pub.send_multipart((topic, number, payload), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # every subscriber is at its high-water mark: they replay what they missed
            kept.append((seq, payload))
            seq += 1

    def _answer_replays(self, kept: collections.deque[tuple[int, bytes]]) -> None:
        if self._replay is None:
            return
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            identity, envelope, request = frames[0], frames[1:-1], frames[-1]
            try:
                start = int.from_bytes(request, "big")
            except ValueError:
                continue
            for seq, payload in kept:
                if seq >= start:
                    self._replay.send_multipart((identity, *envelope, seq.to_bytes(8, "big"),
                                                 payload))  # fmt: skip
            self._replay.send_multipart((identity, *envelope, END_OF_REPLAY, b""))

    def shutdown(self) -> None:
        """Send what is queued, then close the sockets."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=1)
        self._thread.join(timeout=5)
