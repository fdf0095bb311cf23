"""Clients of the hostile drill: what they send, what they saw, and the base of the
client behaviours (lab.drill.hostile.behaviours).

A behaviour is registered by its `name` and sends one request per connection through the
raw client (lab.drill.hostile.http), reading the answer its own way, and says what it
`expects` to get: a whole answer, the head, the first events, nothing (it leaves at
once), or a refusal (413). A cell's requests all use one behaviour; `open` and `close`
frame the cell (the idle connections are opened and closed there). Every request is
bounded by `ClientSettings.deadline_s`.
"""

from __future__ import annotations

import asyncio
import json
import random
import resource
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from lab.drill.hostile.http import (
    AnswerReader,
    BodyDecoder,
    Endpoint,
    Head,
    MalformedAnswer,
    connect,
    post_bytes,
    read_head,
)

Expectation = Literal["answer", "head", "partial", "nothing", "refusal"]
WORKER_HEADER = "x-globalpool-worker"
_PACE_TICK_S = 0.25


@dataclass(frozen=True)
class ClientSettings:
    """What the behaviours send and how long they hold on."""

    model: str = "tiny-llama"
    tokens: int = 16  # an ordinary answer
    # Slow readers' and stallers' streams (~210 bytes an event: 500 are ~105 KB, 1-2 s of
    # the lanes' simulators, well within the drill's total_s on a busy machine): far more
    # than a slow client reads, but not more than the send buffer Linux grows for the
    # router's socket (~0.75 MB measured), which then holds all of it, so the router's own
    # pause of the worker is not reached (no answer the simulator can give is that long).
    long_stream_tokens: int = 500
    slow_read_bytes_per_s: float = 1024.0
    slow_read_s: float = 4.0  # then the slow reader takes the rest at once
    stall_s: float = 4.0
    stall_after_events: int = 3
    big_body_bytes: int = 10 * 1024 * 1024
    idle_connections: int = 10_000
    deadline_s: float = 10.0
    prompt: str = "Tell me about the regions of the world."


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """One request of a cell: streamed or not, chat or completions."""

    index: int
    stream: bool
    path: str
    role: Literal["behaviour", "witness"] = "behaviour"

    @classmethod
    def mixed(cls, index: int, role: Literal["behaviour", "witness"],
              rng: random.Random) -> RequestPlan:
        """A stream or a whole answer, chat or completions, drawn at random (`rng` seeded
        per cell): taken in turn, with the router's turns round robin, the bad worker
        could get only streams or only whole answers."""
        path = "/v1/chat/completions" if rng.random() < 0.5 else "/v1/completions"
        return cls(index, rng.random() < 0.5, path, role)


@dataclass(slots=True)
class Outcome:
    """One request as its client saw it (times are Unix seconds)."""

    behaviour: str
    expects: Expectation
    plan: RequestPlan
    started_unix_s: float
    ended_unix_s: float = 0.0
    status: int | None = None
    worker: str | None = None
    content_type: str | None = None
    complete: bool = False  # the body's framing ended as it said it would
    body_bytes: int = 0
    extra_bytes: int = 0  # bytes past the end the framing declared
    failure: str | None = None  # what broke on the client's side
    got_expected: bool = False
    answer: AnswerReader | None = field(default=None, repr=False)

    def took_head(self, head: Head) -> None:
        self.status = head.status
        self.worker = head.headers.get(WORKER_HEADER)
        self.content_type = head.headers.get("content-type")

    @property
    def error(self) -> dict[str, Any] | None:
        return None if self.answer is None else self.answer.error

    def to_json(self) -> dict[str, Any]:
        answer = self.answer
        error = self.error
        return {
            "role": self.plan.role, "behaviour": self.behaviour, "expects": self.expects,
            "index": self.plan.index, "stream": self.plan.stream, "path": self.plan.path,
            "started_unix_s": round(self.started_unix_s, 4),
            "ended_unix_s": round(self.ended_unix_s, 4), "status": self.status,
            "worker": self.worker, "complete": self.complete, "body_bytes": self.body_bytes,
            "extra_bytes": self.extra_bytes,
            "events": None if answer is None else answer.events,
            "done": None if answer is None else answer.done,
            "error": None if error is None else {
                "code": error.get("code"), "type": error.get("type"),
                "message": str(error.get("message", ""))[:300]},
            "error_status": None if answer is None else answer.error_status,
            "failure": self.failure, "got_expected": self.got_expected,
        }


class ClientBehaviour:
    """How one kind of client sends its requests and reads its answers (see module doc)."""

    name: ClassVar[str] = ""
    expects: ClassVar[Expectation] = "answer"
    registry: ClassVar[dict[str, type[ClientBehaviour]]] = {}

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        if cls.name:
            ClientBehaviour.registry[cls.name] = cls

    def __init__(self, settings: ClientSettings) -> None:
        self.settings = settings

    async def open(self, endpoint: Endpoint) -> None:
        """Before the cell's first request."""

    async def close(self) -> None:
        """After the cell's last request has ended."""

    def cell_facts(self) -> dict[str, Any]:
        """What the behaviour did for the cell as a whole, for the report."""
        return {}

    def tokens(self, plan: RequestPlan) -> int:
        return self.settings.tokens

    def hold_s(self) -> float:
        """How long to keep the connection open, reading nothing, once the exchange is
        over (outside the deadline: holding on is the client's own choice)."""
        return 0.0

    def body(self, plan: RequestPlan) -> bytes:
        document: dict[str, Any] = {"model": self.settings.model,
                                    "max_tokens": self.tokens(plan), "stream": plan.stream}
        if plan.path == "/v1/chat/completions":
            document["messages"] = [{"role": "user", "content": self.settings.prompt}]
        else:
            document["prompt"] = self.settings.prompt
        return json.dumps(document).encode()

    async def send(self, endpoint: Endpoint, plan: RequestPlan) -> Outcome:
        """One request on a fresh connection, bounded by `deadline_s`; never raises."""
        outcome = Outcome(self.name, self.expects, plan, time.time())
        deadline_s = self.settings.deadline_s
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(deadline_s):
                reader, writer = await connect(endpoint)
                await self.exchange(endpoint, plan, reader, writer, outcome)
            await asyncio.sleep(self.hold_s())
        except TimeoutError:
            outcome.failure = f"no end within the client's {deadline_s:g} s"
        except (EOFError, MalformedAnswer) as exc:
            outcome.failure = str(exc)
        except OSError as exc:  # refused, reset, broken pipe
            outcome.failure = type(exc).__name__
        finally:
            if writer is not None:
                writer.close()
        outcome.ended_unix_s = time.time()
        outcome.got_expected = outcome.failure is None and self.judge(outcome)
        return outcome

    async def exchange(self, endpoint: Endpoint, plan: RequestPlan,
                       reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       outcome: Outcome) -> None:
        """Send the request, read the head, then `read` the rest."""
        writer.write(post_bytes(endpoint, plan.path, self.body(plan)))
        await writer.drain()
        head, first = await read_head(reader)
        outcome.took_head(head)
        await self.read(reader, head, first, outcome)

    async def read(self, reader: asyncio.StreamReader, head: Head, first: bytes,
                   outcome: Outcome) -> None:
        """Read the answer after its head (`first`: body bytes that came with it); the
        normal client reads all of it as fast as it comes."""
        await read_body(reader, head, first, outcome)

    def judge(self, outcome: Outcome) -> bool:
        """Whether what arrived is what this behaviour `expects`."""
        if self.expects == "nothing":
            return True
        if self.expects == "refusal":
            return outcome.status == 413
        if outcome.status != 200:
            return False
        if self.expects == "head":
            return True
        answer = outcome.answer
        if self.expects == "partial":  # the head and, for a stream, its first events
            if answer is None or not answer.stream:
                return True
            return answer.error is None and (
                answer.events >= self.settings.stall_after_events or answer.done)
        if answer is None or not outcome.complete:
            return False
        if answer.stream:
            return answer.done and answer.error is None and answer.events > 0
        return answer.answer_ok


class Pace:
    """Reads `bytes_per_s` for `for_s` seconds (in quarter-second bites), then as fast as
    data comes."""

    def __init__(self, bytes_per_s: float, for_s: float) -> None:
        self._bite = max(1, int(bytes_per_s * _PACE_TICK_S))
        self._until_s = time.monotonic() + for_s

    async def read(self, reader: asyncio.StreamReader) -> bytes:
        if time.monotonic() >= self._until_s:
            return await reader.read(1 << 16)
        await asyncio.sleep(_PACE_TICK_S)
        return await reader.read(self._bite)


async def read_body(reader: asyncio.StreamReader, head: Head, first: bytes, outcome: Outcome,
                    *, pace: Pace | None = None, enough_events: int | None = None,
                    enough_bytes: int | None = None) -> None:
    """Read the body into `outcome` until its end, or until `enough_events` SSE events
    or `enough_bytes` body bytes have arrived (a client that stops there)."""
    decoder = BodyDecoder(head)
    sse = (outcome.content_type or "").startswith("text/event-stream")
    answer = outcome.answer = AnswerReader(stream=sse)
    data = first
    while True:
        if data:
            outcome.body_bytes += len(data)
            answer.add(decoder.feed(data))
        if decoder.done:
            break
        if (enough_events is not None and answer.events >= enough_events) or (
                enough_bytes is not None and outcome.body_bytes >= enough_bytes):
            return
        data = await (pace.read(reader) if pace is not None else reader.read(1 << 16))
        if not data:
            if not decoder.until_close:
                outcome.failure = "the connection closed before the end of the body"
                return
            break
    outcome.complete = True
    outcome.extra_bytes = decoder.extra_bytes
    answer.finish()


def ensure_open_files(wanted: int) -> int:
    """Raise this process's soft limit on open files towards `wanted` (up to the hard
    limit); children started afterwards inherit it. Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        ceiling = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (ceiling, hard))
        soft = ceiling
    return soft
