"""terraform/scripts/redis.sh and lib.sh's redis_url, run: the functions the start-up
scripts are made of, called with bash here (no cloud, no metadata server).

- the configurations of redis-server and of the sentinel open no plain-text port, use
  TLS for replication and between sentinels, and require the password, however it is
  spelled;
- the sentinel's file keeps what the sentinel has learnt across boots (its id, the
  epochs, the primary it names now, the nodes it knows) and renews the rest (a rotated
  password, a new quorum);
- a node's certificate is signed by the operator's CA, is valid for the node's address
  (what clients check), and the CA's key is never written to disk;
- redis_url writes the CA and gives a URL that worker.redis_client reads as TLS Sentinel;
- with redis-server here: three nodes configured by these functions, on loopback
  addresses, lose their primary (SIGKILL); the sentinels promote another and a client of
  redis_url's URL writes again within the 10 s budget; the old primary, booted again the
  way the start-up script boots a node, follows the new primary and its sentinel keeps
  its identity.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import random
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.conftest import skip_for_missing_tool
from tests.terraform.tfcli import TERRAFORM_DIR
from worker.redis_client import SentinelURL, connect, url_problem

SCRIPTS_DIR = TERRAFORM_DIR / "scripts"
BASH = shutil.which("bash")
OPENSSL = shutil.which("openssl")
SERVICE = "globalpool"
# Characters that a naive configuration file or URL would break on.
PASSWORD = 'p@ss "w\\rd" #1 $x/y:z%+&='

pytestmark = pytest.mark.skipif(BASH is None, reason="bash is not installed")


def _functions(path: Path, replacements: Mapping[str, str] | None = None,
               extra: str = "") -> Path:
    """lib.sh and redis.sh as one file that defines every function and runs nothing
    (redis.sh's last line, `main "$@"`, left out), with text replaced (paths, ports) and
    `extra` (stubs) appended, written to PATH."""
    lib = (SCRIPTS_DIR / "lib.sh").read_text(encoding="utf-8")
    redis_sh = (SCRIPTS_DIR / "redis.sh").read_text(encoding="utf-8")
    body, _, last = redis_sh.rstrip("\n").rpartition("\n")
    assert last == 'main "$@"', "redis.sh must end by calling main"
    text = f"{lib}\n{body}\n"
    for old, new in (replacements or {}).items():
        assert old in text, f"the scripts no longer contain {old!r}"
        text = text.replace(old, new)
    path.write_text(text + extra, encoding="utf-8")
    return path


def _call(functions: Path, *argv: str, stdin: str | None = None,
          env: Mapping[str, str] | None = None) -> str:
    """Run one function of FUNCTIONS with ARGV; its stdout (it must succeed)."""
    assert BASH is not None
    result = subprocess.run([BASH, "-c", 'source "$1"; shift; "$@"', "bash", str(functions), *argv],
                            input=stdin, capture_output=True, text=True, timeout=120, check=False,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 0, f"{argv[0]} exited {result.returncode}:\n{result.stderr}"
    return result.stdout


def _directives(config: str) -> list[list[str]]:
    """A Redis configuration file's lines as words, quotes resolved (`"a \\" b"` is one
    word, as Redis reads it), comments and blank lines left out."""
    return [shlex.split(line) for line in config.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def _single(config: str) -> dict[str, list[str]]:
    """The directives that are not `sentinel ...`, each by name; every name once."""
    lines = [words for words in _directives(config) if words[0] != "sentinel"]
    names = [words[0] for words in lines]
    assert len(names) == len(set(names)), f"a directive is repeated: {names}"
    return {words[0]: words[1:] for words in lines}


def _sentinel(config: str, directive: str) -> list[list[str]]:
    return [words[2:] for words in _directives(config)
            if words[:2] == ["sentinel", directive]]


@pytest.fixture
def functions(tmp_path: Path) -> Path:
    return _functions(tmp_path / "functions.sh")


@pytest.mark.parametrize("primary", [None, "10.64.16.5"])
def test_redis_conf_listens_with_tls_only_and_requires_the_password(
        functions: Path, primary: str | None) -> None:
    config = _call(functions, "redis_conf", "10.64.0.5", PASSWORD, *([primary] if primary else []))
    directives = _single(config)
    assert directives["port"] == ["0"], "no plain-text port"
    assert directives["tls-port"] == ["6379"]
    assert directives["tls-replication"] == ["yes"]
    assert directives["tls-auth-clients"] == ["no"]
    for name in ("tls-cert-file", "tls-key-file", "tls-ca-cert-file"):
        assert directives[name][0].startswith("/etc/redis/tls/"), name
    assert directives["requirepass"] == [PASSWORD]
    assert directives["masterauth"] == [PASSWORD]
    assert directives["replica-announce-ip"] == ["10.64.0.5"]
    if primary is None:
        assert "replicaof" not in directives
    else:
        assert directives["replicaof"] == [primary, "6379"]


def test_a_new_sentinel_conf_monitors_the_primary_with_tls_and_the_password(
        functions: Path, tmp_path: Path) -> None:
    config = _call(functions, "sentinel_conf", str(tmp_path / "absent.conf"), SERVICE,
                   "10.64.0.5", "10.64.16.5", "2", "3000", "5000", PASSWORD)
    directives = _single(config)
    assert directives["port"] == ["0"], "no plain-text port"
    assert directives["tls-port"] == ["26379"]
    assert directives["tls-replication"] == ["yes"], "TLS to the nodes and other sentinels"
    assert directives["requirepass"] == [PASSWORD]
    assert directives["dir"] == ["/var/lib/globalpool-sentinel"]
    assert _sentinel(config, "monitor") == [[SERVICE, "10.64.16.5", "6379", "2"]]
    assert _sentinel(config, "auth-pass") == [[SERVICE, PASSWORD]]
    assert _sentinel(config, "announce-ip") == [["10.64.0.5"]]
    assert _sentinel(config, "down-after-milliseconds") == [[SERVICE, "3000"]]
    assert _sentinel(config, "failover-timeout") == [[SERVICE, "5000"]]


# The sentinel's file after a failover to 10.64.32.5, as redis-server 7.0 rewrites it:
# its own lines in its own order, the password as an ACL hash, an unquoted auth-pass.
_LEARNT = """\
sentinel myid 140c82e41adefa6d0cfbaf124a25ad9e32a77c42
sentinel config-epoch globalpool 4
sentinel leader-epoch globalpool 4
sentinel current-epoch 4
sentinel known-replica globalpool 10.64.0.5 6379
sentinel known-replica globalpool 10.64.16.5 6379
sentinel known-sentinel globalpool 10.64.32.5 26379 6de7623b70758d83c369aa72a488ea56a370af4a
sentinel known-sentinel globalpool 10.64.16.5 26379 882a8345fafb69f6f66fc5a182af75e5b9ce5f72
"""
_REWRITTEN = f"""\
port 0
tls-port 26379
tls-cert-file "/etc/redis/tls/node.crt"
requirepass "old-password"
sentinel announce-ip "10.64.0.5"
sentinel monitor globalpool 10.64.32.5 6379 2
sentinel down-after-milliseconds globalpool 30000

protected-mode no
user default on #682ed5ab9596ae9bccd8ada48cff7f0355462f5a9c284fffe54bc52053e717d1 ~* &* +@all
{_LEARNT}
sentinel auth-pass globalpool old-password
"""


def test_sentinel_conf_keeps_what_the_sentinel_learnt_and_renews_the_rest(
        functions: Path, tmp_path: Path) -> None:
    """A boot after a failover: the sentinel still names the primary it promoted, keeps its
    id and epochs, and takes the new password and quorum; a second boot changes nothing."""
    state = tmp_path / "sentinel.conf"
    state.write_text(_REWRITTEN, encoding="utf-8")
    argv = ("sentinel_conf", str(state), SERVICE, "10.64.0.5", "10.64.0.5", "3", "3000", "5000",
            PASSWORD)
    config = _call(functions, *argv)
    for line in _LEARNT.splitlines():
        assert line in config.splitlines(), f"forgot {line!r}"
    assert _sentinel(config, "monitor") == [[SERVICE, "10.64.32.5", "6379", "3"]], (
        "the primary the sentinel learnt, with the quorum of today")
    assert "old-password" not in config and "user default" not in config
    assert _single(config)["requirepass"] == [PASSWORD]
    assert _sentinel(config, "auth-pass") == [[SERVICE, PASSWORD]]
    assert _sentinel(config, "down-after-milliseconds") == [[SERVICE, "3000"]]
    # The monitored service is declared before the lines that name it.
    lines = config.splitlines()
    monitor = next(i for i, line in enumerate(lines) if line.startswith("sentinel monitor "))
    assert all(i > monitor for i, line in enumerate(lines)
               if re.match(rf"sentinel \S+ {SERVICE} ", line) and i != monitor)
    state.write_text(config, encoding="utf-8")
    assert _call(functions, *argv) == config, "booting again changes nothing"


def test_a_node_that_no_sentinel_answers_follows_what_its_own_sentinel_knew(
        functions: Path, tmp_path: Path) -> None:
    """When every node boots at once, none can ask another: each follows the primary its
    own sentinel last named, not its role at the deployment's first start."""
    state = tmp_path / "sentinel.conf"
    assert _call(functions, "learnt_primary", str(state), SERVICE) == ""
    state.write_text(_REWRITTEN, encoding="utf-8")
    assert _call(functions, "learnt_primary", str(state), SERVICE) == "10.64.32.5\n"
    assert _call(functions, "learnt_primary", str(state), "another") == ""
    # No sentinel answers (none listens on these addresses): the fallback wins.
    assert _call(functions, "boot_primary", "10.64.0.5", "10.64.32.5", PASSWORD, SERVICE,
                 "127.0.0.1") == "10.64.32.5\n"


def _make_ca(folder: Path) -> tuple[Path, Path]:
    assert OPENSSL is not None
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = folder / "ca.pem", folder / "ca.key"
    subprocess.run([OPENSSL, "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:P-256", "-nodes", "-days", "2", "-subj",
                    "/CN=globalpool-redis-ca", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


@pytest.mark.skipif(OPENSSL is None, reason="openssl is not installed")
def test_node_certificate_is_signed_by_the_ca_for_the_node_address(
        functions: Path, tmp_path: Path) -> None:
    assert OPENSSL is not None
    ca_cert, ca_key = _make_ca(tmp_path / "ca")
    tls = tmp_path / "tls"
    tls.mkdir()
    shutil.copy(ca_cert, tls / "ca.pem")
    _call(functions, "node_certificate", str(tls), "10.64.0.5",
          "redis-us-east.gp.globalpool.internal", stdin=ca_key.read_text(encoding="utf-8"))
    assert sorted(path.name for path in tls.iterdir()) == ["ca.pem", "node.crt", "node.key"], (
        "the CA's key is never written to disk")
    assert stat.S_IMODE((tls / "node.key").stat().st_mode) == 0o640
    verify = subprocess.run([OPENSSL, "verify", "-CAfile", str(ca_cert), str(tls / "node.crt")],
                            capture_output=True, text=True, check=False)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    for check in (["-checkip", "10.64.0.5"], ["-checkip", "127.0.0.1"],
                  ["-checkhost", "redis-us-east.gp.globalpool.internal"]):
        matched = subprocess.run([OPENSSL, "x509", "-noout", "-in", str(tls / "node.crt"), *check],
                                 capture_output=True, text=True, check=True)
        assert "does match" in matched.stdout, matched.stdout
    # The key of another CA: refused, with a message that names the secrets.
    _, other_key = _make_ca(tmp_path / "other")
    assert BASH is not None
    refused = subprocess.run(
        [BASH, "-c", 'source "$1"; shift; "$@"', "bash", str(functions), "node_certificate",
         str(tls), "10.64.0.5", "redis-us-east"],
        input=other_key.read_text(encoding="utf-8"), capture_output=True, text=True, check=False)
    assert refused.returncode != 0 and "redis-tls-ca-key" in refused.stderr, refused.stderr


def _client_stubs(sentinels: str) -> str:
    """`setting` and `secret` as the metadata server and Secret Manager would answer a
    router (TEST_PASSWORD, TEST_CA_FILE from the environment)."""
    return f"""
setting() {{
  case $1 in
    redis_sentinels) echo {shlex.quote(sentinels)} ;;
    redis_service) echo {SERVICE} ;;
    *) echo "projects/p/secrets/$1" ;;
  esac
}}
secret() {{
  case $1 in
    */redis_password_secret) printf '%s' "$TEST_PASSWORD" ;;
    */redis_tls_ca_cert_secret) cat "$TEST_CA_FILE" ;;
    *) return 1 ;;
  esac
}}
"""


def _client_functions(path: Path, etc: Path, sentinels: str) -> Path:
    """lib.sh's functions with /etc/globalpool moved to ETC (and files left to the user
    running the test), answering as a router's metadata would."""
    etc.mkdir(parents=True, exist_ok=True)
    return _functions(path, {"readonly ETC=/etc/globalpool": f"readonly ETC={etc}",
                             "install -m 0644 -o root -g root /dev/stdin":
                                 "install -m 0644 /dev/stdin"},
                      extra=_client_stubs(sentinels))


def test_redis_url_is_a_tls_sentinel_url_with_the_ca(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n",
                  encoding="utf-8")
    etc = tmp_path / "etc"
    sentinels = "10.64.0.5:26379,10.64.16.5:26379,10.64.32.5:26379"
    functions = _client_functions(tmp_path / "functions.sh", etc, sentinels)
    url = _call(functions, "redis_url", env={"TEST_PASSWORD": PASSWORD, "TEST_CA_FILE": str(ca)})
    assert url_problem(url) is None, url_problem(url)
    parsed = SentinelURL.parse(url)
    assert parsed.tls, "TLS to the sentinels and to the primary"
    assert parsed.sentinels == (("10.64.0.5", 26379), ("10.64.16.5", 26379), ("10.64.32.5", 26379))
    assert (parsed.service, parsed.db) == (SERVICE, 0)
    assert parsed.password == PASSWORD and parsed.sentinel_password == PASSWORD
    assert parsed.ssl_ca_certs == str(etc / "redis-ca.pem")
    assert (etc / "redis-ca.pem").read_text(encoding="utf-8") == ca.read_text(encoding="utf-8")
    assert stat.S_IMODE((etc / "redis-ca.pem").stat().st_mode) == 0o644


# Real processes: three nodes on loopback addresses of their own, as the script sets them up.

_LOOPBACK_NODES = ("127.0.0.11", "127.0.0.12", "127.0.0.13")


def _topology_value(name: str) -> int:
    """A number of the topology module's `redis` local (what Terraform gives the nodes)."""
    text = (TERRAFORM_DIR / "modules" / "topology" / "main.tf").read_text(encoding="utf-8")
    found = re.search(rf"^\s*{name}\s*=\s*(\d+)\s*$", text, re.M)
    assert found is not None, name
    return int(found[1])


def _free_ports() -> tuple[int, int]:
    """A data port and a sentinel port free on every node's address."""
    for _ in range(50):
        ports = tuple(random.sample(range(20000, 60000), 2))
        held: list[socket.socket] = []
        try:
            for host in _LOOPBACK_NODES:
                for port in ports:
                    held.append(sock := socket.socket())
                    sock.bind((host, port))
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
        return ports[0], ports[1]
    pytest.skip("no free ports on 127.0.0.11-13")


@dataclass
class _Node:
    """One Redis VM, on a loopback address: its folder, its copy of the functions (paths
    and ports moved there) and its two processes."""

    address: str
    folder: Path
    functions: Path
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, kind: str, config: str) -> None:
        path = self.folder / f"{kind}.conf"
        if kind == "sentinel":
            path = self.folder / "sentinel" / "sentinel.conf"
        path.write_text(config, encoding="utf-8")
        argv = ["redis-server", str(path), *(["--sentinel"] if kind == "sentinel" else [])]
        with (self.folder / f"{kind}.log").open("ab") as log:
            self.processes[kind] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def stop(self, kind: str, sig: int = signal.SIGTERM) -> None:
        process = self.processes.pop(kind, None)
        if process is not None and process.poll() is None:
            process.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
            if process.poll() is None:
                process.kill()
                process.wait()

    def log(self, kind: str) -> str:
        path = self.folder / f"{kind}.log"
        return path.read_text(encoding="utf-8", errors="replace")[-2000:] if path.exists() else ""


def _wait(what: str, check: Callable[[], bool], timeout_s: float,
          nodes: list[_Node]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(redis.RedisError, OSError):
            if check():
                return
        time.sleep(0.1)
    logs = "\n".join(f"--- {node.address} {kind}\n{node.log(kind)}" for node in nodes
                     for kind in ("redis", "sentinel"))
    pytest.fail(f"{what} within {timeout_s:g} s\n{logs}")


@pytest.fixture
def redis_binaries() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("needs 127.0.0.11-13 (Linux routes all of 127/8 to loopback)")
    for tool in ("redis-server", "redis-cli", "openssl", "timeout"):
        if shutil.which(tool) is None:
            skip_for_missing_tool(f"{tool} is not installed (Debian/Ubuntu: apt-get install "
                                  "redis-server)")


async def _write_until_ok(url: str, timeout_s: float, interval_s: float) -> float | None:
    """Write as an agent does (every INTERVAL_S) until a write succeeds: the seconds that
    took, None if none did within TIMEOUT_S."""
    client = connect(url)
    start = time.monotonic()
    try:
        while time.monotonic() - start < timeout_s:
            with contextlib.suppress(redis.RedisError, OSError):
                await client.set("globalpool:test:heartbeat", str(time.time()))
                return time.monotonic() - start
            await asyncio.sleep(interval_s)
        return None
    finally:
        await client.aclose()


@pytest.mark.integration
@pytest.mark.timeout(180)
@pytest.mark.usefixtures("redis_binaries")
@pytest.mark.slow(why="a primary lost and rebooted under the scripts (~18 s)")
def test_a_lost_primary_is_replaced_within_the_budget_and_follows_after_its_reboot(
        tmp_path: Path) -> None:
    data_port, sentinel_port = _free_ports()
    ca_cert, ca_key = _make_ca(tmp_path / "ca")
    quorum = str(len(_LOOPBACK_NODES) // 2 + 1)
    down_after_ms = _topology_value("down_after_ms")
    failover_timeout_ms = _topology_value("failover_timeout_ms")
    nodes: list[_Node] = []
    for number, address in enumerate(_LOOPBACK_NODES):
        folder = tmp_path / f"node{number}"
        for sub in ("tls", "data", "sentinel"):
            (folder / sub).mkdir(parents=True)
        shutil.copy(ca_cert, folder / "tls" / "ca.pem")
        functions = _functions(folder / "functions.sh", {
            "readonly REDIS_PORT=6379": f"readonly REDIS_PORT={data_port}",
            "readonly SENTINEL_PORT=26379": f"readonly SENTINEL_PORT={sentinel_port}",
            "readonly REDIS_TLS=/etc/redis/tls": f"readonly REDIS_TLS={folder}/tls",
            "readonly SENTINEL_DIR=/var/lib/globalpool-sentinel":
                f"readonly SENTINEL_DIR={folder}/sentinel",
            "dir /var/lib/redis": f"dir {folder}/data",
            "pidfile /run/redis/redis-server.pid": f"pidfile {folder}/redis.pid",
            "bind 0.0.0.0": f"bind {address}",
        })
        _call(functions, "node_certificate", str(folder / "tls"), address, f"redis-{number}",
              stdin=ca_key.read_text(encoding="utf-8"))
        nodes.append(_Node(address, folder, functions))
    primary = nodes[0]

    def server(node: _Node, port: int, **kwargs: Any) -> redis.Redis:
        return redis.Redis(host=node.address, port=port, password=PASSWORD, ssl=True,
                           ssl_ca_certs=str(ca_cert), socket_timeout=2,
                           socket_connect_timeout=2, decode_responses=True, **kwargs)

    def sentinel(node: _Node, *words: str) -> Any:
        client = server(node, sentinel_port)
        return client.execute_command("SENTINEL", *words)  # type: ignore[no-untyped-call]

    def sentinel_master(node: _Node) -> dict[str, str]:
        reply = sentinel(node, "MASTER", SERVICE)
        if isinstance(reply, dict):
            return {str(k): str(v) for k, v in reply.items()}
        return dict(zip(reply[::2], reply[1::2], strict=True))

    def named_primary(node: _Node) -> str:
        return str(sentinel(node, "GET-MASTER-ADDR-BY-NAME", SERVICE)[0])

    def in_sync(node: _Node, leader: str) -> bool:
        info = server(node, data_port).info("replication")
        return bool(info.get("master_host") == leader and info.get("master_link_status") == "up")

    try:
        for node in nodes:
            node.start("redis", _call(node.functions, "redis_conf", node.address, PASSWORD,
                                      *([] if node is primary else [primary.address])))
        for replica in nodes[1:]:
            _wait(f"{replica.address} replicating {primary.address}",
                  functools.partial(in_sync, replica, primary.address), 20, nodes)
        for node in nodes:
            node.start("sentinel", _call(
                node.functions, "sentinel_conf", str(node.folder / "sentinel" / "sentinel.conf"),
                SERVICE, node.address, primary.address, quorum, str(down_after_ms),
                str(failover_timeout_ms), PASSWORD))
        _wait("the sentinels finding each other and the replicas", lambda: all(
            sentinel_master(node).get("num-other-sentinels") == "2"
            and sentinel_master(node).get("num-slaves") == "2" for node in nodes), 30, nodes)

        sentinels = ",".join(f"{node.address}:{sentinel_port}" for node in nodes)
        client_functions = _client_functions(tmp_path / "client.sh", tmp_path / "etc", sentinels)
        url = _call(client_functions, "redis_url",
                    env={"TEST_PASSWORD": PASSWORD, "TEST_CA_FILE": str(ca_cert)})
        assert asyncio.run(_write_until_ok(url, timeout_s=5, interval_s=0.5)) is not None

        primary.stop("redis", signal.SIGKILL)
        # Loopback has no round trips to speak of and a killed process refuses connections
        # at once (a lost region makes clients wait out their 1 s timeouts instead), so this
        # checks the sentinels' part of the budget, with the agents' write interval.
        took_s = asyncio.run(_write_until_ok(url, timeout_s=10, interval_s=0.5))
        assert took_s is not None, "no write through the sentinels within 10 s of the loss"
        promoted = named_primary(nodes[1])
        assert promoted != primary.address
        assert all(named_primary(node) == promoted for node in nodes[1:])

        # The old primary's machine boots again: its sentinel stops with it; the start-up
        # script asks the other nodes' sentinels whom to follow, writes redis.conf, merges
        # the sentinel's file, and starts both.
        myid = sentinel(primary, "MYID")
        primary.stop("sentinel")
        follows = _call(primary.functions, "boot_primary", primary.address, primary.address,
                        PASSWORD, SERVICE, nodes[1].address, nodes[2].address).strip()
        assert follows == promoted, "a rebooted old primary follows the promoted node"
        primary.start("redis", _call(primary.functions, "redis_conf", primary.address,
                                     PASSWORD, follows))
        state = primary.folder / "sentinel" / "sentinel.conf"
        primary.start("sentinel", _call(
            primary.functions, "sentinel_conf", str(state), SERVICE, primary.address,
            primary.address, quorum, str(down_after_ms), str(failover_timeout_ms), PASSWORD))
        _wait("the old primary replicating the promoted node",
              lambda: in_sync(primary, promoted), 20, nodes)
        _wait("the old primary's sentinel naming the promoted node",
              lambda: named_primary(primary) == promoted, 20, nodes)
        assert sentinel(primary, "MYID") == myid, (
            "the sentinel kept its identity across the reboot")
    finally:
        for node in nodes:
            node.stop("sentinel", signal.SIGKILL)
            node.stop("redis", signal.SIGKILL)
