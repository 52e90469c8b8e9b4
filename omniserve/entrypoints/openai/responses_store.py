"""The Responses API's memory: stored responses (``store: true``), kept for ``GET``,
``previous_response_id`` (each holds its own turn and names the one it continued) and background
runs, and a background streamed response's events, which ``GET
/v1/responses/{id}?stream=true&starting_after=N`` replays and follows."""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from omniserve.entrypoints.openai.responses_protocol import ResponseObject
from omniserve.entrypoints.openai.serving_engine import ServingError


@dataclass
class StoredResponse:
    response: ResponseObject
    turn: list[dict[str, Any]] | None
    """Its own chat messages (its input and its output); None while it runs. The conversation
    a next turn continues is the turns of its chain (``ResponseStore.conversation``)."""
    inputs: list[dict[str, Any]]
    """The request's input items, as ``GET .../input_items`` lists them."""
    task: asyncio.Task | None = None
    """A background run's task."""
    parent: str | None = None
    """The response whose conversation this one continued (None: it holds it all)."""
    events: list[str] | None = None
    """A background run created with ``stream``: its SSE events so far (the list index is the
    event's sequence number); None for the others."""
    size: int = 0
    _waiters: list[asyncio.Event] = field(default_factory=list)

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def add_event(self, event: str) -> None:
        assert self.events is not None, "only a streamed background run records events"
        self.events.append(event)
        self.wake()

    def wake(self) -> None:
        """Followers look again (an event was added, or the run ended)."""
        for waiter in self._waiters:
            waiter.set()
        self._waiters.clear()

    async def follow(self, starting_after: int | None) -> AsyncGenerator[str, None]:
        """The recorded events after sequence number ``starting_after`` (all when None), then
        each new one as it comes, until the run ends."""
        assert self.events is not None
        index = 0 if starting_after is None else starting_after + 1
        while True:
            if index < len(self.events):
                yield self.events[index]
                index += 1
            elif not self.running:
                return
            else:
                waiter = asyncio.Event()
                self._waiters.append(waiter)
                await waiter.wait()


class ResponseStore:
    """Stored responses in memory, the least recently used dropped first beyond ``max_bytes``
    (their conversations hold the media sent, so the bound is in bytes); running background
    responses are never dropped."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.size = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def put(self, entry: StoredResponse) -> None:
        self.pop(entry.response.id)
        entry.size = (
            len(entry.response.model_dump_json())
            + len(json.dumps(entry.turn, default=str))
            + sum(map(len, entry.events or ()))
        )
        self.entries[entry.response.id] = entry
        self.size += entry.size
        for key in list(self.entries):
            if self.size <= self.max_bytes:
                break
            if not self.entries[key].running:
                self.pop(key)

    def get(self, response_id: str) -> StoredResponse:
        entry = self.entries.get(response_id)
        if entry is None:
            raise ServingError(
                f"No stored response with id {response_id!r} (responses are kept only with "
                "store=true, in memory, the least recently used dropped first beyond "
                "OMNISERVE_RESPONSES_STORE_MB).",
                HTTPStatus.NOT_FOUND,
                code="response_not_found",
            )
        self.entries.move_to_end(response_id)
        return entry

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """The chat messages a response's next turn continues: the turns of its chain, each
        stored once (so a chain of n turns takes O(n), media included). Reading a chain keeps
        its earlier responses as recently used as itself."""
        entry = self.get(response_id)
        turns = []
        while True:
            if entry.turn is None:  # running, or ended without an answer
                raise ServingError(
                    f"Response {entry.response.id!r} is {entry.response.status}: it has no "
                    "answer to continue from."
                )
            turns.append(entry.turn)
            if entry.parent is None:
                return [message for turn in reversed(turns) for message in turn]
            if entry.parent not in self.entries:
                raise ServingError(
                    f"Response {entry.parent!r}, an earlier turn of {response_id!r}'s "
                    "conversation, is no longer stored (deleted, or dropped beyond "
                    "OMNISERVE_RESPONSES_STORE_MB): the conversation cannot be continued."
                )
            entry = self.get(entry.parent)

    def pop(self, response_id: str) -> StoredResponse | None:
        entry = self.entries.pop(response_id, None)
        if entry is not None:
            self.size -= entry.size
        return entry
