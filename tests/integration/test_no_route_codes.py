"""The answer when no worker can take a request, end to end: each cause its own status
and code, with Retry-After on every 503 and nothing internal in the message; against real
simulators, a real Valkey and the real router app (the test publishes the heartbeats)."""

from __future__ import annotations

import pytest

from router.app import HOLDER
from tests.integration import test_security_fleet as harness
from tests.integration.test_security import error_of
from tests.integration.test_security_fleet import SecureFleet, secure_fleet, wait_for
from worker.heartbeat_keys import HeartbeatKeys
from worker.redis_client import connect
from worker.schema import LifecycleState

__all__ = ["secure_fleet"]
pytestmark = pytest.mark.integration


async def refused(fleet: SecureFleet, tenant: str, model: str = "m") -> tuple[int, str, str]:
    """(status, code, message) of a refused request; checks what every refusal holds."""
    status, headers, body = await fleet.chat(tenant, {**harness.CHAT, "model": model})
    error = error_of(body)
    message: str = error["message"]
    for internal in (*fleet.sims, "x1", "127.0.0.1"):
        assert internal not in message, message
    if status == 503:
        assert headers.get("Retry-After") == "1", dict(headers)
    return status, error["code"], message


def state_of(fleet: SecureFleet, worker_id: str) -> LifecycleState | None:
    view = fleet.apps[0][HOLDER].current.workers.get(worker_id)
    return None if view is None else view.heartbeat.state


async def leave(fleet: SecureFleet, worker_id: str) -> None:
    """The worker's heartbeat is deleted and its agent says it has gone (as on exit)."""
    redis = connect(fleet.redis_url)
    try:
        keys = HeartbeatKeys(fleet.key_prefix)
        await redis.delete(keys.worker(worker_id))
        await redis.publish(keys.channel, keys.gone_message(worker_id))
    finally:
        await redis.aclose()
    await wait_for(lambda: worker_id not in fleet.known_workers(), f"{worker_id} to leave")


async def test_each_cause_has_its_own_code(secure_fleet: harness.FleetFactory) -> None:
    # eu-west is drained (regions.yaml); us-east is not.
    fleet = await secure_fleet({"us1": "us-east", "eu1": "eu-west"},
                               regions={"eu-west": {"drain": True}})
    await wait_for(lambda: fleet.known_workers() == {"us1", "eu1"}, "both workers known")

    # A tenant held to the drained region: residency forbids the one region left.
    status, code, message = await refused(fleet, "euco")
    assert (status, code) == (503, "region_unavailable")
    assert "(eu-west)" in message and "us-east" not in message
    status, headers, _ = await fleet.chat("acme")
    assert (status, headers["x-globalpool-region"]) == (200, "us-east")

    # A model no worker serves or served lately, that regions.yaml does not list.
    status, code, _ = await refused(fleet, "acme", model="nonesuch")
    assert (status, code) == (404, "model_not_found")

    # A LoRA adapter (regions.yaml lists base models only) whose only worker dies and
    # leaves the pool: still known, so 503 and Retry-After, not 404.
    only = harness.heartbeat_for("x1", "us-east", fleet.sims["us1"].url, harness.next_seq())
    await fleet.publish_heartbeat(only.model_copy(update={"lora_adapters": ("x",)}))
    await wait_for(lambda: "x1" in fleet.known_workers(), "x1 to join")
    await leave(fleet, "x1")
    status, code, message = await refused(fleet, "acme", model="x")
    assert (status, code) == (503, "model_unavailable"), message

    # us-east's worker stops too: every live worker drained or draining, for everyone.
    await fleet.publish("us1", state=LifecycleState.DRAINING)
    await wait_for(lambda: state_of(fleet, "us1") is LifecycleState.DRAINING, "us1 draining")
    for tenant in ("acme", "euco"):
        status, code, _ = await refused(fleet, tenant)
        assert (status, code) == (503, "draining"), tenant

    # Then both leave: the model is listed in regions.yaml, so 503 whatever the memory.
    await leave(fleet, "us1")
    await leave(fleet, "eu1")
    status, code, _ = await refused(fleet, "acme")
    assert (status, code) == (503, "model_unavailable")
