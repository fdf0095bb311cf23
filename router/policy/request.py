"""What routing knows of a request, and what it decides."""

from __future__ import annotations

from dataclasses import dataclass

from router.registry.snapshot import WorkerView


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What routing knows of one request.

    `origin_region` is where the client is (this router's region unless the request
    names another); `prompt_tokens` is an estimate; `exclude` holds workers already tried
    for this request (a retry never returns to them).
    """

    model: str
    origin_region: str | None
    prompt_tokens: int = 0
    stream: bool = False
    exclude: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen worker, its predicted time to first token and why it was chosen."""

    worker: WorkerView
    predicted_ttft_ms: float
    reason: str  # "local" | "spillover" | policy-specific
    candidates: int


class NoRoute(Exception):
    """No worker can take the request now; `reason` is safe to show to the client."""

    def __init__(self, reason: str, *, model_known: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.model_known = model_known
