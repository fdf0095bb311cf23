"""The drills that take Redis's primary away: on a Sentinel group (`redis-failover`) and
on a Valkey Cluster (`redis-cluster-failover`). Each measures, from the kill: the
promotion of a replica, and every heartbeat fresh again in the router."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import aiohttp
import redis
import redis.sentinel

from lab.devstack.cluster import key_slot
from lab.devstack.valkey import EmbeddedRedisError, EmbeddedValkey
from lab.drill.analysis import Target
from lab.drill.scenarios import DrillContext, Scenario

FRESH_AFTER_FAILOVER_S = 10.0  # the goal: heartbeats fresh again this soon after it


class RedisFailover(Scenario, name="redis-failover",
                    summary="SIGKILL the Redis primary (Sentinel promotes its replica); the "
                    "old primary rejoins as a replica when cleared"):
    """Redis runs as a Sentinel group here, and the routers and agents use its
    `redis+sentinel://` URL. Measured on the way: kill -> the sentinels name a new primary
    (`promoted_after_s`), and -> every heartbeat the router holds is fresh again
    (`heartbeats_fresh_after_s`: each younger than `fresh_s`)."""

    quick_fault_s = 10.0
    needs_sentinel = True

    def __init__(self, context: DrillContext) -> None:
        super().__init__(context)
        self.killed: EmbeddedValkey | None = None
        self.failover: dict[str, float | str | None] = {}
        interval_s = self.stack.config.heartbeat.interval_s
        self.fresh_s = max(1.0, 2.0 * interval_s)
        self.group = context.sentinel
        if self.needs_sentinel and self.group is None:
            raise ValueError(f"{self.name} runs on a Sentinel group")

    def target(self) -> Target:
        return Target()

    async def _kill(self) -> EmbeddedValkey:
        assert self.group is not None
        killed = await asyncio.to_thread(self.group.kill_primary)
        self.context.mark(f"SIGKILL the Redis primary (port {killed.port})")
        return killed

    async def _promoted(self, killed: EmbeddedValkey) -> str:
        """The address of the node that took over from `killed` (raises
        EmbeddedRedisError when none did in 30 s)."""
        assert self.group is not None
        host, port = await asyncio.to_thread(self.group.wait_for_new_primary, killed, 30.0)
        return f"{host}:{port}"

    async def inject(self) -> None:
        killed_at = self.context.now_s()
        killed_at_unix_s = time.time()
        self.killed = await self._kill()
        self.failover = {"killed_at_s": round(killed_at, 3), "promoted_after_s": None,
                         "heartbeats_fresh_after_s": None, "fresh_s": self.fresh_s,
                         "agents_published_after_s": None}
        # Measured beside the router's view: see `_published`.
        published = asyncio.create_task(self._published(killed_at_unix_s))
        try:
            await self._promoted_and_fresh(killed_at)
        finally:
            await published

    async def _promoted_and_fresh(self, killed_at: float) -> None:
        assert self.killed is not None
        try:
            address = await self._promoted(self.killed)
        except EmbeddedRedisError as exc:
            self.context.mark(f"no new primary: {exc}")
            return
        promoted_s = self.context.now_s() - killed_at
        self.failover["promoted_after_s"] = round(promoted_s, 3)
        self.failover["new_primary"] = address
        self.context.mark(f"a replica was promoted: {address} ({promoted_s:.2f} s after "
                          "the kill)")
        fresh_s = await self._heartbeats_fresh(deadline_s=killed_at + promoted_s + 30.0)
        if fresh_s is not None:
            self.failover["heartbeats_fresh_after_s"] = round(fresh_s - killed_at, 3)
            self.context.mark(f"every heartbeat fresh again ({fresh_s - killed_at:.2f} s "
                              "after the kill)")

    async def _published(self, since_unix_s: float) -> None:
        """When every agent's heartbeat in Redis is one sent after the kill
        (`agents_published_after_s`): the router keeps a worker it cannot hear from in its
        view while Redis is out of reach (fail static), so its view alone can look fresh
        before the agents are through."""
        after_s = await asyncio.to_thread(every_heartbeat_sent_after, self._reader,
                                          self.stack.key_prefix, len(self.stack.by_role("sim")),
                                          since_unix_s)
        self.failover["agents_published_after_s"] = after_s
        if after_s is not None:
            self.context.mark(f"every agent's heartbeat in Redis again ({after_s:.2f} s "
                              "after the kill)")

    def _reader(self) -> redis.Redis | redis.RedisCluster:
        """A client that reads the heartbeat keys wherever the primary is now."""
        assert self.group is not None
        sentinels = redis.sentinel.Sentinel(  # type: ignore[no-untyped-call]
            [(s.host, s.port) for s in self.group.sentinels], socket_timeout=1.0)
        primary: redis.Redis = sentinels.master_for(  # type: ignore[no-untyped-call]
            self.group.service, password=self.group.password, socket_timeout=1.0)
        return primary

    async def _heartbeats_fresh(self, deadline_s: float) -> float | None:
        """Poll /admin/status until every worker's heartbeat is younger than `fresh_s`;
        when it was (seconds since the load started), or None by `deadline_s`."""
        workers = len(self.stack.by_role("sim"))
        headers = {"Authorization": f"Bearer {self.stack.admin_token}"}
        timeout = aiohttp.ClientTimeout(total=1.0)
        async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
            while self.context.now_s() < deadline_s:
                asked_s = self.context.now_s()
                try:
                    async with session.get(f"{self.stack.router_url}/admin/status"
                                           f"?workers={workers}") as response:
                        status = await response.json()
                    ages = [w["heartbeat_age_s"] for w in status["workers"]]
                    if (status["redis"]["connected"] and len(ages) == workers
                            and max(ages) < self.fresh_s):
                        return asked_s
                except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError):
                    pass
                await asyncio.sleep(0.1)
        return None

    async def clear(self) -> None:
        if self.killed is None or self.group is None:
            return
        address = await asyncio.to_thread(self.group.primary_address)
        if address is None:
            self.context.mark("no primary to rejoin")
            return
        await asyncio.to_thread(self.group.rejoin, self.killed, address)
        self.context.mark(f"the old primary (port {self.killed.port}) rejoins as a replica "
                          f"of {address[0]}:{address[1]}")


class RedisClusterFailover(RedisFailover, name="redis-cluster-failover",
                           summary="SIGKILL the cluster primary of the region's heartbeat "
                           "slot (its replica is promoted); it stays down"):
    """Redis runs as a Valkey Cluster here (three primaries, a replica each), and the
    routers and agents use its `redis+cluster://` URL. The node killed holds the slot of
    the drill region's heartbeat plane (`{region}`)."""

    needs_sentinel = False
    needs_cluster = True

    def __init__(self, context: DrillContext) -> None:
        super().__init__(context)
        if context.cluster is None:
            raise ValueError(f"{self.name} runs on a Valkey Cluster")
        self.cluster = context.cluster

    async def _kill(self) -> EmbeddedValkey:
        slot = key_slot(f"{{{self.region}}}".encode())
        node = await asyncio.to_thread(self.cluster.node_for_slot, slot)
        await asyncio.to_thread(self.cluster.kill, node)
        self.context.mark(f"SIGKILL the cluster primary of {self.region}'s heartbeat slot "
                          f"{slot} (port {node.port})")
        return node

    async def _promoted(self, killed: EmbeddedValkey) -> str:
        node = await asyncio.to_thread(self.cluster.wait_for_failover, killed, 30.0)
        return f"{node.host}:{node.port}"

    def _reader(self) -> redis.Redis | redis.RedisCluster:
        live = next(node for node in self.cluster.primaries if node not in self.cluster.killed)
        return redis.RedisCluster(host=live.host, port=live.port,
                                  password=self.cluster.password, socket_timeout=1.0)

    async def clear(self) -> None:
        self.context.mark("the cluster runs on with the promoted replica (the killed "
                          "node stays down)")


def every_heartbeat_sent_after(connect: Callable[[], redis.Redis | redis.RedisCluster],
                                prefix: str, workers: int, since_unix_s: float,
                                timeout_s: float = 40.0) -> float | None:
    """Seconds after `since_unix_s` at which the `workers` heartbeat keys (exactly so
    many) each hold a heartbeat sent after it (None: not within `timeout_s`); read
    through `connect()`."""
    client = connect()
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                keys = list(client.scan_iter(match=f"{prefix}:hb:*", count=1000))
                values = (client.mget_nonatomic(keys) if isinstance(client, redis.RedisCluster)
                          else client.mget(keys)) if keys else []
                sent = [json.loads(raw)["sent_at_s"] for raw in values if raw is not None]
            except redis.RedisError:
                sent = []
            if len(sent) == workers and min(sent) > since_unix_s:
                return round(time.time() - since_unix_s, 3)
            time.sleep(0.1)
        return None
    finally:
        client.close()
