"""What a stream's client has been sent, kept so that another worker can finish the answer.

A stream is passed through as it arrives, without parsing its events (see
`router.proxy.stream`). To carry it across a worker that dies mid-stream, the relay also
hands every piece to a `Transcript`, which
- passes on whole SSE events only, holding back the start of an event split across
  reads until its end arrives, so a client never holds half an event when its worker dies;
- keeps the pieces (references, not copies) and reads them only when a continuation needs
  them, or every `FOLD_BYTES` so that a long answer costs bounded memory;
- counts events, so that a worker that streams past what the request allows (a stream
  that never ends) is cut off as broken (`TooManyEvents`);
- stops at an error event (vLLM writes one when its engine fails mid-generation) before
  it reaches the client (`ErrorEvent`), so the stream can be continued elsewhere.

The usual token costs an `endswith`, a `count`, a substring test and an append: it is
kept as the worker framed it and decoded only when read.
"""

from __future__ import annotations

import json

from router.proxy.progress import Progress, error_status, sse_data
from router.proxy.upstream.errors import ConnectionBroken, UpstreamError

# Pieces kept before they are read into the progress and dropped (reading costs ~1 us an
# event: only answers longer than this pay it).
FOLD_BYTES = 1024 * 1024
# The start of an event held back past this size is passed on as it is (and the stream can
# no longer be continued: its client may hold half an event).
MAX_HELD_BYTES = 1024 * 1024
_ERROR_MARK = b'{"error"'


class TooManyEvents(UpstreamError):
    """The worker streamed more events than the request's max_tokens allows."""


class ErrorEvent(UpstreamError):
    """The worker sent an error event after the stream had started."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"the worker sent an error event {status} mid-stream: {message}")
        self.status = status
        self.message = message


def event_limit(completion_tokens: int | None, choices: int) -> int | None:
    """The most events a stream for this request may carry: one per token and choice, a
    role and a finish event per choice, usage and [DONE], and an eighth more for events
    an engine may add. None when the request sets no max_tokens (the engine's own limit,
    unknown here, applies)."""
    if completion_tokens is None:
        return None
    return completion_tokens + completion_tokens // 8 + 2 * choices + 8


class Transcript:
    """The whole events a stream's client got, in order (see the module's docstring)."""

    __slots__ = ("_held", "_kind", "_pieces", "_progress", "_size", "event_limit", "events",
                 "owed")

    def __init__(self, kind: str, limit: int | None) -> None:
        self._pieces: list[bytes] = []
        self._size = 0
        self._held = b""
        self.events = 0
        # No limit: a large number that stays a machine integer in the compiled build
        # (mypyc boxes ints from 2**62; this is compared at every token).
        self.event_limit = limit if limit is not None else 1 << 61
        self._kind = kind
        self._progress: Progress | None = None  # made when first needed (most never are)
        # Recorded events that did not reach the client (they came just before an error
        # event): whoever continues or ends the stream sends them first.
        self.owed = b""

    @property
    def progress(self) -> Progress:
        """What has been read of the pieces so far (`read` reads them all)."""
        progress = self._progress
        if progress is None:
            progress = self._progress = Progress(self._kind)
        return progress

    @property
    def started(self) -> bool:
        """Whether the client has been sent any event."""
        return self.events > 0

    def admit(self, data: bytes) -> bytes:
        """Of the bytes held back and `data`, those that end on an event boundary, for the
        client now (maybe b""); the rest waits for the next call. Raises TooManyEvents or
        ErrorEvent instead of passing such events on."""
        whole = self._whole(data)
        if whole:
            self._record(whole, framed(whole))
        return whole

    def admit_framed(self, data: bytes) -> bytes:
        """As `admit`, but what is for the client comes as one chunk of a chunked body
        (maybe b""): framed once, for the client and for what is kept (the front)."""
        whole = self._whole(data)
        if not whole:
            return whole
        frame = framed(whole)
        self._record(whole, frame)
        return frame

    def _whole(self, data: bytes) -> bytes:
        """The bytes held back and `data` up to their last event boundary; holds back the
        rest (see `admit`)."""
        held = self._held
        if held:
            data = held + data
            self._held = b""
        if not data.endswith(b"\n\n"):
            cut = after_last_event(data)
            if len(data) - cut > MAX_HELD_BYTES:
                self.progress.unsound = "an event larger than 1 MB was passed on whole"
            elif cut < len(data):
                self._held = data[cut:]
                data = data[:cut]
        return data

    def admit_frame(self, frame: bytes) -> bool:
        """True when `frame`, whole chunks of a chunked answer ending on an event
        boundary, was recorded and may go to the client as it is (the usual token, kept
        framed: decoded only when read); False: decode it and `admit` its payloads."""
        # Byte tests, not method calls: this runs for every token (the compiled build
        # makes a byte test a few instructions, a bytes method call hundreds).
        end = len(frame)
        if self._held or end < 16 or frame[end - 4] != 10 or frame[end - 3] != 10:
            return False  # not "...\n\n" + CRLF: maybe inside an event
        # Counted as one event (a read of several is rare, and counting them costs a
        # search of every byte): a lower bound, so the limit never cuts a stream early.
        events = self.events + 1
        if events > self.event_limit:
            return False  # `admit` raises
        # An error event may come anywhere in a read (vLLM writes each event as its own
        # chunk, but a read can bring several): one substring search (in C, no copy).
        # Text that mentions `{"error"` is escaped inside its JSON string, so a hit is an
        # error event or, rarely, a false alarm the slow path sorts out.
        if _ERROR_MARK in frame:
            return False  # `admit` raises
        self.events = events
        self._pieces.append(frame)
        self._size += len(frame)
        if self._size > FOLD_BYTES:
            self._fold()
        return True

    def take_owed(self) -> bytes:
        """The events owed to the client (see `owed`), now to be sent."""
        owed, self.owed = self.owed, b""
        return owed

    def drop_held(self) -> None:
        """Forget the start of an event held back (its worker broke off inside it: the
        client never had it, and the continuation's events must not be glued to it)."""
        self._held = b""

    def take_held(self) -> bytes:
        """What is held back when the body ended, for the client: a last `data: [DONE]`
        that lacks its blank line (recorded), else b"". Raises ConnectionBroken when the
        body ended inside any other event: its client never gets half an event, and the
        stream is continued or ended as one broken off there."""
        held = self._held
        self._held = b""
        if not held.strip():
            return b""
        if sse_data(held) != b"[DONE]":
            raise ConnectionBroken("the stream ended inside an event", stale=False,
                                   received_any=True)
        self._pieces.append(framed(held))
        return held

    def read(self) -> Progress:
        """The progress of everything the client has been sent (reads the pieces kept)."""
        if self._pieces:
            self._fold()
        return self.progress

    def _record(self, data: bytes, frame: bytes) -> None:
        """Count and keep `data` (whole events), `frame` being it framed as a chunk."""
        events = self.events + data.count(b"\n\n")
        if _ERROR_MARK in data:
            self._stop_at_error(data)
        if events > self.event_limit:
            raise TooManyEvents(
                f"the worker streamed more than {self.event_limit} events, more than the "
                "request's max_tokens allows")
        self.events = events
        self._pieces.append(frame)
        self._size += len(data)
        if self._size > FOLD_BYTES:
            self._fold()

    def _stop_at_error(self, data: bytes) -> None:
        """Raise ErrorEvent if `data` holds an error event (the events before it are
        recorded; the client gets them when the stream is continued or ended)."""
        start = 0
        for event in _split_events(data):
            payload = sse_data(event)
            if payload.startswith(_ERROR_MARK):
                status, message = _error_of(payload)
                before = data[:start]
                if before:
                    self.events += before.count(b"\n\n")
                    self._pieces.append(framed(before))
                    self.owed = before
                raise ErrorEvent(status, message)
            start += len(event)

    def _fold(self) -> None:
        try:
            self.progress.feed(b"".join(chunk_payloads(b"".join(self._pieces))))
        except ValueError:  # (the upstream parser passes whole chunks only)
            self.progress.unsound = "the answer's framing could not be read back"
        self._pieces.clear()
        self._size = 0


def framed(data: bytes) -> bytes:
    """`data` as one chunk of a chunked body: how the pieces are kept (see admit_frame)."""
    return b"%x\r\n" % len(data) + data + b"\r\n"


def chunk_payloads(chunks: bytes) -> list[bytes]:
    """The payloads of whole bare-size chunks (as `admit_frame` gets them)."""
    payloads: list[bytes] = []
    pos = 0
    while pos < len(chunks):
        eol = chunks.index(b"\r\n", pos)
        size = int(chunks[pos:eol], 16)
        payloads.append(chunks[eol + 2 : eol + 2 + size])
        pos = eol + size + 4
    return payloads


def after_last_event(data: bytes) -> int:
    """Where the bytes after the last whole event of `data` start (0: there is none)."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def _split_events(data: bytes) -> list[bytes]:
    """`data`'s events, each with its ending blank line (so their lengths add up)."""
    events: list[bytes] = []
    start = 0
    while start < len(data):
        end = data.find(b"\n\n", start)
        if end < 0:
            events.append(data[start:])
            break
        events.append(data[start : end + 2])
        start = end + 2
    return events


def _error_of(payload: bytes) -> tuple[int, str]:
    try:
        error = json.loads(payload).get("error")
    except (ValueError, AttributeError):
        return 500, "an error event that is not JSON"
    return error_status(error)
