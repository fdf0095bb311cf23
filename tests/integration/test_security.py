"""Security end to end: API keys, model access, residency, forged heartbeats, header
hygiene and Redis AUTH, against real simulators, a real Valkey and the real router app."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from redis.exceptions import AuthenticationError

from lab.devstack.valkey import EmbeddedValkey, free_port
from router.app import HOLDER
from tests.conftest import ROOT
from tests.integration.conftest import StartSim
from tests.integration.test_security_fleet import (
    API_KEYS,
    CHAT,
    SIGNING_KEYS,
    FleetFactory,
    heartbeat_for,
    next_seq,
    secure_fleet,
    wait_for,
)
from worker.heartbeat_keys import HeartbeatKeys
from worker.redis_client import connect
from worker.schema import Heartbeat, LifecycleState
from worker.signing import HeartbeatSigner, verify_signature

__all__ = ["secure_fleet"]
pytestmark = pytest.mark.integration


def error_of(body: bytes) -> dict[str, Any]:
    error: dict[str, Any] = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


async def test_requests_without_a_valid_key_get_401(
    secure_fleet: FleetFactory, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    fleet = await secure_fleet({"a": "us-east"})
    status, headers, body = await fleet.chat(None)
    assert status == 401
    assert error_of(body)["code"] == "missing_api_key"
    assert error_of(body)["type"] == "authentication_error"
    assert headers["WWW-Authenticate"].startswith("Bearer")
    for wrong in ("Bearer gp-nope", "Basic YTpi", f"Token {API_KEYS['acme']}"):
        status, _, body = await fleet.chat(None, headers={"Authorization": wrong})
        assert (status, error_of(body)["code"]) == (401, "invalid_api_key")
        assert API_KEYS["acme"] not in body.decode()
    async with fleet.session.get(f"{fleet.urls[0]}/v1/models") as response:
        assert response.status == 401
    async with fleet.session.get(f"{fleet.urls[0]}/health") as response:
        assert response.status == 200  # load balancers probe without a key
    status, headers, body = await fleet.chat("acme")
    assert status == 200, body
    assert headers["x-globalpool-worker"] == "a"
    assert fleet.stats().auth == Counter({"invalid_api_key": 3, "missing_api_key": 2, "ok": 1})
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert API_KEYS["acme"] not in logged and "gp-nope" not in logged


async def test_a_key_reaches_only_its_tenants_models(secure_fleet: FleetFactory) -> None:
    fleet = await secure_fleet({"a": "us-east"})
    status, _, body = await fleet.chat("modelless")
    assert (status, error_of(body)["code"], error_of(body)["param"]) == \
        (403, "model_not_allowed", "model")
    for tenant, expected in (("modelless", []), ("acme", ["m"])):
        async with fleet.session.get(f"{fleet.urls[0]}/v1/models",
                                     headers={"Authorization": f"Bearer {API_KEYS[tenant]}"}
                                     ) as response:
            listed = [m["id"] for m in (await response.json())["data"]]
        assert listed == expected


async def test_a_resident_tenant_is_served_only_in_its_regions(
    secure_fleet: FleetFactory,
) -> None:
    fleet = await secure_fleet({"us1": "us-east", "eu1": "eu-west"})
    # us-east is the router's own region and closer, but euco may only use eu-west.
    for _ in range(4):
        status, headers, body = await fleet.chat("euco")
        assert (status, headers["x-globalpool-region"]) == (200, "eu-west"), body
    status, headers, _ = await fleet.chat("acme")
    assert (status, headers["x-globalpool-region"]) == (200, "us-east")
    us_served = await fleet.served("us1")

    # The allowed region's only worker dies: the attempt fails and is not retried elsewhere.
    await fleet.sims["eu1"].stop()
    for _ in range(3):
        status, _, body = await fleet.chat("euco")
        assert status in (502, 503), body
        assert error_of(body)["code"] in ("upstream_failed", "region_unavailable")
    # Then its heartbeat is gone too: a clean 503 that says why.
    redis = connect(fleet.redis_url)
    try:
        keys = HeartbeatKeys(fleet.key_prefix)
        await redis.delete(keys.worker("eu1"))
        await redis.publish(keys.channel, keys.gone_message("eu1"))
    finally:
        await redis.aclose()
    await wait_for(lambda: "eu1" not in fleet.known_workers(), "eu1 to leave the pool")
    status, headers, body = await fleet.chat("euco", {**CHAT, "stream": True})
    error = error_of(body)
    assert (status, error["code"]) == (503, "region_unavailable")
    assert "eu-west" in error["message"] and "not sent elsewhere" in error["message"]
    assert headers["Retry-After"] == "1"
    # Meanwhile other tenants are served in us-east, and none of euco's requests was.
    status, _, _ = await fleet.chat("acme")
    assert status == 200
    assert await fleet.served("us1") == us_served + 1
    stats = fleet.stats()
    assert stats.residency_violations == 0
    assert stats.residency[("euco", "eu-west", "routed")] == 4
    assert stats.residency[("euco", "-", "refused")] >= 1
    assert not any(region == "us-east" for (_, region, _) in stats.residency)


class Recorder:
    """A stand-in engine that answers every request and remembers what it was sent."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.requests: list[tuple[str, dict[str, str]]] = []
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def _answer(self, request: web.Request) -> web.Response:
        await request.read()
        self.requests.append((request.path, dict(request.headers)))
        return web.json_response({"id": "x", "object": "chat.completion", "model": "m",
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant",
                                                           "content": "ok"}}]})

    async def start(self) -> Recorder:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._answer)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        port = free_port(self.host)
        await web.TCPSite(self._runner, self.host, port).start()
        self.url = f"http://{self.host}:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def recorders() -> AsyncIterator[list[Recorder]]:
    started: list[Recorder] = []
    yield started
    for recorder in started:
        await recorder.stop()


async def test_client_credentials_and_hop_by_hop_headers_stay_at_the_router(
    secure_fleet: FleetFactory, recorders: list[Recorder], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GP_TEST_US_UPSTREAM_KEY", "upstream-secret-us")
    fleet = await secure_fleet({}, regions={"us-east": {
        "upstream_api_key_env": "GP_TEST_US_UPSTREAM_KEY"}})
    us, eu = await Recorder().start(), await Recorder().start()
    recorders += [us, eu]
    await fleet.publish_heartbeat(heartbeat_for("rec-us", "us-east", us.url, next_seq()))
    await fleet.publish_heartbeat(heartbeat_for("rec-eu", "eu-west", eu.url, next_seq()))
    await wait_for(lambda: {"rec-us", "rec-eu"} <= fleet.known_workers(), "the recorders")
    hostile = {
        "Cookie": "session=abc", "Proxy-Authorization": "Basic eHg6eXk=",
        "Connection": "keep-alive, X-Smuggle", "Keep-Alive": "timeout=5", "TE": "trailers",
        "X-Smuggle": "1", "Upgrade": "h2c", "Forwarded": "for=1.2.3.4",
        "X-Forwarded-For": "1.2.3.4", "traceparent":
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "x-request-id": "req-1",
    }
    status, headers, _ = await fleet.chat("acme", headers=hostile)
    assert (status, headers["x-globalpool-worker"]) == (200, "rec-us")
    status, headers, _ = await fleet.chat("euco", headers=hostile)
    assert (status, headers["x-globalpool-worker"]) == (200, "rec-eu")
    (_, sent_us), = us.requests
    (_, sent_eu), = eu.requests
    lowered_us = {k.lower(): v for k, v in sent_us.items()}
    lowered_eu = {k.lower(): v for k, v in sent_eu.items()}
    assert lowered_us["authorization"] == "Bearer upstream-secret-us"
    assert "authorization" not in lowered_eu  # eu-west has no upstream key
    for sent in (lowered_us, lowered_eu):
        for name in ("cookie", "proxy-authorization", "keep-alive", "te", "x-smuggle",
                     "upgrade", "forwarded", "x-forwarded-for"):
            assert name not in sent, (name, sent)
        assert sent.get("connection", "keep-alive").lower() == "keep-alive"
        assert sent["x-request-id"] == "req-1"
        assert API_KEYS["acme"] not in json.dumps(sent) and API_KEYS["euco"] not in \
            json.dumps(sent)


async def test_forged_heartbeats_receive_no_traffic(
    secure_fleet: FleetFactory, recorders: list[Recorder],
) -> None:
    signer = HeartbeatSigner("kid-a", SIGNING_KEYS["kid-a"])
    # The only real worker is far away in eu-west; a believed us-east worker would win.
    fleet = await secure_fleet(
        {"real": "eu-west"}, router_keys=SIGNING_KEYS, signer=signer,
        regions={"us-east": {"allowed_endpoints": ["127.0.0.1"]},
                 "eu-west": {"allowed_endpoints": ["127.0.0.0/24"]}})
    await wait_for(lambda: "real" in fleet.known_workers(), "the real worker")
    trap = await Recorder().start()
    outside = await Recorder("127.0.0.2").start()
    recorders += [trap, outside]
    redis = connect(fleet.redis_url)
    keys = HeartbeatKeys(fleet.key_prefix)

    async def write(worker_id: str, payload: str) -> None:
        """Straight into Redis, as an attacker with write access would."""
        await redis.set(keys.worker(worker_id), payload, px=60_000)
        await redis.publish(keys.channel, payload)

    old_real = signer.sign(heartbeat_for("real", "eu-west", trap.url, 1,
                                         sent_at_s=time.time() - 3600))
    forged = {
        "unsigned": heartbeat_for("f-unsigned", "us-east", trap.url, 1).to_json(),
        "wrong-secret": HeartbeatSigner("kid-a", b"guessed-secret-xxxxxxxx").sign(
            heartbeat_for("f-wrong", "us-east", trap.url, 1)).to_json(),
        "unknown-key": HeartbeatSigner("kid-z", b"guessed-secret-xxxxxxxx").sign(
            heartbeat_for("f-kid", "us-east", trap.url, 1)).to_json(),
        "tampered": signer.sign(heartbeat_for("f-tamper", "us-east", trap.url, 1))
        .model_copy(update={"seq": 2}).to_json(),
        "outside": signer.sign(heartbeat_for("f-outside", "us-east", outside.url,
                                             1)).to_json(),
        "future": signer.sign(heartbeat_for("f-future", "us-east", trap.url, 1,
                                            sent_at_s=time.time() + 3600)).to_json(),
        # A captured heartbeat of the real worker, replayed (its endpoint was the trap's).
        "replay": old_real.to_json(),
    }
    try:
        for attempt in range(3):  # forged heartbeats keep coming while traffic flows
            for name, payload in forged.items():
                await write(f"forged-{name}-{attempt}" if name != "replay" else "real",
                            payload)
            # The router parses only a worker's newest heartbeat per snapshot build: the
            # replay is checked (and counted) unless the real one follows it that soon.
            def replay_dropped(count: int = attempt + 1) -> bool:
                return fleet.stats().heartbeats_dropped["expired"] >= count

            await wait_for(replay_dropped, "the replay dropped")
            await fleet.publish("real")
            for _ in range(5):
                status, headers, body = await fleet.chat("acme")
                assert (status, headers["x-globalpool-worker"]) == (200, "real"), body
    finally:
        await redis.aclose()
    assert trap.requests == [] and outside.requests == []
    assert fleet.known_workers() == {"real"}
    dropped = fleet.stats().heartbeats_dropped
    for reason in ("unsigned", "bad_signature", "unknown_key", "endpoint_not_allowed",
                   "future", "expired"):
        assert dropped[reason] >= 3, (reason, dropped)

    # Rotation: the worker moves to the second key; both are valid at the router.
    await fleet.publish("real", using=HeartbeatSigner("kid-b", SIGNING_KEYS["kid-b"]))
    status, headers, _ = await fleet.chat("acme")
    assert (status, headers["x-globalpool-worker"]) == (200, "real")
    assert fleet.stats().heartbeats_verified >= 4


async def test_replayed_old_heartbeat_is_dropped_and_counted(
    secure_fleet: FleetFactory,
) -> None:
    signer = HeartbeatSigner("kid-a", SIGNING_KEYS["kid-a"])
    fleet = await secure_fleet({"real": "us-east"}, router_keys=SIGNING_KEYS, signer=signer)
    captured = signer.sign(heartbeat_for("real", "us-east", fleet.sims["real"].url, 5,
                                         LifecycleState.DRAINING, sent_at_s=time.time() - 1))
    await wait_for(lambda: "real" in fleet.known_workers(), "the real worker")
    verified = fleet.stats().heartbeats_verified
    await fleet.publish("real")  # the worker is live, with a later heartbeat...
    # ...which the router has taken (it parses a worker's newest heartbeat per snapshot
    # build: a replay sent before that would only be passed over, not checked)
    await wait_for(lambda: fleet.stats().heartbeats_verified > verified, "the later heartbeat")
    redis = connect(fleet.redis_url)
    try:
        await redis.publish(HeartbeatKeys(fleet.key_prefix).channel, captured.to_json())
    finally:
        await redis.aclose()
    await wait_for(lambda: fleet.stats().heartbeats_dropped["replayed"] == 1, "the replay")
    status, _, _ = await fleet.chat("acme")  # the old `draining` report was not believed
    assert status == 200


async def test_redis_with_auth_works_and_its_password_stays_out_of_logs(
    secure_fleet: FleetFactory, caplog: pytest.LogCaptureFixture,
) -> None:
    password = "valkey-pass-0987654321"
    server = EmbeddedValkey.start(password=password)
    try:
        caplog.set_level(logging.DEBUG)
        fleet = await secure_fleet({"a": "us-east"}, redis=server.url)
        await wait_for(lambda: "a" in fleet.known_workers(), "the worker over AUTH")
        for _ in range(4):  # small: 3 a minute, counted in Redis (AUTH) by the script
            status, _, _ = await fleet.chat("small")
        assert status == 429
        assert fleet.stats().rate_limit_source == Counter({"redis": 4})
        # A wrong password is refused by the server, and the error does not quote it.
        bad = connect(server.url.replace(password, "wrong-password-123"))
        try:
            with pytest.raises(AuthenticationError) as refused:
                await bad.ping()
            assert "wrong-password-123" not in str(refused.value)
        finally:
            await bad.aclose()
    finally:
        server.stop()
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert password not in logged
    assert API_KEYS["small"] not in logged


async def _run_worker(engine_url: str, redis_url: str, prefix: str, env: dict[str, str],
                      *flags: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.cli", "worker", "--region", "us-east",
        "--engine-url", engine_url, "--redis-url", redis_url, "--key-prefix", prefix,
        "--engine-kind", "sim", "--interval-s", "0.1", "--ttl-s", "1", *flags,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("GLOBALPOOL_")},
             **env})


async def test_the_worker_agent_signs_with_the_key_it_is_told(
    redis_url: str, key_prefix: str, start_sim: StartSim,
) -> None:
    sim = await start_sim(served_model_names=("m",))
    keys_env = {"GLOBALPOOL_HEARTBEAT_KEYS": ",".join(
        f"{kid}:{secret.decode()}" for kid, secret in SIGNING_KEYS.items())}
    refused = await _run_worker(sim.url, redis_url, key_prefix, keys_env,
                                "--signing-key-id", "kid-z")
    async with asyncio.timeout(20):
        _, stderr = await refused.communicate()
    assert refused.returncode == 2
    assert "'kid-z' is not among the configured keys" in stderr.decode()
    assert "heartbeat-secret" not in stderr.decode()

    process = await _run_worker(sim.url, redis_url, key_prefix, keys_env,
                                "--signing-key-id", "kid-b")
    redis = connect(redis_url)
    try:
        key = HeartbeatKeys(key_prefix).worker(f"us-east-127.0.0.1-{sim.port}")
        deadline = time.monotonic() + 20
        while (payload := await redis.get(key)) is None:
            assert time.monotonic() < deadline, "the worker never published"
            await asyncio.sleep(0.05)
        heartbeat = Heartbeat.from_json(payload)
        assert heartbeat.key_id == "kid-b"
        assert verify_signature(heartbeat, SIGNING_KEYS) is None
    finally:
        await redis.aclose()
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            _, stderr = await process.communicate()
    assert "signing heartbeats with key 'kid-b'" in stderr.decode()
    assert "heartbeat-secret" not in stderr.decode()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


@pytest.fixture
async def tls_valkey(certificate: tuple[Path, Path]) -> AsyncIterator[str]:
    """A `rediss://` URL: a TLS terminator on loopback in front of a Valkey with AUTH (the
    embedded Valkey is built without TLS; the client side is what is under test)."""
    cert, key = certificate
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    password = "tls-valkey-pass-12345"
    server = EmbeddedValkey.start(password=password)
    handlers: set[asyncio.Future[tuple[None, None]]] = set()

    async def terminate(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(server.host,
                                                                         server.port)
        both = asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
        task = asyncio.ensure_future(both)
        handlers.add(task)
        await task

    terminator = await asyncio.start_server(terminate, "127.0.0.1", 0, ssl=context)
    port = terminator.sockets[0].getsockname()[1]
    try:
        yield f"rediss://:{password}@127.0.0.1:{port}/0?ssl_ca_certs={cert}"
    finally:
        terminator.close()
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        server.stop()


async def test_redis_over_tls_with_auth_through_the_same_url(
    secure_fleet: FleetFactory, tls_valkey: str,
) -> None:
    fleet = await secure_fleet({"a": "us-east"}, redis=tls_valkey)
    await wait_for(lambda: "a" in fleet.known_workers(), "the worker over TLS")
    for _ in range(4):
        status, _, _ = await fleet.chat("small")
    assert status == 429
    assert fleet.stats().rate_limit_source == Counter({"redis": 4})
    health = fleet.apps[0][HOLDER].current
    assert health.redis_connected
