"""`regions.yaml` as typed, versioned, frozen models: `GlobalConfig` and its parts.

Reading and validating a file into them, with errors that name the file, the path and the
reason, is router.config_loader's.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from router.auth.config import AuthConfig
from router.auth.endpoints import entry_problem
from router.batch_config import BatchConfig
from worker import redis_client

API_VERSION = "globalpool/v1"

_REGION_NAME = r"^[a-z0-9]([a-z0-9-]{0,62}[a-z0-9])?$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class RedisConfig(_Strict):
    url: str = Field(
        default="embedded",
        description="redis://, rediss:// (TLS), unix://, redis+sentinel://HOST:PORT[,...]/"
        "SERVICE or redis+cluster://HOST:PORT[,...] URL; 'embedded' = the Valkey that "
        "`globalpool up` starts. The REDIS_URL environment variable overrides it.",
    )
    key_prefix: str = Field(default="globalpool", pattern=r"^[A-Za-z0-9:_.-]+$")

    @field_validator("url")
    @classmethod
    def _usable_url(cls, url: str) -> str:
        problem = redis_url_problem(url)
        if problem is not None:
            raise ValueError(problem)
        return url


def redis_url_problem(url: str) -> str | None:
    """Why the router and agents cannot use `url` (None: they can). The same check for
    regions.yaml, --redis-url and REDIS_URL, made before anything listens."""
    return None if url == "embedded" else redis_client.url_problem(url)


class Timeouts(_Strict):
    """Split upstream timeouts. Each covers one phase of one upstream attempt."""

    connect_s: float = Field(default=2.0, gt=0, description="TCP connect to a worker")
    first_byte_s: float = Field(
        default=120.0, gt=0, description="request sent -> response headers from the worker"
    )
    idle_s: float = Field(default=60.0, gt=0, description="longest gap between two body chunks")
    total_s: float = Field(default=900.0, gt=0, description="whole attempt, first byte to last")


class HealthConfig(_Strict):
    """Passive health checks: how the router ejects failing workers on its own."""

    failures_to_eject: int = Field(
        default=3, ge=1, description="failures in a row (5xx, timeouts, broken streams) "
        "that eject a worker; a refused or reset connection ejects at once")
    base_backoff_s: float = Field(default=1.0, gt=0, description="first ejection's length")
    max_backoff_s: float = Field(default=30.0, gt=0, description="cap of the doubling backoff")
    retry_budget_ratio: float = Field(
        default=0.2, ge=0, le=1, description="retries may add at most this share of load")
    retry_budget_min_per_s: float = Field(
        default=5.0, ge=0, description="retries allowed per second even when traffic is low")
    stall_after_s: float = Field(
        default=3.0, gt=0, le=3600,
        description="a stream waiting this long for its first byte (and stall_factor times "
        "its predicted TTFT) while other workers answer marks its worker stalled: the worker "
        "is ejected and its waiting requests are retried elsewhere, without waiting for "
        "timeouts.first_byte_s")
    stall_factor: float = Field(
        default=10.0, ge=1, description="see stall_after_s")


class ClientTimeouts(_Strict):
    """Limits on slow clients (slowloris): each covers one phase of reading a request."""

    header_s: float = Field(
        default=30.0, gt=0, le=3600,
        description="a connection that has not sent complete request headers this long "
        "after it opened (or after its last answer: keep-alive idle) is closed",
    )
    body_s: float = Field(
        default=60.0, gt=0, le=3600, description="reading the whole request body -> 408"
    )
    stall_s: float = Field(
        default=60.0, gt=0, le=3600,
        description="a streaming client that takes none of its answer this long (its "
        "connection's send buffer full and not draining) is disconnected and counted as a "
        "client problem; its worker's request is cancelled, never counted against it",
    )


class QueueConfig(_Strict):
    """Requests wait at the router, interactive first, while every candidate worker is
    busy (router.admission.queue)."""

    enabled: bool = True
    max_requests: int = Field(
        default=1000, ge=1, le=1_000_000,
        description="requests waiting at once; past that a request is refused (503)",
    )
    max_wait_ms: float = Field(
        default=5000.0, ge=0, le=600_000,
        description="the longest a request waits (less when its TTFT budget says so); "
        "then it goes to the best worker, whose engine queues it",
    )


class StreamFailoverConfig(_Strict):
    """Mid-stream failover (router.proxy.continuation): a stream whose worker fails after
    its first byte is finished on another worker, the client seeing one stream."""

    enabled: bool = Field(
        default=True, description="continue streams whose worker fails mid-stream on "
        "another worker (same region first); a client opts out per request with the "
        "header `x-globalpool-failover: off`")
    disabled_models: list[str] = Field(
        default_factory=list, description="models whose streams are never continued (for "
        "example one whose chat template cannot continue an assistant message): they end "
        "with an error event when their worker fails, as without failover")


class HedgingConfig(_Strict):
    """Hedged first tokens (router.proxy.hedging): a stream with no first token after a
    delay is sent again to the next-best worker; the first to answer is kept, the other
    aborted."""

    classes: list[Literal["interactive", "batch"]] = Field(
        default_factory=list, description="traffic classes whose streams are hedged (none "
        "by default: a client opts in per request with the header `x-globalpool-hedge: on`, "
        "or out with `off`)")
    max_fraction: float = Field(
        default=0.05, ge=0.0, le=1.0, description="at most this share of the streams that "
        "may be hedged is hedged (each hedge is extra engine work: the copy's prefill, "
        "until one of the two answers)")
    max_burst: int = Field(
        default=20, ge=1, le=10_000, description="at most this many copies at once, from "
        "the share saved while none was needed (a slow region's first seconds, before the "
        "router learns to avoid it, make many streams late together)")
    quantile: float = Field(
        default=0.9, gt=0.0, lt=1.0, description="the hedge is sent when no first token came "
        "within the predicted TTFT times this quantile of recent measured/predicted TTFTs")
    min_delay_ms: float = Field(
        default=50.0, ge=0.0, description="never hedge sooner than this after sending")
    max_delay_ms: float = Field(
        default=3_000.0, gt=0.0, description="never wait longer than this before hedging")

    @model_validator(mode="after")
    def _ordered(self) -> HedgingConfig:
        if self.min_delay_ms > self.max_delay_ms:
            raise ValueError("min_delay_ms is more than max_delay_ms")
        return self


class ResponsesConfig(_Strict):
    """The Responses API's stored responses: each replica records in Redis which worker
    holds each one (router.registry.response_store)."""

    ttl_s: float = Field(
        default=86_400.0, gt=0, le=30 * 86_400,
        description="how long any replica can find the worker that holds a stored response "
        "(its record in Redis, ~200 bytes, expires then; vLLM keeps the response itself in "
        "memory until it restarts)",
    )


# router.fleet_view_cpu_share's default (router.registry.pace paces the collector by it).
DEFAULT_FLEET_VIEW_CPU_SHARE = 0.1


class RouterConfig(_Strict):
    region: str | None = Field(default=None, description="the region this replica runs in")
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    policy: str = "predicted_ttft"
    near_equal_ms: float = Field(
        default=5.0, ge=0, description="scores this close to the best count as equally good"
    )
    peer_interval_ms: float = Field(
        default=50.0, ge=0, le=5000,
        description="how often this replica tells the other replicas sharing its Redis what "
        "it has open on each worker, so that they count it between heartbeats (0: never)",
    )
    fleet_view_cpu_share: float = Field(
        default=DEFAULT_FLEET_VIEW_CPU_SHARE, ge=0.01, le=1.0,
        description="the share of one core that keeping the view of the fleet may take: a "
        "large fleet's load records are read and the view rebuilt less often (up to every "
        "2 s) to stay within it; more = a fresher view of a large fleet (read every "
        "~1.3-1.5 s at 10,000 workers with 0.1)",
    )
    worker_metrics: bool = Field(
        default=True,
        description="expose the per-worker gauges in /metrics (capacity, load, TTFT and ITL "
        "of every worker: ~40,000 samples and 3.2 MB a scrape at 10,000 workers); false "
        "keeps the count of workers by region and state",
    )
    fail_static_s: float = Field(
        default=300.0, gt=0, le=86_400,
        description="while Redis is unreachable the router keeps serving from its last view "
        "of the fleet (fail static) and stays ready for this long; past it /ready answers "
        "503 and load balancers send clients to replicas that can see the fleet",
    )
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    max_attempts: int = Field(
        default=3, ge=1, le=5, description="attempts per request; retries only before first byte"
    )
    timeouts: Timeouts = Timeouts()
    queue: QueueConfig = QueueConfig()
    health: HealthConfig = HealthConfig()
    max_json_depth: int = Field(
        default=64, ge=2, le=512, description="deepest nesting of arrays/objects in a body"
    )
    client_timeouts: ClientTimeouts = ClientTimeouts()
    stream_failover: StreamFailoverConfig = StreamFailoverConfig()
    hedging: HedgingConfig = HedgingConfig()
    responses: ResponsesConfig = ResponsesConfig()


class HeartbeatConfig(_Strict):
    interval_s: float = Field(default=0.5, gt=0, le=60)
    ttl_s: float = Field(default=2.0, gt=0, le=600)
    stuck_after_s: float = Field(
        default=15.0, gt=0, le=86_400,
        description="an agent says its worker is `degraded` once the engine has held "
        "requests this long without running a step (a wedged accelerator: /health and "
        "/metrics still answer); routers then retry what waits there elsewhere")
    max_clock_skew_s: float = Field(
        default=5.0, ge=0, le=600,
        description="signed heartbeats sent further in the future, or older than their "
        "ttl_s by more than this, are dropped (replays)",
    )
    insecure: bool = Field(
        default=False,
        description="believe unsigned heartbeats when the router has no signing keys: "
        "anyone who can write to Redis can then steer traffic (a warned opt-out, shown on "
        "the status page); without it, a router with no keys refuses every heartbeat",
    )

    @model_validator(mode="after")
    def _ttl_covers_intervals(self) -> HeartbeatConfig:
        if self.ttl_s < 2 * self.interval_s:
            raise ValueError("ttl_s must be at least twice interval_s")
        return self


class SimulatedPool(_Strict):
    """How `globalpool up` simulates this region's GPU pool (ignored by real deployments)."""

    workers: int = Field(default=2, ge=0, le=64)
    max_num_seqs: int = Field(default=16, ge=1)
    kv_blocks: int = Field(default=2048, ge=16)
    block_size: int = Field(default=16, ge=1)
    prefill_tokens_per_s: float = Field(default=8000.0, gt=0)
    decode_step_ms: float = Field(default=15.0, gt=0)
    decode_step_ms_per_seq: float = Field(default=0.5, ge=0)
    max_model_len: int = Field(default=4096, ge=1, description="context length in tokens")

    @model_validator(mode="after")
    def _one_sequence_fits_the_cache(self) -> SimulatedPool:  # (else vLLM does not start)
        if self.max_model_len > self.kv_blocks * self.block_size:
            raise ValueError(f"max_model_len {self.max_model_len} does not fit the KV cache "
                             f"of kv_blocks x block_size = {self.kv_blocks * self.block_size}")
        return self


class RegionConfig(_Strict):
    rtt_ms: dict[str, float] = Field(
        default_factory=dict, description="round-trip time in ms from this region to others"
    )
    models: list[str] = Field(min_length=1)
    cost_per_gpu_hour: float = Field(
        default=1.0, ge=0, description="what a GPU hour costs here; batch traffic goes to the "
        "cheapest region with spare capacity")
    drain: bool = Field(
        default=False, description="drained: the region gets no new requests (in-flight ones "
        "finish); the admin API can drain and undrain at run time too")
    simulated: SimulatedPool = SimulatedPool()
    allowed_endpoints: list[str] | None = Field(
        default=None, min_length=1,
        description="hosts, IPs, CIDRs or *.suffix names the region's workers may advertise; "
        "heartbeats with other endpoints are dropped (omitted: private and loopback IP "
        "addresses only; 0.0.0.0/0 and ::/0 allow any)",
    )
    upstream_api_key_env: str | None = Field(
        default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="environment variable with the key sent as `Authorization: Bearer` to "
        "this region's workers",
    )

    @field_validator("allowed_endpoints")
    @classmethod
    def _valid_endpoints(cls, entries: list[str] | None) -> list[str] | None:
        problems = [p for p in map(entry_problem, entries or ()) if p is not None]
        if problems:
            raise ValueError("; ".join(problems))
        return entries


class AdminConfig(_Strict):
    """The operators' surface: admin API token and hot reload of this file."""

    token_env: str = Field(
        default="GLOBALPOOL_ADMIN_TOKEN", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="environment variable holding the admin token; unset = admin API off",
    )
    config_check_s: float = Field(
        default=0.5, ge=0, le=3600,
        description="how often the router checks this file for changes (hot reload); 0 = never",
    )
    metrics_auth: Literal["none", "admin_token", "scrape_token"] = Field(
        default="none",
        description="what /metrics asks for: nothing, the admin token, or the scrape token "
        "(from scrape_token_env), as `Authorization: Bearer <token>`",
    )
    scrape_token_env: str = Field(
        default="GLOBALPOOL_SCRAPE_TOKEN", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="environment variable holding the scrape token (metrics_auth: scrape_token)",
    )


class GlobalConfig(_Strict):
    apiVersion: Literal["globalpool/v1"]
    redis: RedisConfig = RedisConfig()
    router: RouterConfig = RouterConfig()
    heartbeat: HeartbeatConfig = HeartbeatConfig()
    admin: AdminConfig = AdminConfig()
    auth: AuthConfig = AuthConfig()
    batch: BatchConfig = BatchConfig()
    regions: dict[str, RegionConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _check_references(self) -> GlobalConfig:
        problems: list[str] = []
        names = set(self.regions)
        for name, region in self.regions.items():
            if not _valid_region_name(name):
                problems.append(f"regions.{name}: region names are lowercase letters, digits, '-'")
            for other, rtt in region.rtt_ms.items():
                if other not in names:
                    problems.append(f"regions.{name}.rtt_ms.{other}: no such region")
                elif rtt < 0:
                    problems.append(f"regions.{name}.rtt_ms.{other}: must be >= 0")
        for a in sorted(names):
            for b in sorted(names):
                if a < b and b not in self.regions[a].rtt_ms and a not in self.regions[b].rtt_ms:
                    problems.append(f"regions.{a}.rtt_ms.{b}: missing (give it in either region)")
        if self.router.region is not None and self.router.region not in names:
            problems.append(f"router.region: no region named {self.router.region!r}")
        problems.extend(self.auth.problems(names))
        if problems:
            raise ReferenceErrors(problems)
        return self

    def cost_per_gpu_hour(self, region: str) -> float:
        spec = self.regions.get(region)
        return 1.0 if spec is None else spec.cost_per_gpu_hour

    def rtt_ms(self, src: str, dst: str) -> float:
        """Round-trip ms from `src` to `dst`; symmetric when only one direction is given."""
        forward = self.regions[src].rtt_ms.get(dst) if src in self.regions else None
        if forward is not None:
            return forward
        backward = self.regions[dst].rtt_ms.get(src) if dst in self.regions else None
        if backward is not None:
            return backward
        return 0.0 if src == dst else 1000.0

    @property
    def models(self) -> list[str]:
        seen: dict[str, None] = {}
        for region in self.regions.values():
            seen.update(dict.fromkeys(region.models))
        return list(seen)


class ReferenceErrors(ValueError):
    """What the whole document's check finds (region names, RTTs between regions, regions
    and tenants that other fields name), each with its path: router.config_loader
    reports every one as its own problem."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


def _valid_region_name(name: str) -> bool:
    return re.fullmatch(_REGION_NAME, name) is not None
