"""Recent operator-visible events of this router: drains, undrains, config reloads."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Event:
    """`at_unix_s` is wall-clock time; `kind` e.g. drain, undrain, config_reloaded."""

    at_unix_s: float
    kind: str
    subject: str
    detail: str = ""


class EventLog:
    """The last `size` events, newest last."""

    def __init__(self, size: int = 200, clock: Callable[[], float] = time.time) -> None:
        self._events: deque[Event] = deque(maxlen=size)
        self._clock = clock

    def record(self, kind: str, subject: str, detail: str = "") -> None:
        self._events.append(Event(self._clock(), kind, subject, detail))

    def recent(self) -> list[Event]:
        return list(self._events)
