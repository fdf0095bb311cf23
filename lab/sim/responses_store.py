"""Where the simulator keeps Responses API objects: in its own memory, as vLLM 0.32 does
with VLLM_ENABLE_RESPONSES_API_STORE=1, but bounded (vLLM's store only grows).

A response is stored when it finishes (a background one also when it is queued), so GET
of a response still streaming is a 404, as on vLLM. The newest `max_responses` are kept;
storing one more forgets the one stored longest ago.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any


class EventLog:
    """The SSE events of a background stream, one `bytes` per event, kept for the POST
    that started it and for GET ?stream=true (vLLM's event_store)."""

    def __init__(self) -> None:
        self.events: list[bytes] = []
        self.closed = False
        self._changed = asyncio.Event()

    def extend(self, events: list[bytes]) -> None:
        self.events.extend(events)
        self._changed.set()

    def close(self) -> None:
        self.closed = True
        self._changed.set()

    async def follow(self, start: int = 0) -> AsyncIterator[bytes]:
        """The events from index `start` on, as they come, until the log is closed."""
        at = start
        while True:
            self._changed.clear()
            while at < len(self.events):
                yield self.events[at]
                at += 1
            if self.closed:
                return
            await self._changed.wait()


@dataclass(slots=True)
class StoredResponse:
    """One stored response object and what a follow-up needs of it.

    `conversation`: the text of its turns so far (earlier turns, its input, its output),
    which a request naming it as previous_response_id puts in front of its own input.
    """

    body: dict[str, Any]
    conversation: str
    events: EventLog | None = None
    task: asyncio.Task[None] | None = None

    @property
    def status(self) -> str:
        return str(self.body["status"])


class ResponseStore:
    """The newest `max_responses` responses by id; 0 keeps none (vLLM's default)."""

    def __init__(self, max_responses: int) -> None:
        self.max_responses = max_responses
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_responses > 0

    def __len__(self) -> int:
        return len(self._responses)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._responses.get(response_id)

    def put(self, stored: StoredResponse) -> None:
        """Store (or replace) it as the newest; the oldest beyond the bound are forgotten."""
        if not self.enabled:
            return
        response_id = str(stored.body["id"])
        self._responses[response_id] = stored
        self._responses.move_to_end(response_id)
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)
