"""A bounded load generator: streaming chat requests through a router, one record each.

Open loop (`rate_per_s`: requests start on schedule whether or not earlier ones have
finished, as independent users would) or closed loop (`concurrency`: that many users,
each sending its next request when the last one ends). Always bounded: by `duration_s`,
by `max_requests`, and in the open loop by `max_in_flight` (arrivals beyond it are
counted as `skipped`, not sent). Every request has a total timeout.

Per request it records when it started, its origin region, the status, the time to the
first byte and to the first token, when it ended, which region and worker served it
(`x-globalpool-region`, `x-globalpool-worker`), whether the router retried it (a `retry`
phase in `server-timing`) or sent a hedged copy (a `hedge` phase) and how it failed:
- `before_first_byte`: no body byte reached the client (connect error, an error status
  such as 502/503/504, a timeout or a broken connection before the stream started);
- `mid_stream`: the stream started and then broke: an SSE `data: {"error": ...}` event,
  a connection that broke off, or a stream that ended without `data: [DONE]`.
Times are `time.monotonic()` seconds.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

FailurePhase = Literal["before_first_byte", "mid_stream"]
REGION_HEADER = "x-globalpool-region"
WORKER_HEADER = "x-globalpool-worker"
CLIENT_REGION_HEADER = "x-globalpool-client-region"


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it."""

    index: int
    origin_region: str | None
    start_s: float
    end_s: float = 0.0
    status: int | None = None
    first_byte_s: float | None = None
    first_token_s: float | None = None
    region: str | None = None
    worker: str | None = None
    retried: bool = False
    hedged: bool = False  # the router sent a copy of it elsewhere (router.proxy.hedging)
    tokens: int = 0
    failure: FailurePhase | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token_s is None else (self.first_token_s - self.start_s) * 1e3

    def to_json(self, t0_s: float = 0.0) -> dict[str, Any]:
        """A plain record with times in seconds since `t0_s`."""
        def rel(value: float | None) -> float | None:
            return None if value is None else round(value - t0_s, 4)
        return {
            "index": self.index, "origin": self.origin_region, "start_s": rel(self.start_s),
            "end_s": rel(self.end_s), "status": self.status,
            "first_byte_s": rel(self.first_byte_s), "first_token_s": rel(self.first_token_s),
            "region": self.region, "worker": self.worker, "retried": self.retried,
            "hedged": self.hedged, "tokens": self.tokens, "failure": self.failure,
            "error": self.error,
        }


    @classmethod
    def from_json(cls, record: dict[str, Any]) -> RequestResult:
        """The inverse of `to_json` (times stay relative to its `t0_s`)."""
        return cls(
            index=record["index"], origin_region=record["origin"], start_s=record["start_s"],
            end_s=record["end_s"], status=record["status"],
            first_byte_s=record["first_byte_s"], first_token_s=record["first_token_s"],
            region=record["region"], worker=record["worker"], retried=record["retried"],
            hedged=record.get("hedged", False), tokens=record["tokens"],
            failure=record["failure"], error=record["error"],
        )


@dataclass(frozen=True, slots=True)
class LoadTarget:
    """Where requests go: a router URL, and the client region they come from.

    `send_origin` adds `x-globalpool-client-region` (one router playing clients of
    several regions); without it the router's own region is the origin.
    """

    url: str
    origin_region: str | None = None
    send_origin: bool = False


@dataclass(frozen=True)
class LoadSpec:
    targets: Sequence[LoadTarget]
    duration_s: float
    rate_per_s: float | None = 20.0
    concurrency: int | None = None  # set it (and rate_per_s=None) for a closed loop
    max_requests: int = 100_000
    max_in_flight: int = 1000
    request_timeout_s: float = 60.0
    model: str = "tiny-llama"
    max_tokens: int = 16
    prompt: str = "Tell me about the regions of the world."
    poisson: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.rate_per_s is None) == (self.concurrency is None):
            raise ValueError("give exactly one of rate_per_s (open loop) or concurrency")
        if not self.targets:
            raise ValueError("no targets")


@dataclass
class LoadGenerator:
    """Run once with `await run()`; `results` fills in as requests end."""

    spec: LoadSpec
    clock: Callable[[], float] = time.monotonic
    results: list[RequestResult] = field(default_factory=list)
    in_flight: int = 0
    skipped: int = 0
    # Open loop: the latest a request started after its scheduled time. More than a few
    # ms means this process (or the machine) stalled, and the latencies measured with it.
    max_start_lag_s: float = 0.0
    started_at_s: float | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self, stop: asyncio.Event | None = None) -> list[RequestResult]:
        """Send until the duration, the count or `stop` ends it; then wait for the rest."""
        spec = self.spec
        stop = stop or asyncio.Event()
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
        timeout = aiohttp.ClientTimeout(total=spec.request_timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                         auto_decompress=False) as session:
            self.started_at_s = self.clock()
            self.started.set()
            if spec.rate_per_s is not None:
                await self._open_loop(session, spec.rate_per_s, stop)
            else:
                assert spec.concurrency is not None
                await self._closed_loop(session, spec.concurrency, stop)
        return self.results

    def _body(self) -> dict[str, Any]:
        spec = self.spec
        return {"model": spec.model, "stream": True, "max_tokens": spec.max_tokens,
                "ignore_eos": True, "messages": [{"role": "user", "content": spec.prompt}]}

    async def _open_loop(self, session: aiohttp.ClientSession, rate_per_s: float,
                         stop: asyncio.Event) -> None:
        spec = self.spec
        rng = random.Random(spec.seed)
        assert self.started_at_s is not None
        deadline = self.started_at_s + spec.duration_s
        tasks: set[asyncio.Task[None]] = set()
        body = self._body()
        next_s = self.started_at_s
        index = 0
        while index < spec.max_requests and not stop.is_set():
            now = self.clock()
            if next_s >= deadline:
                break
            if next_s > now:
                try:
                    async with asyncio.timeout(next_s - now):
                        await stop.wait()
                    break
                except TimeoutError:
                    pass
            self.max_start_lag_s = max(self.max_start_lag_s, self.clock() - next_s)
            if self.in_flight >= spec.max_in_flight:
                self.skipped += 1
            else:
                task = asyncio.create_task(self._one(session, index, body))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            index += 1
            gap = rng.expovariate(rate_per_s) if spec.poisson else 1.0 / rate_per_s
            next_s += gap
        if tasks:
            await asyncio.wait(tasks, timeout=spec.request_timeout_s + 5)

    async def _closed_loop(self, session: aiohttp.ClientSession, concurrency: int,
                           stop: asyncio.Event) -> None:
        spec = self.spec
        assert self.started_at_s is not None
        deadline = self.started_at_s + spec.duration_s
        body = self._body()
        counter = iter(range(spec.max_requests))

        async def user() -> None:
            for index in counter:
                if stop.is_set() or self.clock() >= deadline:
                    return
                await self._one(session, index, body)

        await asyncio.gather(*(user() for _ in range(concurrency)))

    async def _one(self, session: aiohttp.ClientSession, index: int,
                   body: dict[str, Any]) -> None:
        target = self.spec.targets[index % len(self.spec.targets)]
        headers = {CLIENT_REGION_HEADER: target.origin_region} if (
            target.send_origin and target.origin_region) else {}
        result = RequestResult(index=index, origin_region=target.origin_region,
                               start_s=self.clock())
        self.in_flight += 1
        try:
            async with session.post(f"{target.url}/v1/chat/completions", json=body,
                                    headers=headers) as response:
                result.status = response.status
                result.region = response.headers.get(REGION_HEADER)
                result.worker = response.headers.get(WORKER_HEADER)
                timing = response.headers.get("server-timing", "")
                result.retried = "retry;" in timing
                result.hedged = "hedge;" in timing
                if response.status != 200:
                    text = (await response.read())[:300].decode(errors="replace")
                    result.failure, result.error = "before_first_byte", text
                else:
                    await self._read_stream(response, result)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            result.failure = "before_first_byte" if result.first_byte_s is None else "mid_stream"
            result.error = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            result.end_s = self.clock()
            self.in_flight -= 1
            self.results.append(result)

    async def _read_stream(self, response: aiohttp.ClientResponse,
                           result: RequestResult) -> None:
        done = False
        async for line in response.content:
            if result.first_byte_s is None:
                result.first_byte_s = self.clock()
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                done = True
                continue
            try:
                event = json.loads(payload)
            except ValueError:
                continue  # a token cut off by an error event that follows
            if "error" in event:
                result.failure = "mid_stream"
                result.error = str(event["error"].get("message", event["error"]))[:300]
                continue
            if _has_token(event):
                result.tokens += 1
                if result.first_token_s is None:
                    result.first_token_s = self.clock()
        if result.failure is None and not done:
            result.failure = ("mid_stream" if result.first_byte_s is not None
                              else "before_first_byte")
            result.error = "the stream ended without data: [DONE]"


def _has_token(event: dict[str, Any]) -> bool:
    choices = event.get("choices") or ()
    for choice in choices:
        delta = choice.get("delta") or {}
        if delta.get("content") or choice.get("text"):
            return True
    return False
