"""Fault knobs for tests and failover drills, changed at run time via /sim/faults.

Random faults draw from one RNG seeded with the server's --seed, so a drill with the same
seed and the same request order fails the same requests. The injector also keeps when
completion requests arrived since the knobs last changed (`GET /sim/arrivals`), so that a
drill can tell when a router stopped sending to a faulty worker, whatever the answer was.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Ways to answer a completion request wrongly at the HTTP or TCP level (lab.sim.misbehave).
Misbehaviour = Literal[
    "none", "no_answer", "headers_then_hang", "half_body_close", "wrong_content_length",
    "short_content_length", "huge_headers", "endless_body", "garbage", "reset_mid_stream",
    "slow_tokens", "too_long_lie",
]
# Arrival times kept for GET /sim/arrivals (the count goes on past it).
MAX_ARRIVALS = 10_000


class FaultKnobs(BaseModel):
    """The current faults. A POST to /sim/faults changes only the fields it names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    error_rate: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="fraction of completion requests answered 500 before the first byte",
    )
    mid_stream_error_rate: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="fraction of completion requests whose connection is cut after 1-3 tokens",
    )
    hang: bool = Field(
        default=False, description="completion requests are accepted and not answered while "
        "it is set (not counted by the engine either); clearing it serves those still waiting"
    )
    wedge: bool = Field(
        default=False, description="the engine runs no step while it is set, as on a wedged "
        "accelerator: requests are taken in and counted (running, waiting) as usual, "
        "/health and /metrics answer, and no token comes nor is any request aborted (an "
        "engine core that does not run cannot); clearing it resumes them all"
    )
    slow_factor: float = Field(
        default=1.0, gt=0.0, description="multiplies prefill and decode time"
    )
    busy_in_stream: bool = Field(
        default=False,
        description="a stream refused by a full queue gets 200 and then an error event (503), "
        "as vLLM 0.32 answers a request its engine refuses after the API server admitted it",
    )
    misbehave: Misbehaviour = Field(
        default="none",
        description="how completion requests (chat and completions, streaming or not) are "
        "answered wrongly, once their body was read, while the engine serves them as usual "
        "(its metrics look healthy: unlike `hang`, only the router's own observations show "
        "the fault). no_answer: never; "
        "headers_then_hang: 200 and the headers, then nothing; half_body_close: half of the "
        "body (of the JSON answer, or of the first token's SSE event), then FIN; "
        "wrong_content_length: the whole body under a Content-Length 100 bytes larger, then "
        "FIN; short_content_length: the whole body under a Content-Length 100 bytes smaller, "
        "the connection left open; huge_headers: 10 MB of header lines before a valid "
        "answer; endless_body: a 200 whose body never ends (a token every 10 ms) until the "
        "client goes away; garbage: 4 KB of bytes that are not HTTP, then FIN; "
        "reset_mid_stream: the headers and 3 tokens (or half the JSON body), then a TCP RST; "
        "slow_tokens: a valid answer at one token per slow_token_interval_s; too_long_lie: "
        "vLLM's 400 refusing the prompt as too long for a context of 1,000,000,000 tokens, "
        "whatever its length (a buggy or lying engine)",
    )
    slow_token_interval_s: float = Field(
        default=5.0, gt=0.0, le=3600.0, description="seconds per token of misbehave=slow_tokens"
    )
    unserved: bool = Field(
        default=False, description="requests for its models get vLLM's 404 'The model `X` does "
        "not exist.' while /v1/models still lists them: an adapter unloaded, or the engine "
        "restarted with another model, before its agent's next heartbeat says so")
    unhealthy: bool = Field(default=False, description="/health answers 503")
    crash: bool = Field(default=False, description="setting it exits the process with status 1")


class FaultInjector:
    """Holds the knobs and makes the seeded random draws."""

    def __init__(
        self, knobs: FaultKnobs, seed: int, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.knobs = knobs
        self._rng = random.Random(seed)
        self._clock = clock
        self.changed_at_unix_s = clock()
        self.arrived_total = 0
        self.arrivals_unix_s: deque[float] = deque(maxlen=MAX_ARRIVALS)

    def update(self, changes: dict[str, Any]) -> FaultKnobs:
        """Apply a partial update; raises pydantic.ValidationError and keeps the old knobs.

        An accepted update starts a new record of arrivals."""
        self.knobs = FaultKnobs.model_validate({**self.knobs.model_dump(), **changes})
        self.changed_at_unix_s = self._clock()
        self.arrived_total = 0
        self.arrivals_unix_s.clear()
        return self.knobs

    def arrived(self) -> None:
        """A completion request was read (whatever its answer will be)."""
        self.arrived_total += 1
        self.arrivals_unix_s.append(self._clock())

    def arrivals(self) -> dict[str, Any]:
        """Completion requests read since the knobs last changed: their count, and the
        arrival times (Unix seconds) of the last MAX_ARRIVALS."""
        return {
            "since_unix_s": self.changed_at_unix_s,
            "completion_requests": self.arrived_total,
            "arrivals_unix_s": list(self.arrivals_unix_s),
        }

    def draw_error(self) -> bool:
        rate = self.knobs.error_rate
        return rate > 0.0 and self._rng.random() < rate

    def draw_mid_stream_cut(self) -> int | None:
        """Tokens to send before cutting the connection, or None to let the request live."""
        rate = self.knobs.mid_stream_error_rate
        if rate > 0.0 and self._rng.random() < rate:
            return self._rng.randint(1, 3)
        return None
