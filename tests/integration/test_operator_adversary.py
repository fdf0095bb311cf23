"""The operator's surface, probed by an adversary and by a hurried operator.

Hot reloads of regions.yaml under load (a region, an allow-list or a model removed while
traffic runs; half-written files, YAML bombs, deep nesting, duplicate keys, a 50 MB file
on SIGHUP, a ConfigMap-style symlink swap, tiny timeouts while answers run), the admin
API (unknown targets, absurd bodies, the token, two replicas racing drains, Redis down
or hung) and the status page and `/admin/status` in front of a hostile fleet of 5,000
workers whose heartbeats carry HTML, long strings and control characters.

Real router apps (tests.integration.operators_fleet) or a real `globalpool router`
process, real simulators, a real Valkey, all on loopback. A test marked
`xfail(strict=True)` asserts the correct behaviour for a fault found here (its reason
says what and where); the others pin behaviour that is right today.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from lab.devstack.valkey import EmbeddedValkey, free_port
from router.admin.table import render
from tests.conftest import ROOT, skip_for_missing_tool, within
from tests.integration.conftest import StartSim
from tests.integration.operators_fleet import (
    CHAT,
    TOKEN,
    OpsFleet,
    admin,
    auth,
    chat,
    fleet_config,
    wait_for,
)
from tests.integration.test_status_page import (  # the page's Chromium, reused
    CHROMIUM,
    DevTools,
    browser,  # noqa: F401  (a fixture)
)
from worker.heartbeat_keys import HeartbeatKeys
from worker.publisher import HeartbeatPublisher
from worker.redis_client import connect
from worker.schema import Capacity, EngineInfo, Heartbeat, LifecycleState, Load

pytestmark = pytest.mark.integration

# What a hostile worker can put in the free-text fields its heartbeat carries.
SCRIPT = "</td><script>window.__pwned=1</script><img src=x onerror=window.__pwned=2>"
CONTROLS = "\u202e\u0007\u001b[2J\u0000"


# --- helpers -----------------------------------------------------------------------------

async def _raw(url: str, method: str, path: str, *, data: bytes | None = None,
               headers: Mapping[str, str] | None = None) -> tuple[int, str, bytes]:
    """One request as bytes: status, Content-Type, body."""
    async with aiohttp.ClientSession() as session, session.request(
            method, f"{url}{path}", data=data,
            headers=dict(auth() if headers is None else headers)) as response:
        return response.status, response.headers.get("Content-Type", ""), await response.read()


async def _status(url: str, query: str = "") -> dict[str, Any]:
    status, body = await admin(url, "GET", f"/admin/status{query}")
    assert status == 200, body
    return dict(body)


async def _version(url: str) -> str:
    return str((await _status(url))["config"]["version"])


async def _until_version_changes(url: str, before: str) -> None:
    async def changed() -> bool:
        return await _version(url) != before

    await wait_for(changed, timeout_s=5.0)


async def _regions_served(url: str, count: int = 5) -> list[str]:
    return [(await chat(url))[1] for _ in range(count)]


def _east_far(config: dict[str, Any]) -> dict[str, Any]:
    """us-east 500 ms from its own router: eu-west (80 ms) wins while it may serve."""
    config["regions"]["us-east"]["rtt_ms"] = {"us-east": 500, "eu-west": 80}
    return config


def _is_openai_error(content_type: str, body: bytes) -> bool:
    if not content_type.startswith("application/json"):
        return False
    error = json.loads(body).get("error")
    return isinstance(error, dict) and isinstance(error.get("message"), str)


# --- reloads of regions.yaml -------------------------------------------------------------

async def _reload_without_eu_west(fleet: OpsFleet, redis_url: str, key_prefix: str) -> None:
    """Rewrite regions.yaml without eu-west and wait until the router has taken it."""
    before = await _version(fleet.url)
    gone = fleet_config(redis_url, key_prefix)
    del gone["regions"]["eu-west"]
    gone["regions"]["us-east"]["rtt_ms"] = {}
    fleet.write_config(gone)
    await _until_version_changes(fleet.url, before)


async def test_streams_in_flight_to_a_removed_region_finish(
        fleet: OpsFleet, redis_url: str, key_prefix: str) -> None:
    await fleet.start({"a": "us-east", "b": "eu-west"},
                      config=_east_far(fleet_config(redis_url, key_prefix)),
                      decode_step_ms=25.0)
    assert set(await _regions_served(fleet.url, 3)) == {"eu-west"}
    streams = [asyncio.create_task(chat(fleet.url, {**CHAT, "stream": True, "max_tokens": 50}))
               for _ in range(3)]
    await asyncio.sleep(0.3)  # all three are streaming from eu-west now
    await _reload_without_eu_west(fleet, redis_url, key_prefix)
    for status, region, answer in await within(asyncio.gather(*streams), 15):
        assert (status, region) == (200, "eu-west")
        assert answer.rstrip().endswith(b"data: [DONE]") and b'"error"' not in answer
    assert (await _status(fleet.url))["config"]["last_error"] is None


async def test_a_reload_with_tiny_timeouts_spares_requests_already_running(
        fleet: OpsFleet, redis_url: str, key_prefix: str) -> None:
    """README: requests already running keep the config they started with. A hurried
    operator's file with 0.05-0.2 s timeouts and one attempt must not cut ~1.5 s answers
    that were already under way, streamed or not."""
    await fleet.start({"a": "us-east", "b": "eu-west"}, decode_step_ms=30.0)
    running = [asyncio.create_task(chat(fleet.url, {**CHAT, "stream": stream,
                                                    "max_tokens": 50}))
               for stream in (True, True, False, False)]
    await asyncio.sleep(0.3)
    before = await _version(fleet.url)
    tiny = fleet_config(redis_url, key_prefix, max_attempts=1, policy="round_robin")
    tiny["router"]["timeouts"] = {"connect_s": 0.1, "first_byte_s": 0.1, "idle_s": 0.05,
                                  "total_s": 0.2}
    fleet.write_config(tiny)
    await _until_version_changes(fleet.url, before)
    for status, _, answer in await within(asyncio.gather(*running), 15):
        assert status == 200 and b'"error"' not in answer
        assert answer.rstrip().endswith(b"data: [DONE]") or answer.endswith(b"}")


async def test_a_removed_region_gets_no_new_requests(
        fleet: OpsFleet, redis_url: str, key_prefix: str) -> None:
    await fleet.start({"a": "us-east", "b": "eu-west"})
    await _reload_without_eu_west(fleet, redis_url, key_prefix)
    status, _ = await admin(fleet.url, "POST", "/admin/drain", body={"worker": "a"})
    assert status == 200
    # us-east's only worker is drained; eu-west is no longer in regions.yaml.
    answer = await chat(fleet.url)
    assert answer[0] == 503 and answer[1] != "eu-west", answer


async def test_a_model_removed_from_a_region_is_not_routed_there(
        fleet: OpsFleet, redis_url: str, key_prefix: str) -> None:
    await fleet.start({"a": "us-east", "b": "eu-west"},
                      config=_east_far(fleet_config(redis_url, key_prefix)))
    assert set(await _regions_served(fleet.url, 3)) == {"eu-west"}
    before = await _version(fleet.url)
    changed = _east_far(fleet_config(redis_url, key_prefix))
    changed["regions"]["eu-west"]["models"] = ["another-model"]
    fleet.write_config(changed)
    await _until_version_changes(fleet.url, before)
    await fleet.publish("b")  # its agent keeps heartbeating (dropped now)
    await asyncio.sleep(0.3)
    assert set(await _regions_served(fleet.url)) == {"us-east"}


async def test_an_address_no_longer_allowed_gets_no_new_requests(
        fleet: OpsFleet, redis_url: str, key_prefix: str) -> None:
    await fleet.start({"a": "us-east", "b": "eu-west"})
    assert set(await _regions_served(fleet.url, 3)) == {"us-east"}
    before = await _version(fleet.url)
    changed = fleet_config(redis_url, key_prefix)
    changed["regions"]["us-east"]["allowed_endpoints"] = ["10.0.0.0/8"]  # not 127.0.0.1
    fleet.write_config(changed)
    await _until_version_changes(fleet.url, before)
    await fleet.publish("a")
    await asyncio.sleep(0.3)
    assert set(await _regions_served(fleet.url)) == {"eu-west"}


async def test_half_written_files_and_yaml_bombs_are_refused_while_streams_run(
        fleet: OpsFleet, redis_url: str, key_prefix: str) -> None:
    """Each bad file: refused within a second, named in /admin/status and the events, the
    last good config in force, the streams running meanwhile untouched."""
    await fleet.start({"a": "us-east", "b": "eu-west"}, decode_step_ms=20.0)
    good_version = await _version(fleet.url)
    streams = [asyncio.create_task(chat(fleet.url, {**CHAT, "stream": True, "max_tokens": 80}))
               for _ in range(2)]
    text = yaml.safe_dump(fleet_config(redis_url, key_prefix))
    cut = text.index("us-east:\n") + 4  # in the middle of a key: "us-e"
    bomb = "lol0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
        f"lol{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]\n" for i in range(1, 9))
    bad_files = {
        "half-written": text[:cut],
        "billion laughs at the top": bomb + text,
        "billion laughs in a region": text.replace(
            "us-east:\n", "us-east:\n    extra: *l8\n", 1).replace(
            "apiVersion", bomb + "apiVersion", 1),
        "not a mapping": "- just\n- a list\n",
        "empty": "",
    }
    for name, bad in bad_files.items():
        fleet.config_path.write_text(bad)  # in place, as `cat > regions.yaml` would
        started = time.monotonic()

        async def refused() -> bool:
            body = await _status(fleet.url)
            error = body["config"]["last_error"]
            return error is not None and error["at_unix_s"] >= time.time() - 1.5

        await wait_for(refused, timeout_s=3.0)
        assert time.monotonic() - started < 2.0, name
        body = await _status(fleet.url)
        assert body["config"]["version"] == good_version, name
        assert all(p.startswith(f"{fleet.config_path}: ")
                   for p in body["config"]["last_error"]["problems"]), (name, body["config"])
        assert body["events"][0]["kind"] == "config_refused", name
        assert (await chat(fleet.url))[0] == 200, name
        await asyncio.sleep(0.2)
    # The writer finishes: the complete file (equal to the good one) clears the error.
    fleet.config_path.write_text(text)

    async def cleared() -> bool:
        return (await _status(fleet.url))["config"]["last_error"] is None

    await wait_for(cleared, timeout_s=3.0)
    for status, _, answer in await within(asyncio.gather(*streams), 15):
        assert status == 200 and answer.rstrip().endswith(b"data: [DONE]")


async def test_deeply_nested_yaml_is_refused_clearly(
        fleet: OpsFleet, redis_url: str, key_prefix: str) -> None:
    await fleet.start({"a": "us-east"})
    text = yaml.safe_dump(fleet_config(redis_url, key_prefix))
    fleet.config_path.write_text(text + "deep: " + "[" * 3000 + "]" * 3000 + "\n")

    async def refused() -> bool:
        return (await _status(fleet.url))["config"]["last_error"] is not None

    await wait_for(refused, timeout_s=3.0)
    status, content_type, body = await _raw(fleet.url, "POST", "/admin/reload")
    assert status == 422 and content_type.startswith("application/json"), body[:200]
    assert json.loads(body)["result"] == "refused"


async def test_duplicate_keys_are_refused(fleet: OpsFleet, redis_url: str,
                                          key_prefix: str) -> None:
    config = fleet_config(redis_url, key_prefix)
    config["admin"] = {"config_check_s": 0}  # on demand only
    await fleet.start({"a": "us-east", "b": "eu-west"}, config=config)
    text = yaml.safe_dump(config)
    duplicated = text.replace(
        "  eu-west:\n", "  eu-west:\n    drain: true\n    models: [m]\n  eu-west:\n", 1)
    assert yaml.safe_load(duplicated)["regions"]["eu-west"] == {"models": ["m"]}
    fleet.config_path.write_text(duplicated)
    status, body = await admin(fleet.url, "POST", "/admin/reload")
    assert status == 422, body
    assert any("eu-west" in p and "duplicate" in p.lower() for p in body["problems"]), body


async def test_a_configmap_symlink_swap_is_taken(fleet: OpsFleet, redis_url: str,
                                                 key_prefix: str) -> None:
    """Kubernetes' ConfigMap layout: regions.yaml -> ..data/regions.yaml, ..data -> a
    timestamped directory, swapped by renaming a new ..data symlink over the old one."""
    await fleet.start({"a": "us-east", "b": "eu-west"})
    root = fleet.tmp_path
    first, second = root / "..2026_01", root / "..2026_02"
    first.mkdir()
    second.mkdir()
    (first / "regions.yaml").write_text(fleet.config_path.read_text())
    (second / "regions.yaml").write_text(yaml.safe_dump(_east_far(
        fleet_config(redis_url, key_prefix))))
    (root / "..data").symlink_to(first.name)
    link = root / "regions.yaml.link"
    link.symlink_to("..data/regions.yaml")
    link.replace(fleet.config_path)  # same content: not a new version
    await asyncio.sleep(0.4)
    before = await _version(fleet.url)
    assert set(await _regions_served(fleet.url, 3)) == {"us-east"}
    (root / "..data_tmp").symlink_to(second.name)
    (root / "..data_tmp").replace(root / "..data")  # the atomic swap
    await _until_version_changes(fleet.url, before)
    assert set(await _regions_served(fleet.url, 3)) == {"eu-west"}
    assert (await _status(fleet.url))["config"]["last_error"] is None


async def test_a_refused_file_with_thousands_of_problems_keeps_the_status_small(
        fleet: OpsFleet, redis_url: str, key_prefix: str) -> None:
    await fleet.start({"a": "us-east"})
    bad = fleet_config(redis_url, key_prefix)
    bad["regions"]["eu-west"].update({f"unknown-{i}-{'z' * 100}": 1 for i in range(5000)})
    fleet.write_config(bad)
    status, _ = await admin(fleet.url, "POST", "/admin/reload")
    assert status == 422
    status, _, body = await _raw(fleet.url, "GET", "/admin/status")
    assert status == 200
    assert len(body) < 256 * 1024, f"/admin/status is {len(body):,} bytes"


class RouterProcess:
    """One `globalpool router` process (a single process, no supervisor)."""

    def __init__(self, config: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("GLOBALPOOL_")}
        env.update(GLOBALPOOL_ROUTER_PROCESSES="1", GLOBALPOOL_ADMIN_TOKEN=TOKEN)
        self.log = log
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "router.cli", "router", "--config", str(config),
                 "--port", str(self.port)], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=env, start_new_session=True)

    async def listening(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while "router listening on" not in self.log.read_text(errors="replace"):
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, self.log.read_text()[-3000:]
            await asyncio.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL: this one process, by its PID."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(3)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


async def test_a_50_mb_file_on_sighup_does_not_stop_the_router(
        redis_url: str, key_prefix: str, tmp_path: Path) -> None:
    config = fleet_config(redis_url, key_prefix)
    config["admin"] = {"config_check_s": 0}  # only SIGHUP reloads
    path = tmp_path / "regions.yaml"
    text = yaml.safe_dump(config)
    path.write_text(text)
    router = RouterProcess(path, tmp_path / "router.log")
    try:
        await router.listening()
        line = "# " + "x" * 1021 + "\n"
        with path.open("w") as out:  # a valid file, 50 MB of it comments
            out.write(text)
            out.write(line * (50 * 1024))
        router.process.send_signal(signal.SIGHUP)
        await asyncio.sleep(0.2)
        deadline = time.monotonic() + 3.0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as session:
            while time.monotonic() < deadline:
                async with session.get(f"{router.url}/health") as response:
                    assert response.status == 200
                await asyncio.sleep(0.2)
        async def concluded() -> bool:
            status, body = await admin(router.url, "GET", "/admin/status")
            return status == 200 and (body["config"]["last_error"] is not None
                                      or body["config"]["reloads"] > 0)

        await wait_for(concluded, timeout_s=30.0, interval_s=0.5)
    finally:
        router.stop()


# --- the admin API -----------------------------------------------------------------------

async def test_admin_refusals_are_json_and_say_what_is_wrong(fleet: OpsFleet) -> None:
    await fleet.start({"a": "us-east", "b": "eu-west"})
    url = fleet.url
    for headers in ({}, {"Authorization": "Basic dGVzdDp0ZXN0"}, {"Authorization": "Bearer"},
                    {"Authorization": f"Bearer {TOKEN[:-1]}"}, {"Authorization": TOKEN},
                    {"Authorization": f"Bearer {TOKEN}x"}, {"X-Admin-Token": TOKEN}):
        for method, path in (("GET", "/admin/status"), ("POST", "/admin/drain"),
                             ("POST", "/admin/reload")):
            status, content_type, body = await _raw(url, method, path,
                                                    data=b'{"region": "us-east"}',
                                                    headers=headers)
            assert status == 401 and _is_openai_error(content_type, body), (headers, path)
            assert json.loads(body)["error"]["code"] == "invalid_admin_token"
    status, _, _ = await _raw(url, "GET", f"/admin/status?token={TOKEN}", headers={})
    assert status == 401  # never from the query string (it would land in access logs)
    cases = [
        (b'{"region": "mars"}', 404, "unknown_region"),
        (b'{"worker": "<script>alert(1)</script>"}', 404, "unknown_worker"),
        (b'{"region": ["eu-west"]}', 400, None),
        (b'{"region": ""}', 400, None),
        (b'{"region": "eu-west", "worker": "a"}', 400, None),
        (b'{"region": "eu-west", "reason": 5}', 400, None),
        (b'{"region": "eu-west", "reason": "' + b"r" * 501 + b'"}', 400, None),
        (b"[]", 400, None),
        (b"\xff\xfe", 400, None),
        (b'{"region": ', 400, None),
        (b"x" * (5 * 1024 * 1024), 413, None),  # over router.max_body_bytes
    ]
    for data, expected, code in cases:
        status, content_type, body = await _raw(url, "POST", "/admin/drain", data=data)
        assert status == expected and _is_openai_error(content_type, body), (data[:40], body)
        assert json.loads(body)["error"]["code"] == code
        assert b"Traceback" not in body
    for method, path, expected in (("DELETE", "/admin/drain", 405), ("GET", "/admin/nope", 404),
                                   ("GET", "/admin/status?wrokers=5", 400)):
        status, content_type, body = await _raw(url, method, path)
        assert status == expected and _is_openai_error(content_type, body), (path, body)
    assert (await _status(url))["drains"] == []  # nothing above drained anything
    status, body = await admin(url, "POST", "/admin/undrain", body={"region": "mars"})
    assert status == 200 and body["was_drained"] is False  # undrain is idempotent


async def test_a_deeply_nested_admin_body_is_a_json_400(fleet: OpsFleet) -> None:
    await fleet.start({"a": "us-east"})
    status, content_type, body = await _raw(fleet.url, "POST", "/admin/drain",
                                            data=b"[" * 5000 + b"]" * 5000)
    assert status == 400 and _is_openai_error(content_type, body), (status, body)


async def test_a_drain_with_a_duration_is_refused_not_taken_as_forever(
        fleet: OpsFleet) -> None:
    await fleet.start({"a": "us-east", "b": "eu-west"})
    for extra in ({"duration_s": 600}, {"duration_s": 1e308}, {"until": "2030-01-01"},
                  {"ttl": -1}):
        status, body = await admin(fleet.url, "POST", "/admin/drain",
                                   body={"region": "eu-west", **extra})
        assert status == 400, (extra, body)
        assert (await _status(fleet.url))["drains"] == []


async def test_an_unknown_drain_target_gets_a_bounded_answer(fleet: OpsFleet) -> None:
    await fleet.start({"a": "us-east"})
    status, content_type, body = await _raw(
        fleet.url, "POST", "/admin/drain",
        data=json.dumps({"region": "r" * 1_000_000}).encode())
    assert status == 404 and _is_openai_error(content_type, body)
    assert len(body) < 4096, f"a {len(body):,}-byte error"


async def test_two_replicas_racing_drains_and_undrains_agree_with_routing(
        fleet: OpsFleet) -> None:
    await fleet.start({"a": "us-east", "b": "eu-west"}, replicas=2)
    first, second = fleet.urls
    for final in ("/admin/drain", "/admin/undrain"):
        ops = [admin(first if i % 2 else second, "POST",
                     "/admin/undrain" if i % 3 == 0 else "/admin/drain",
                     body={"region": "us-east", "reason": f"op {i}"}) for i in range(24)]
        assert {status for status, _ in await asyncio.gather(*ops)} == {200}
        status, _ = await admin(first, "POST", final, body={"region": "us-east"})
        assert status == 200
        drained = final == "/admin/drain"

        async def agreed(drained: bool = drained) -> bool:
            bodies = [await _status(url) for url in fleet.urls]
            return all(bool(b["drains"]) == drained for b in bodies)

        await wait_for(agreed, timeout_s=3.0)
        for url in fleet.urls:
            body = await _status(url)
            east = next(r for r in body["regions"] if r["name"] == "us-east")
            assert (east["health"] == "drained") == drained
            assert set(await _regions_served(url, 3)) == {"eu-west" if drained else "us-east"}


@pytest.fixture
async def own_valkey() -> AsyncIterator[EmbeddedValkey]:
    server = EmbeddedValkey.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def fleet_without_redis(own_valkey: EmbeddedValkey, key_prefix: str, tmp_path: Path,
                              start_sim: StartSim, monkeypatch: pytest.MonkeyPatch
                              ) -> AsyncIterator[OpsFleet]:
    """Two regions behind a router whose Redis (its own Valkey) is then stopped."""
    monkeypatch.setenv("GLOBALPOOL_ADMIN_TOKEN", TOKEN)
    fleet = OpsFleet(own_valkey.url, key_prefix, tmp_path, start_sim)
    try:
        await fleet.start({"a": "us-east", "b": "eu-west"})
        own_valkey.stop()
        yield fleet
    finally:
        await fleet.close()


async def test_admin_actions_while_redis_is_down_answer_503_quickly(
        fleet_without_redis: OpsFleet) -> None:
    url = fleet_without_redis.url
    for path, target in (("/admin/drain", {"region": "eu-west"}),
                         ("/admin/undrain", {"region": "eu-west"}),
                         ("/admin/drain", {"worker": "a"})):
        started = time.monotonic()
        status, content_type, body = await _raw(url, "POST", path,
                                                data=json.dumps(target).encode())
        assert time.monotonic() - started < 3.0
        assert status == 503 and _is_openai_error(content_type, body), body
        assert json.loads(body)["error"]["code"] == "redis_unavailable"
    started = time.monotonic()
    body_status = await _status(url)
    assert time.monotonic() - started < 1.0
    assert body_status["redis"]["connected"] is False
    assert body_status["drains"] == []  # what routing obeys: nothing was drained
    status, body = await admin(url, "POST", "/admin/reload")
    assert status == 200 and body["result"] == "unchanged"
    assert {(await chat(url))[0] for _ in range(3)} == {200}  # served from the last view


async def test_admin_actions_while_redis_hangs_answer_503_within_seconds(
        own_valkey: EmbeddedValkey, key_prefix: str, tmp_path: Path, start_sim: StartSim,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Redis that accepts and never answers (SIGSTOP of the Valkey this test started):
    drains fail within the client's timeouts, the status and routing go on."""
    monkeypatch.setenv("GLOBALPOOL_ADMIN_TOKEN", TOKEN)
    fleet = OpsFleet(own_valkey.url, key_prefix, tmp_path, start_sim)
    try:
        await fleet.start({"a": "us-east", "b": "eu-west"})
        os.kill(own_valkey.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            status, content_type, body = await _raw(fleet.url, "POST", "/admin/drain",
                                                    data=b'{"region": "eu-west"}')
            assert time.monotonic() - started < 4.0
            assert status == 503 and _is_openai_error(content_type, body)
            started = time.monotonic()
            assert (await _status(fleet.url))["drains"] == []
            assert time.monotonic() - started < 1.0
            assert (await chat(fleet.url))[:2] == (200, "us-east")
        finally:
            os.kill(own_valkey.pid, signal.SIGCONT)
    finally:
        await fleet.close()


async def test_admin_errors_while_redis_is_down_name_no_internal_address(
        fleet_without_redis: OpsFleet, own_valkey: EmbeddedValkey) -> None:
    status, body = await admin(fleet_without_redis.url, "POST", "/admin/drain",
                               body={"region": "eu-west"})
    assert status == 503
    message = body["error"]["message"]
    assert str(own_valkey.port) not in message and "127.0.0.1" not in message, message


# --- the status page and /admin/status with a hostile fleet -------------------------------

HOSTILE_WORKERS = 5000


async def _publish_hostile_fleet(redis_url: str, key_prefix: str, endpoint: str) -> None:
    """5,000 workers whose engine version carries HTML/JS, control characters or 256
    characters; and heartbeats the schema or the gate must refuse (an id or a region
    with HTML, an unknown model)."""
    publisher = HeartbeatPublisher(connect(redis_url, max_connections=32),
                                   HeartbeatKeys(key_prefix))
    now = time.time()

    def heartbeat(index: int, **changes: Any) -> Heartbeat:
        version = (SCRIPT, CONTROLS + SCRIPT, "v" * 256, SCRIPT[:40] + "\u202e" * 8)[index % 4]
        fields: dict[str, Any] = dict(
            worker_id=f"w{index:05d}", region=("us-east", "eu-west")[index % 2],
            endpoint=endpoint, models=("m",), state=LifecycleState.READY,
            capacity=Capacity(max_num_seqs=8), load=Load(running=0, waiting=0, kv_cache_usage=0.1),
            engine=EngineInfo(kind="sim", version=version[:256]), seq=1, sent_at_s=now,
            ttl_s=120.0)
        fields.update(changes)
        return Heartbeat.model_construct(**fields) if changes else Heartbeat(**fields)

    try:
        for start in range(0, HOSTILE_WORKERS, 250):
            await asyncio.gather(*(publisher.publish(heartbeat(i))
                                   for i in range(start, min(start + 250, HOSTILE_WORKERS))))
        for bad in ({"worker_id": "<script>window.__pwned=3</script>"},
                    {"worker_id": "x" * 5000},
                    {"region": "<script>window.__pwned=4</script>"},
                    {"region": "us-east\u0000\u202e"},
                    {"models": ("<img src=x onerror=window.__pwned=5>",)}):
            await publisher.publish(heartbeat(HOSTILE_WORKERS, **bad))
    finally:
        await publisher.aclose()


async def test_the_status_is_bounded_quick_and_escaped_for_a_hostile_fleet(
        fleet: OpsFleet, redis_url: str, key_prefix: str, browser: DevTools) -> None:  # noqa: F811
    if CHROMIUM is None:
        skip_for_missing_tool("chromium is not installed: apt-get install -y chromium")
    await fleet.start({"a": "us-east"})
    endpoint = fleet.sims["a"].url
    started = time.monotonic()
    await _publish_hostile_fleet(redis_url, key_prefix, endpoint)

    async def all_seen() -> bool:
        body = await _status(fleet.url, "?workers=0")
        return bool(body["workers_total"] == HOSTILE_WORKERS + 1)

    await wait_for(all_seen, timeout_s=20.0, interval_s=0.25)
    print(f"{HOSTILE_WORKERS} workers published and seen in {time.monotonic() - started:.1f} s")
    # What an operator adds: a drain whose reason is HTML, and a refused file whose key is.
    status, _ = await admin(fleet.url, "POST", "/admin/drain",
                            body={"worker": "w00001", "reason": SCRIPT})
    assert status == 200
    refused = fleet_config(redis_url, key_prefix)
    refused["regions"]["eu-west"]["<script>window.__pwned=6</script>"] = 1
    fleet.write_config(refused)
    status, _ = await admin(fleet.url, "POST", "/admin/reload")
    assert status == 422

    # /admin/status as the page asks for it, and in full: bounded and quick.
    for query, limit_bytes, limit_s in (("?workers=500", 1_000_000, 1.0),
                                        ("", 12_000_000, 3.0)):
        started = time.monotonic()
        status, content_type, body = await _raw(fleet.url, "GET", f"/admin/status{query}")
        took = time.monotonic() - started
        print(f"/admin/status{query}: {len(body):,} bytes in {took * 1000:.0f} ms")
        assert status == 200 and content_type == "application/json"
        assert len(body) < limit_bytes and took < limit_s
        document = json.loads(body)
        ids = {w["id"] for w in document["workers"]}
        assert not any("<" in i or len(i) > 200 for i in ids)  # refused by the schema
        assert {r["name"] for r in document["regions"]} == {"us-east", "eu-west"}
    assert document["workers_total"] == HOSTILE_WORKERS + 1

    # The page: 500 rows, every hostile string shown as text, no script run.
    await browser.navigate(f"{fleet.url}/status")
    await browser.evaluate(
        f"sessionStorage.setItem('globalpool-admin-token', {json.dumps(TOKEN)})")
    started = time.monotonic()
    await browser.navigate(f"{fleet.url}/status")
    await browser.wait_for(
        "document.querySelectorAll('#workers tbody tr[data-worker]').length === 500",
        timeout_s=20.0)
    print(f"status page drawn in {time.monotonic() - started:.2f} s")
    await asyncio.sleep(1.5)  # one more poll and redraw
    assert await browser.evaluate("typeof window.__pwned") == "undefined"
    assert await browser.evaluate("document.querySelectorAll('main script, main img').length") == 0
    page_text = await browser.evaluate("document.body.innerText")
    assert "<script>window.__pwned=1</script>" in page_text  # shown, as text
    assert "<script>window.__pwned=6</script>" in page_text  # the refused key, as text
    assert "regions.yaml refused" in page_text
    drained_row = await browser.evaluate(
        "document.querySelector('#drains tr[data-drain=\"worker:w00001\"]').innerText")
    assert SCRIPT in drained_row
    assert await browser.evaluate(
        "document.querySelector('#workers-shown').textContent") == \
        f"(500 of {HOSTILE_WORKERS + 1}: problems first)"


async def test_control_characters_never_reach_the_operators_terminal(fleet: OpsFleet) -> None:
    await fleet.start({"a": "us-east", "b": "eu-west"})
    status, _ = await admin(fleet.url, "POST", "/admin/drain",
                            body={"worker": "b", "reason": f"disk {CONTROLS} swap"})
    table = render(await _status(fleet.url))
    assert status == 400 or not any(
        (ord(c) < 32 and c != "\n") or 0x7f <= ord(c) < 0xa0 or c == "\u202e" for c in table), \
        repr(table[-200:])


async def test_a_drain_reason_with_control_or_bidi_characters_is_refused(
        fleet: OpsFleet) -> None:
    """The reason is shown in operators' terminals and on the page: refused (400) with any
    control or bidi character, taken with any other text."""
    await fleet.start({"a": "us-east", "b": "eu-west"})
    for char in ("\u0000", "\u0007", "\u001b", "\u007f", "\u0085", "\u200e", "\u200f",
                 "\u202a", "\u202e", "\u2066", "\u2069", "\n"):
        status, body = await admin(fleet.url, "POST", "/admin/drain",
                                   body={"worker": "b", "reason": f"disk {char} swap"})
        assert status == 400 and body["error"]["param"] == "reason", (char, body)
    assert (await _status(fleet.url))["drains"] == []
    status, _ = await admin(fleet.url, "POST", "/admin/drain",
                            body={"worker": "b", "reason": "disk swap: Zürich, 東京 \U0001f680"})
    assert status == 200
