"""Replay a trace open loop: every request leaves at its time, whatever came before.

Each request goes to the router of its origin region with `x-globalpool-client-region`
(and, when the trace says so, `x-globalpool-session-id`, `x-globalpool-class: batch` and
`x-globalpool-ttft-budget-ms`), streams its answer and is recorded as an `Outcome`, with
the router's prediction (`x-globalpool-predicted-ttft-ms`) and the router time that
prediction does not cover (`server-timing`'s queue and retry phases).
Bounded: no request is sent after the trace's duration plus `late_s`, at most
`max_in_flight` are open at once (arrivals beyond are counted as skipped), and every
request has a total timeout. Bodies are built before the clock starts, so the send path
does no JSON encoding.

Times are seconds since the replay started (`time.monotonic()` based). TTFT is measured
from the moment the request was handed to the connection, so it does not include the
generator's own lateness, which is recorded separately (`lag_ms`) and reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from lab.bench.trace import TraceRequest

REGION_HEADER = "x-globalpool-region"
WORKER_HEADER = "x-globalpool-worker"
ROUTE_HEADER = "x-globalpool-route"
PREDICTED_TTFT_HEADER = "x-globalpool-predicted-ttft-ms"
# server-timing phases that pass before the routing decision the prediction was made
# at, or on attempts before it: the prediction does not cover them (router/proxy/replies)
UNPREDICTED_PHASES = ("queue", "retry")


def predicted_ms(value: str | None) -> float | None:
    """The predicted-TTFT header as a number; None when absent, unreadable or <= 0 (a
    policy that predicts nothing)."""
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number if number > 0.0 else None


def unpredicted_ms(server_timing: str | None) -> float:
    """The router-side time that `server-timing` reports outside the prediction: its
    `queue` and `retry` durations (ms), summed; 0 when it names neither."""
    total = 0.0
    for entry in (server_timing or "").split(","):
        name, _, params = entry.strip().partition(";")
        if name not in UNPREDICTED_PHASES:
            continue
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key == "dur":
                with contextlib.suppress(ValueError):
                    total += float(value)
    return total


@dataclass(slots=True)
class Outcome:
    """One replayed request as its client saw it."""

    index: int
    origin: str
    traffic_class: str
    scheduled_s: float
    sent_s: float
    end_s: float = 0.0
    status: int | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    tokens: int = 0
    region: str | None = None
    worker: str | None = None
    route: str | None = None
    hedged: bool = False  # the router sent a copy elsewhere (server-timing `hedge`)
    # The TTFT the router predicted (ms; None: it predicted none), and the router time
    # the prediction does not cover (queueing, earlier attempts), which `ttft_ms` includes.
    predicted_ttft_ms: float | None = None
    unpredicted_ms: float = 0.0
    failure: str | None = None  # "before_first_byte" | "mid_stream"
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def lag_ms(self) -> float:
        return (self.sent_s - self.scheduled_s) * 1000.0

    @property
    def ttft_ms(self) -> float | None:
        if self.first_token_s is None:
            return None
        return (self.first_token_s - self.sent_s) * 1000.0

    @property
    def predicted_span_ms(self) -> float | None:
        """The measured counterpart of the prediction: TTFT less the router time the
        prediction does not cover (decision -> first token, as the client saw it)."""
        ttft = self.ttft_ms
        return None if ttft is None else ttft - self.unpredicted_ms

    @property
    def itl_ms(self) -> float | None:
        """Mean time between this request's tokens after the first."""
        if self.first_token_s is None or self.last_token_s is None or self.tokens < 2:
            return None
        return (self.last_token_s - self.first_token_s) * 1000.0 / (self.tokens - 1)

    @property
    def e2e_ms(self) -> float:
        return (self.end_s - self.sent_s) * 1000.0

    def to_json(self) -> dict[str, Any]:
        return {name: (round(value, 4) if isinstance(value, float) else value)
                for name in self.__slots__ if (value := getattr(self, name)) is not None}


def request_headers(request: TraceRequest) -> dict[str, str]:
    headers = {"Content-Type": "application/json",
               "x-globalpool-client-region": request.origin}
    if request.session_id is not None:
        headers["x-globalpool-session-id"] = request.session_id
    if request.traffic_class != "interactive":
        headers["x-globalpool-class"] = request.traffic_class
    if request.ttft_budget_ms is not None:
        headers["x-globalpool-ttft-budget-ms"] = f"{request.ttft_budget_ms:g}"
    return headers


class Replayer:
    """Replays once: `await run()`; the counters can be read while it runs (progress)."""

    def __init__(self, requests: Sequence[TraceRequest], bodies: Sequence[bytes],
                 router_for: Mapping[str, str], *, duration_s: float, timeout_s: float,
                 max_in_flight: int = 2000, late_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if len(requests) != len(bodies):
            raise ValueError("one body per request")
        self._requests = requests
        self._bodies = bodies
        self._urls = {origin: f"{url}/v1/chat/completions" for origin, url in router_for.items()}
        self._headers = [request_headers(request) for request in requests]
        self.duration_s = duration_s
        self.timeout_s = timeout_s
        self.max_in_flight = max_in_flight
        self.late_s = late_s
        self._clock = clock
        self.started = asyncio.Event()
        self.outcomes: list[Outcome] = []
        self.in_flight = 0
        self.sent = 0
        self.skipped = 0
        self.t0: float | None = None

    def now_s(self) -> float:
        return 0.0 if self.t0 is None else self._clock() - self.t0

    async def run(self) -> list[Outcome]:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        tasks: set[asyncio.Task[None]] = set()
        async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                         auto_decompress=False) as session:
            self.t0 = self._clock()
            self.started.set()
            stop_sending_s = self.duration_s + self.late_s
            for number, request in enumerate(self._requests):
                delay = request.at_s - self.now_s()
                if delay > 0:
                    await asyncio.sleep(delay)
                if self.now_s() > stop_sending_s:
                    self.skipped += len(self._requests) - number
                    break
                if self.in_flight >= self.max_in_flight:
                    self.skipped += 1
                    continue
                task = asyncio.create_task(self._one(session, number))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.wait(set(tasks), timeout=self.timeout_s + 5.0)
            for task in tasks:
                task.cancel()  # past every timeout: only a hung connection is left
        self.outcomes.sort(key=lambda outcome: outcome.index)
        return self.outcomes

    async def _one(self, session: aiohttp.ClientSession, number: int) -> None:
        request = self._requests[number]
        outcome = Outcome(index=request.index, origin=request.origin,
                          traffic_class=request.traffic_class, scheduled_s=request.at_s,
                          sent_s=self.now_s())
        self.in_flight += 1
        self.sent += 1
        try:
            async with session.post(self._urls[request.origin], data=self._bodies[number],
                                    headers=self._headers[number]) as response:
                outcome.status = response.status
                outcome.region = response.headers.get(REGION_HEADER)
                outcome.worker = response.headers.get(WORKER_HEADER)
                outcome.route = response.headers.get(ROUTE_HEADER)
                outcome.predicted_ttft_ms = predicted_ms(
                    response.headers.get(PREDICTED_TTFT_HEADER))
                timing = response.headers.get("server-timing")
                outcome.unpredicted_ms = unpredicted_ms(timing)
                outcome.hedged = timing is not None and "hedge;" in timing
                if response.status != 200:
                    text = (await response.read())[:300].decode(errors="replace")
                    outcome.failure, outcome.error = "before_first_byte", text
                else:
                    await self._read_stream(response, outcome)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            outcome.failure = "before_first_byte" if outcome.tokens == 0 else "mid_stream"
            outcome.error = f"{type(exc).__name__}: {exc}"[:300]
        except asyncio.CancelledError:
            outcome.failure = "before_first_byte" if outcome.tokens == 0 else "mid_stream"
            outcome.error = "cancelled: past the replay's time bound"
            raise
        finally:
            outcome.end_s = self.now_s()
            self.in_flight -= 1
            self.outcomes.append(outcome)

    async def _read_stream(self, response: aiohttp.ClientResponse, outcome: Outcome) -> None:
        """Count content-carrying SSE events without parsing JSON (the client must keep up)."""
        done = False
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            if line.startswith(b"data: [DONE]"):
                done = True
            elif b'"delta":{"content":"' in line and b'"content":""' not in line:
                now = self.now_s()
                if outcome.first_token_s is None:
                    outcome.first_token_s = now
                outcome.last_token_s = now
                outcome.tokens += 1
            elif line.startswith(b'data: {"error"'):
                outcome.failure = "mid_stream"
                outcome.error = line[6:306].decode(errors="replace").strip()
        if outcome.failure is None and not done:
            outcome.failure = "mid_stream" if outcome.tokens else "before_first_byte"
            outcome.error = "the stream ended without data: [DONE]"
