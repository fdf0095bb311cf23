"""Router replicas share which worker holds which long prompt prefix, on real processes:
two router apps, a real Valkey, two simulators (router.policy.affinity, shared through
router.registry.peers)."""

from __future__ import annotations

import aiohttp

from router.app import PROXY, SECURITY_STATS
from router.core.parse import prefix_keys_of
from router.proxy.replies import ROUTE_HEADER, WORKER_HEADER
from tests.integration.operators_fleet import OpsFleet, wait_for

SYSTEM_CHARS = 6_000  # ~1,500 tokens: three prefix keys (router.core.parse.PREFIX_CHARS)


def system_prompt(number: int) -> str:
    return f"You are assistant number {number}. " + f"Rule {number}: be brief. " * 300


async def test_a_prefix_one_replica_sent_is_followed_by_the_other(fleet: OpsFleet) -> None:
    """Replica A sends six requests, each opening with its own long system prompt, to two
    idle workers. Replica B then sends a next question under each system prompt: each goes
    to the worker A sent that prompt to, as an affinity choice, learned from A's reports
    only (B has sent none of them). Without the sharing B picks between the two workers
    by two random choices, and matches A's six only by chance (1 in 64)."""
    await fleet.start({"w1": "us-east", "w2": "us-east"}, replicas=2)
    a, b = (app[PROXY] for app in fleet.apps)
    for proxy in (a, b):
        await wait_for(lambda p=proxy: set(p.holder.current.workers) == {"w1", "w2"})
    async with aiohttp.ClientSession() as session:
        first = [await ask(session, fleet.urls[0], system_prompt(n), "Hello?")
                 for n in range(6)]
        for number in range(6):
            keys = prefix_keys_of([system_prompt(number)])
            await wait_for(lambda k=keys: bool(b.policy.context.affinity.lookup(None, k)))
        follow = [await ask(session, fleet.urls[1], system_prompt(n), "And then?")
                  for n in range(6)]
    assert [worker for worker, _ in follow] == [worker for worker, _ in first], (first, follow)
    assert {route for _, route in follow} == {"affinity"}, follow


async def test_an_absurd_max_tokens_does_not_cost_a_replica_its_peers_trust(
        fleet: OpsFleet) -> None:
    """A client's max_tokens of 10**12 under a long system prompt: replica A counts the
    tokens it may write to the worker's cache (whatever the engine makes of the request)
    and reports them. Its report must stay believable: B still takes it (A's prompt is
    followed) and drops none. Before the figures were clamped, every peer refused A's
    reports whole (its open requests with them) until the figure aged out."""
    await fleet.start({"w1": "us-east", "w2": "us-east"}, replicas=2)
    a, b = (app[PROXY] for app in fleet.apps)
    for proxy in (a, b):
        await wait_for(lambda p=proxy: set(p.holder.current.workers) == {"w1", "w2"})
    body = {"model": "m", "stream": True, "max_tokens": 10**12, "messages": [
        {"role": "system", "content": system_prompt(7)}, {"role": "user", "content": "Hi"}]}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{fleet.urls[0]}/v1/chat/completions", json=body) as answer:
            await answer.read()  # served or refused: either way A counted it as sent
        keys = prefix_keys_of([system_prompt(7)])
        await wait_for(lambda: bool(b.policy.context.affinity.lookup(None, keys)))
        await ask(session, fleet.urls[0], system_prompt(8), "And a normal one")
        await wait_for(lambda: bool(b.policy.context.affinity.lookup(
            None, prefix_keys_of([system_prompt(8)]))))
    dropped = fleet.apps[1][SECURITY_STATS].peer_reports_dropped
    assert not any(dropped.values()), dict(dropped)


async def ask(session: aiohttp.ClientSession, url: str, system: str,
              question: str) -> tuple[str, str]:
    """A streamed chat request; the worker it went to and why."""
    body = {"model": "m", "stream": True, "max_tokens": 2, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": question}]}
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        await response.read()
        return response.headers[WORKER_HEADER], response.headers[ROUTE_HEADER]
