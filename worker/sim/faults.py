"""Fault knobs for tests and failover drills, changed at run time via /sim/faults.

Random faults draw from one RNG seeded with the server's --seed, so a drill with the same
seed and the same request order fails the same requests.
"""

from __future__ import annotations

import random
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


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
        default=False, description="completion requests are accepted and never answered"
    )
    slow_factor: float = Field(
        default=1.0, gt=0.0, description="multiplies prefill and decode time"
    )
    busy_in_stream: bool = Field(
        default=False,
        description="a stream refused by a full queue gets 200 and then an error event (503), "
        "as vLLM 0.32 answers a request its engine refuses after the API server admitted it",
    )
    unhealthy: bool = Field(default=False, description="/health answers 503")
    crash: bool = Field(default=False, description="setting it exits the process with status 1")


class FaultInjector:
    """Holds the knobs and makes the seeded random draws."""

    def __init__(self, knobs: FaultKnobs, seed: int) -> None:
        self.knobs = knobs
        self._rng = random.Random(seed)

    def update(self, changes: dict[str, Any]) -> FaultKnobs:
        """Apply a partial update; raises pydantic.ValidationError and keeps the old knobs."""
        self.knobs = FaultKnobs.model_validate({**self.knobs.model_dump(), **changes})
        return self.knobs

    def draw_error(self) -> bool:
        rate = self.knobs.error_rate
        return rate > 0.0 and self._rng.random() < rate

    def draw_mid_stream_cut(self) -> int | None:
        """Tokens to send before cutting the connection, or None to let the request live."""
        rate = self.knobs.mid_stream_error_rate
        if rate > 0.0 and self._rng.random() < rate:
            return self._rng.randint(1, 3)
        return None
