"""`bench-proxy`'s three workloads, in a full and a `--quick` size."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

MODEL = "bench"
PACED_MODEL = "bench-paced"  # the fake backends pace this model's tokens
PACED_DELAY_MS = 10.0
PACED_STAGGER_S = 32 * PACED_DELAY_MS / 1000  # one paced stream's length


@dataclass(frozen=True)
class Workload:
    """One closed-loop load: `concurrency` clients, each on its own keep-alive connection,
    sending one request after another until `requests` are answered or `time_limit_s`
    passes (after `warmup_requests` that are not counted). Client i starts
    i / concurrency x `stagger_s` after the others' first: the paced streams are spread over
    one stream's length, as independent clients' are, instead of all starting together
    and arriving again together every ~330 ms (waves of 256 new requests at once, whose
    last one waits for the other 255 to be routed: that, not the router's latency, was
    the TTFT p99 every router added; BENCHMARKS.md)."""

    name: str
    title: str
    model: str
    stream: bool
    tokens: int
    concurrency: int
    requests: int
    warmup_requests: int
    time_limit_s: float
    stagger_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, document: dict[str, Any]) -> Workload:
        return cls(**document)

    def body(self) -> bytes:
        stream = "true" if self.stream else "false"
        return (f'{{"model":"{self.model}","messages":[{{"role":"user","content":'
                f'"Say hello to the benchmark, please."}}],"max_tokens":{self.tokens},'
                f'"stream":{stream}}}').encode()


def workloads(quick: bool) -> list[Workload]:
    """Non-streaming; 32 tokens back to back; 32 tokens 10 ms apart at 256 concurrent."""
    if quick:
        return [
            Workload("unary", "non-streaming", MODEL, False, 32, 16, 1000, 100, 3.0),
            Workload("stream", "stream 32 tok back to back", MODEL, True, 32, 16, 400, 50, 3.0),
            Workload("paced", "stream 32 tok 10 ms apart, 256 conc.", PACED_MODEL, True, 32,
                     256, 512, 256, 3.0, PACED_STAGGER_S),
        ]
    return [
        Workload("unary", "non-streaming", MODEL, False, 32, 32, 20000, 1000, 25.0),
        Workload("stream", "stream 32 tok back to back", MODEL, True, 32, 32, 8000, 500, 25.0),
        Workload("paced", "stream 32 tok 10 ms apart, 256 conc.", PACED_MODEL, True, 32, 256,
                 8000, 512, 25.0, PACED_STAGGER_S),
    ]
