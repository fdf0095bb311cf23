"""Decoded body bytes held for a connection's reader, and whether its socket is read."""

from __future__ import annotations

import asyncio

MAX_BUFFER_BYTES = 1024 * 1024  # body bytes held for a reader before reading is paused


class ReadBuffer:
    """The body bytes a reader (`read_some`) has not taken yet, and the reading switch.

    Reading from the socket pauses while more than MAX_BUFFER_BYTES wait here (`full`) or
    while the caller asks (`caller_paused`: its sink is slow), and resumes when neither
    holds; `paused` is what the transport was last told.
    """

    __slots__ = ("_size", "caller_paused", "full", "paused", "pieces")

    def __init__(self) -> None:
        self.pieces: list[bytes] = []  # decoded body bytes not yet read
        self._size = 0
        self.full = False
        self.caller_paused = False
        self.paused = False

    def reset(self) -> None:
        """Empty, for a new answer (`paused` stays: it is the transport's state)."""
        self.pieces = []
        self._size = 0
        self.full = False
        self.caller_paused = False

    def add(self, data: bytes) -> bool:
        """Hold `data`; True when that made the buffer full (reading should pause)."""
        self.pieces.append(data)
        self._size += len(data)
        if self._size > MAX_BUFFER_BYTES and not self.full:
            self.full = True
            return True
        return False

    def take(self) -> bytes:
        """The bytes held, taken out (`full` is for the caller to clear: it resumes
        reading then)."""
        pieces = self.pieces
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        self._size = 0
        return data

    def switch(self, transport: asyncio.Transport) -> None:
        """Pause or resume reading `transport` as the buffer and the caller now ask."""
        paused = self.full or self.caller_paused
        if paused != self.paused:
            self.paused = paused
            if paused:
                transport.pause_reading()
            else:
                transport.resume_reading()
