"""Heartbeats for fake backends, written by the real publisher (worker/publisher.py).

The benchmark's backends have no worker agent; this task stands in for one per backend:
every `interval_s` it publishes a signed `ready` heartbeat with an idle load, so the
globalpool router under test sees them as a live one-region pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence

from worker import redis_client
from worker.heartbeat_keys import HeartbeatKeys
from worker.publisher import HeartbeatPublisher, RedisUnavailableError
from worker.schema import Capacity, Heartbeat, LifecycleState, Load, Performance
from worker.signing import HeartbeatSigner, parse_keys

REGION = "bench"


def backend_heartbeat(index: int, endpoint: str, models: Sequence[str], seq: int,
                      ttl_s: float, region: str = REGION) -> Heartbeat:
    return Heartbeat(
        worker_id=f"bench-{index}", region=region, endpoint=endpoint, models=tuple(models),
        state=LifecycleState.READY,
        capacity=Capacity(max_num_seqs=256, kv_blocks_total=8192, block_size_tokens=16),
        load=Load(running=0, waiting=0, kv_cache_usage=0.0),
        performance=Performance(ttft_ms=5.0, itl_ms=1.0, e2e_ms=50.0,
                                prefill_tokens_per_s=100_000.0, decode_tokens_per_s=5_000.0),
        seq=seq, sent_at_s=time.time(), ttl_s=ttl_s,
    )


async def publish_heartbeats(
    redis_url: str, prefix: str, endpoints: Sequence[str], signing_keys: str,
    *, models: Sequence[str], interval_s: float = 0.5, ttl_s: float = 2.0,
) -> Callable[[], Awaitable[None]]:
    """Start publishing (the first round is written before this returns); returns `stop`,
    which removes the heartbeats and closes the connection."""
    key_id, secret = next(iter(parse_keys(signing_keys).items()))
    publisher = HeartbeatPublisher(redis_client.connect(redis_url), HeartbeatKeys(prefix),
                                   signer=HeartbeatSigner(key_id=key_id, secret=secret))

    async def one_round(seq: int) -> None:
        for index, endpoint in enumerate(endpoints):
            await publisher.publish(backend_heartbeat(index, endpoint, models, seq, ttl_s))

    async def loop() -> None:
        seq = 1
        while True:
            await asyncio.sleep(interval_s)
            with contextlib.suppress(RedisUnavailableError):
                await one_round(seq)
            seq += 1

    await one_round(0)
    task = asyncio.create_task(loop(), name="bench-heartbeats")

    async def stop() -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for index in range(len(endpoints)):
            with contextlib.suppress(RedisUnavailableError):
                await publisher.remove(f"bench-{index}")
        await publisher.aclose()

    return stop
