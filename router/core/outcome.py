"""What happened to a request and to each of its attempts, for whoever learns from it.

The proxy fills these records as it goes and hands them to observers (passive health,
metrics, the status page, traces). Observers are plain callables run inline on the
request path: they must be cheap and must not await.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple, Protocol

from router.core.endpoints import KIND_BY_PATH


class Reschedulable(Protocol):
    """A deadline that can be moved (`asyncio.Timeout`, `router.proxy.timeouts.Deadline`)."""

    def reschedule(self, when: float | None) -> None: ...


class ReadCounter(Protocol):
    """An upstream connection as passive health sees it: how many reads it has made, and
    `close` (health cuts a stream whose engine is stuck: router.health.stalls)."""

    @property
    def reads(self) -> int: ...

    def close(self) -> None: ...


class Prediction(NamedTuple):
    """A predicted TTFT by its parts, in ms (router.policy.predicted_ttft says how each is
    found): the RTT to the worker's region, what this router learnt beyond its
    predictions there (the region's penalty), the wait in the engine's queue (for a batch
    slot or KV room), the prompt's prefill, and the engine step that makes the first
    token. The router's own queue is not in it: a queued request is routed (and
    predicted) again when it leaves the queue."""

    rtt_ms: float
    penalty_ms: float
    queue_ms: float
    prefill_ms: float
    first_step_ms: float

    @property
    def total_ms(self) -> float:
        return (self.rtt_ms + self.penalty_ms + self.queue_ms + self.prefill_ms
                + self.first_step_ms)


class Failure(StrEnum):
    """Why an attempt failed. All but MID_STREAM happen before the client got a byte."""

    CONNECT = "connect"  # TCP connect refused / unreachable / connect timeout
    SERVER_ERROR = "server_error"  # the worker answered 5xx (other than busy)
    BUSY = "busy"  # 503/429: the engine is full; says nothing bad about its health
    TIMEOUT = "timeout"  # no first byte in time
    RESET = "reset"  # the connection broke before the first byte
    MID_STREAM = "mid_stream"  # broke off after the client got the first byte
    IDLE = "idle"  # a started stream stalled past idle_s / total_s
    # The worker refused to continue another worker's broken stream (4xx): nothing bad
    # about its health.
    REFUSED = "refused"
    # The worker refused the request as longer than its context (a 400 naming its
    # `max_model_len`): retried on a worker with a longer one, if any; nothing bad about
    # its health.
    TOO_LONG = "too_long"
    # The worker said it does not serve the model its heartbeat lists (a 404 "does not
    # exist": an adapter unloaded, another model loaded, and its next heartbeat not out
    # yet): retried on another worker; nothing bad about its health.
    NOT_SERVED = "not_served"


@dataclass(slots=True)
class Attempt:
    """One try of a request on one worker. Times are monotonic seconds."""

    worker_id: str
    region: str
    predicted_ttft_ms: float
    reason: str
    started_s: float
    first_byte_s: float | None = None
    finished_s: float | None = None
    status: int | None = None
    failure: Failure | None = None
    error: str | None = None  # what broke it, for logs and traces (may name the worker)
    client_gone: bool = False
    # The client stopped reading for longer than client_timeouts.stall_s and was cut off:
    # its problem, never counted against the worker.
    client_stalled: bool = False
    streamed: bool = False
    batch: bool = False  # a batch-class attempt (counted in router.policy.batch_room)
    retry_after_s: float | None = None
    # While waiting for the first byte: the deadline that `abandon` brings forward.
    first_byte_deadline: Reschedulable | None = None
    abandoned: str | None = None
    # Whether its request could be sent to another worker now (its retry would find
    # one): passive health abandons an attempt on a worker found stalled only then, and
    # otherwise lets it wait, since that worker may only be slow (None: abandon).
    elsewhere: Callable[[], bool] | None = None
    # A non-streaming answer whose head has come: its body is arriving on this connection
    # (passive health tells a worker sending a large body from one that went silent).
    answering: ReadCounter | None = None
    answer_head: tuple[int, float] | None = None  # its reads and the time its head came
    # The predicted TTFT's parts (None: the policy predicts none; predicted_ttft_ms is
    # their total when given).
    prediction: Prediction | None = None
    # The tokens it may generate, as committed to its worker (InFlight.commit); 0: unsaid.
    committed_tokens: int = 0
    # A started stream's pace as the router passed it on: the reads from the worker
    # after the first event (each one gap between chunks) and when the relay ended.
    # Counted per stream, not timed per chunk: a clock read per chunk cost 5-15 % more
    # instructions per streamed request (`globalpool bench-instructions`).
    stream_gaps: int = 0
    stream_ended_s: float | None = None
    # Hedged streams (router.proxy.hedging): the wait before the copy (`reason` "hedge")
    # was sent; `outrun`: the other copy answered first and this one was cancelled (its
    # wait is a lower bound of its TTFT).
    hedge_delay_s: float | None = None
    outrun: bool = False
    # Its region's probe (router.health.penalties): traffic left the region, and this
    # stream finds out whether it is still slow.
    probe: bool = False
    # Of its wait for the first byte, how long opening a new connection to the worker
    # took (0: a kept-alive one), and whether it is opening one now: a one-off cost,
    # which passive health excuses up to what the handshakes should take
    # (router.health.penalties.handshake_s).
    connect_s: float = 0.0
    connecting: bool = False
    # Its prompt's tokens still to prefill on the worker (not in its prefix cache), until
    # the first byte or its end: counted there by `prefilled` (InFlight.prefill_ended).
    prefill_tokens: int = 0
    prefilled: Callable[[str, int], None] | None = None

    def first_byte(self, now_s: float) -> None:
        """The worker's first byte came at `now_s`: its prompt is prefilled."""
        self.first_byte_s = now_s
        if self.prefill_tokens:
            self.end_prefill()

    def end_prefill(self) -> None:
        """Its prompt no longer waits to be prefilled (a first byte, or the attempt ended)."""
        tokens, self.prefill_tokens = self.prefill_tokens, 0
        if tokens and self.prefilled is not None:
            self.prefilled(self.worker_id, tokens)

    @property
    def ttfb_s(self) -> float | None:
        return None if self.first_byte_s is None else self.first_byte_s - self.started_s

    @property
    def mean_itl_s(self) -> float | None:
        """The mean gap between the chunks of the stream it relayed (first byte -> end of
        the relay, over the reads after the first); None without a gap."""
        first_s, ended_s, gaps = self.first_byte_s, self.stream_ended_s, self.stream_gaps
        if first_s is None or ended_s is None or gaps <= 0:
            return None
        return (ended_s - first_s) / gaps

    def abandon(self, reason: str) -> bool:
        """Give up waiting for the first byte now (the attempt fails as a TIMEOUT and the
        request is retried elsewhere). Only before the first byte; True if it was."""
        deadline = self.first_byte_deadline
        if deadline is None or self.first_byte_s is not None or self.abandoned is not None:
            return False
        self.abandoned = reason
        deadline.reschedule(asyncio.get_running_loop().time())
        return True


@dataclass(slots=True)
class RequestRecord:
    """One client request from arrival to its last byte."""

    model: str
    kind: str
    stream: bool
    origin_region: str | None
    received_s: float
    traffic_class: str = "interactive"
    ttft_budget_ms: float | None = None  # the client's `x-globalpool-ttft-budget-ms`
    attempts: list[Attempt] = field(default_factory=list)
    status: int = 0
    routed_s: float | None = None
    queued_s: float = 0.0  # waited at the router for a worker with room
    finished_s: float | None = None
    error: str | None = None
    request_id: str = ""  # the client's `x-request-id`, or the router's (router.proxy.request_id)
    # Mid-stream failover: attempts that continued the stream, and how it ended
    # ("continued", "failed", "finished", or "not_continued"); None: no stream broke.
    continuations: int = 0
    failover: str | None = None
    # why not continued, or why a stream ended here lacks its usage (a fixed phrase: a label)
    failover_reason: str | None = None
    # Called with a stream's first event and its attempt before it is passed on (the
    # Responses API records there which worker holds the response), if set.
    on_first_event: Callable[[bytes, Attempt], None] | None = None

    @classmethod
    def unrouted(cls, path: str, origin_region: str | None, received_s: float,
                 request_id: str, exc: Exception) -> RequestRecord:
        """A request to `path` the router failed before parsing it: counted as a 500."""
        return cls(model="", kind=KIND_BY_PATH.get(path, "chat"), stream=False,
                   origin_region=origin_region, received_s=received_s,
                   request_id=request_id, status=500, error=f"internal error: {type(exc).__name__}")

    @property
    def first_streamed(self) -> Attempt | None:
        """The attempt whose first byte started the answer (the client's TTFT)."""
        if not self.continuations:
            return self.served_by
        for attempt in self.attempts:
            if attempt.first_byte_s is not None:
                return attempt
        return None

    @property
    def ttft_s(self) -> float | None:
        """The client's time to first token: arrival at the router -> the stream's first
        byte passed on (the router's queue and failed attempts included). None for an
        answer that is not a stream (its first byte is the whole answer) and for a stream
        that never started (an error answer is no first token)."""
        if not self.stream:
            return None
        first = self.first_streamed
        if first is None or first.first_byte_s is None or first.status != 200:
            return None
        return first.first_byte_s - self.received_s

    @property
    def ttft_budget_met(self) -> bool | None:
        """Whether the client's TTFT budget was met; None when there is nothing to tell:
        no budget, not a stream, or a client that left before its first byte while its
        budget still ran. A stream that never started (no worker, a full queue, every
        attempt failed, or its client left after the budget ran out) missed it."""
        budget_ms = self.ttft_budget_ms
        if budget_ms is None or not self.stream:
            return None
        ttft_s = self.ttft_s
        if ttft_s is not None:
            return ttft_s * 1000.0 <= budget_ms
        if self.status == 499 and self.finished_s is not None and (
                self.finished_s - self.received_s) * 1000.0 < budget_ms:
            return None
        return False

    @property
    def served_by(self) -> Attempt | None:
        """The attempt whose answer the client got, if any."""
        last = self.attempts[-1] if self.attempts else None
        return last if last is not None and last.first_byte_s is not None else None


class Observer(Protocol):
    def attempt_finished(self, attempt: Attempt) -> None: ...

    def request_finished(self, record: RequestRecord) -> None: ...
