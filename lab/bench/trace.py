"""A trace: the requests of one benchmark run, saved as JSONL and replayed identically.

Line 1 is a header (the format, the scenario, the seed, the capacity the rates were
derived from); each further line is one request: when it is sent (seconds after the
start), from which origin region, its class, session, prefix group, output length and
its prompt as text segments. A segment is `[seed, chars]`: `chars` characters of
pseudo-words drawn from `seed`, so the trace stays small and the same trace always
produces byte-identical prompts. Every policy of a run replays the same trace.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TRACE_FORMAT = "globalpool-bench-trace/1"

_WORDS = (
    "region", "latency", "token", "prefill", "decode", "router", "cache", "queue", "batch",
    "engine", "global", "request", "stream", "worker", "model", "answer", "pool", "spill",
    "prefix", "session", "budget", "heartbeat", "replica", "capacity", "the", "of", "and",
    "to", "is", "in", "for", "with", "on", "a", "what", "how", "why", "when", "explain",
)  # fmt: skip

Segment = tuple[int, int]  # (seed, chars)


def segment_text(seed: int, chars: int) -> str:
    """`chars` characters of pseudo-words, always the same for the same seed."""
    rng = random.Random(seed)
    parts: list[str] = []
    length = 0
    while length < chars:
        word = rng.choice(_WORDS)
        parts.append(word)
        length += len(word) + 1
    return " ".join(parts)[:chars]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    `system` is the shared part (a prefix group's text or a session's preamble), sent as
    the system message; `user` the rest. `prefix_group` and `session_id` say what the
    request shares with others (None: nothing).
    """

    index: int
    at_s: float
    origin: str
    traffic_class: str  # "interactive" | "batch"
    max_tokens: int
    user: tuple[Segment, ...]
    system: Segment | None = None
    prefix_group: int | None = None
    session_id: str | None = None
    turn: int | None = None
    ttft_budget_ms: float | None = None

    @property
    def prompt_chars(self) -> int:
        """Characters of all message contents (user segments are joined by a space)."""
        system = self.system[1] if self.system else 0
        return system + sum(c for _, c in self.user) + len(self.user) - 1

    def to_json(self) -> dict[str, Any]:
        document = asdict(self)
        document["user"] = [list(segment) for segment in self.user]
        document["system"] = list(self.system) if self.system else None
        return {k: v for k, v in document.items() if v is not None}

    @staticmethod
    def from_json(document: dict[str, Any]) -> TraceRequest:
        system = document.get("system")
        return TraceRequest(
            index=int(document["index"]), at_s=float(document["at_s"]),
            origin=str(document["origin"]), traffic_class=str(document["traffic_class"]),
            max_tokens=int(document["max_tokens"]),
            user=tuple((int(s), int(c)) for s, c in document["user"]),
            system=(int(system[0]), int(system[1])) if system else None,
            prefix_group=document.get("prefix_group"), session_id=document.get("session_id"),
            turn=document.get("turn"), ttft_budget_ms=document.get("ttft_budget_ms"),
        )


@dataclass(frozen=True)
class Trace:
    """A header and the requests in send order."""

    header: dict[str, Any]
    requests: tuple[TraceRequest, ...] = field(default_factory=tuple)

    @property
    def duration_s(self) -> float:
        return float(self.header["duration_s"])

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as out:
            out.write(json.dumps({"format": TRACE_FORMAT, **self.header}) + "\n")
            for request in self.requests:
                out.write(json.dumps(request.to_json(), separators=(",", ":")) + "\n")

    @staticmethod
    def load(path: Path) -> Trace:
        """Read a saved trace; ValueError says what is wrong and on which line."""
        lines = path.read_text(encoding="utf-8").splitlines()
        if not lines:
            raise ValueError(f"{path}: empty file, expected a trace header")
        header = json.loads(lines[0])
        if header.get("format") != TRACE_FORMAT:
            raise ValueError(f"{path}: line 1: not a {TRACE_FORMAT} header")
        requests = []
        for number, line in enumerate(lines[1:], start=2):
            try:
                requests.append(TraceRequest.from_json(json.loads(line)))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}: line {number}: {exc}") from None
        header.pop("format")
        return Trace(header=header, requests=tuple(requests))


class PromptBuilder:
    """Turns trace requests into request bodies; caches shared segments' text.

    `salt` (a few characters put before every prompt, the same length for every salt)
    makes one replay's prompts differ from another's byte for byte while keeping every
    length and every shared prefix: a simulator reused for the next policy then finds
    nothing of the previous run in its prefix cache.
    """

    def __init__(self, model: str, salt: str = "") -> None:
        self.model = model
        self.salt = salt
        self._cache: dict[Segment, str] = {}

    def text(self, segment: Segment) -> str:
        cached = self._cache.get(segment)
        if cached is None:
            cached = self._cache[segment] = segment_text(*segment)
        return cached

    def messages(self, request: TraceRequest) -> list[dict[str, str]]:
        user = " ".join(self.text(segment) for segment in request.user)
        if request.system is None:
            return [{"role": "user", "content": self.salt + user}]
        return [{"role": "system", "content": self.salt + self.text(request.system)},
                {"role": "user", "content": user}]

    def body(self, request: TraceRequest) -> bytes:
        document = {"model": self.model, "stream": True, "max_tokens": request.max_tokens,
                    "ignore_eos": True, "messages": self.messages(request)}
        return json.dumps(document, separators=(",", ":")).encode()

    def bodies(self, requests: Iterable[TraceRequest]) -> list[bytes]:
        return [self.body(request) for request in requests]


def offered_per_second(requests: Sequence[TraceRequest], duration_s: float,
                       origin: str | None = None) -> list[int]:
    """Requests sent in each whole second of the run (of one origin, or all)."""
    counts = [0] * max(1, int(duration_s + 0.999))
    for request in requests:
        if origin is None or request.origin == origin:
            counts[min(len(counts) - 1, int(request.at_s))] += 1
    return counts
