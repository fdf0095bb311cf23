"""What the Redis failover tests (Sentinel, Cluster) ask a router under test."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path
from typing import Any

import aiohttp

from lab.devstack.stack import LocalStack
from lab.devstack.valkey import TLSFiles
from tests.conftest import skip_for_missing_tool

FRESH_S = 1.0  # a heartbeat this old or younger is fresh (the interval is 0.2 s)


async def status_of(session: aiohttp.ClientSession, stack: LocalStack) -> dict[str, Any]:
    async with session.get(f"{stack.router_url}/admin/status?workers=100",
                           headers={"Authorization": f"Bearer {stack.admin_token}"},
                           timeout=aiohttp.ClientTimeout(total=2)) as response:
        assert response.status == 200
        return dict(await response.json())


def ages(status: dict[str, Any]) -> list[float]:
    return [w["heartbeat_age_s"] for w in status["workers"]]


async def ask(session: aiohttp.ClientSession, url: str, number: int) -> str | None:
    """One streamed chat completion; None when it was whole, else what went wrong."""
    body = {"model": "tiny-llama", "stream": True, "max_tokens": 24,
            "messages": [{"role": "user", "content": f"question {number}"}]}
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=30)) as response:
            text = await response.text()
            if response.status != 200:
                return f"HTTP {response.status}: {text[:200]}"
            if not text.rstrip().endswith("data: [DONE]"):
                return f"no [DONE]: {text[-200:]}"
    except (aiohttp.ClientError, TimeoutError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


async def drain_reaches_the_router(session: aiohttp.ClientSession, stack: LocalStack,
                                   worker: str) -> None:
    """An operator's drain of `worker`, written to Redis, keeps it out of 8 requests."""
    async with session.post(f"{stack.router_url}/admin/drain",
                            json={"worker": worker, "reason": "after failover"},
                            headers={"Authorization": f"Bearer {stack.admin_token}"}
                            ) as response:
        assert response.status == 200, await response.text()
    served_by = set()
    for number in range(8):
        async with session.post(
                f"{stack.router_url}/v1/chat/completions",
                json={"model": "tiny-llama", "max_tokens": 4,
                      "messages": [{"role": "user", "content": f"after {number}"}]}
                ) as response:
            assert response.status == 200
            served_by.add(response.headers["x-globalpool-worker"])
    assert worker not in served_by and served_by


class Streams:
    """`clients` streaming chat completions back to back through the router until
    `stop()` (bounded: `limit` requests in all); `sent`, and `failures` as `ask` says."""

    def __init__(self, session: aiohttp.ClientSession, url: str, *, clients: int = 4,
                 limit: int = 400) -> None:
        self.sent = 0
        self.failures: list[str] = []
        self._session, self._url, self._limit = session, url, limit
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._client(n)) for n in range(clients)]

    async def _client(self, number: int) -> None:
        while not self._stop.is_set() and self.sent < self._limit:
            self.sent += 1
            problem = await ask(self._session, self._url, 10 * self.sent + number)
            if problem is not None:
                self.failures.append(problem)

    async def stop(self, timeout_s: float = 60.0) -> None:
        self._stop.set()
        async with asyncio.timeout(timeout_s):
            await asyncio.gather(*self._tasks)


def certificate(tmp_path: Path) -> TLSFiles:
    """A self-signed certificate for 127.0.0.1 (the servers' and the CA clients check)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        skip_for_missing_tool("openssl makes the test certificate")
    files = TLSFiles(tmp_path / "cert.pem", tmp_path / "key.pem")
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(files.key), "-out", str(files.cert)],
                   check=True, capture_output=True)
    return files
