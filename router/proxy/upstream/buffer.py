"""What a reader of a connection's body waits on: the decoded bytes it has not taken yet,
the future it waits on, and whether the socket is read meanwhile (the buffer, waiter and
paused transport of asyncio's StreamReader, for one answer at a time)."""

from __future__ import annotations

import asyncio
from typing import Final

MAX_BUFFER_BYTES: Final = 1024 * 1024  # body bytes held for a reader before reading is paused


class ReadBuffer:
    """The body bytes a reader (`read_some`) has not taken yet, its waiter, and the
    reading switch.

    Reading from the socket pauses while more than MAX_BUFFER_BYTES wait here (`full`) or
    while the caller asks (`caller_paused`: its sink is slow), and resumes when neither
    holds; `paused` is what the transport was last told. `transport` is None until the
    connection is made and from when it is closed.
    """

    __slots__ = ("_size", "caller_paused", "full", "paused", "pieces", "transport", "waiter")

    def __init__(self) -> None:
        self.pieces: list[bytes] = []  # decoded body bytes not yet read
        self._size = 0
        self.full = False
        self.caller_paused = False
        self.paused = False
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[None] | None = None  # a reader's (`head`, `read_some`)

    def add(self, data: bytes) -> None:
        """Hold `data` for the reader, and wake it (reading pauses if that is too much)."""
        self.pieces.append(data)
        self._size += len(data)
        if self._size > MAX_BUFFER_BYTES and not self.full:
            self.full = True
            self.switch()
        waiter = self.waiter  # `wake`, inline: one call less per read
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def take(self) -> bytes:
        """The bytes held, taken out (reading resumes if they had paused it)."""
        pieces = self.pieces
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        self._size = 0
        if self.full:
            self.full = False
            self.switch()
        return data

    def wake(self) -> None:
        """Wake the reader, if one waits: something it waits for has happened."""
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def switch(self) -> None:
        """Pause or resume reading the transport as the buffer and the caller now ask."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        paused = self.full or self.caller_paused
        if paused != self.paused:
            self.paused = paused
            if paused:
                transport.pause_reading()
            else:
                transport.resume_reading()
