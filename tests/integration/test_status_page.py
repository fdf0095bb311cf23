"""The status page in a real headless Chromium, against a running `globalpool up`.

Drives Debian's `chromium` over the DevTools protocol (a websocket, with aiohttp): the
page loads, asks for the admin token, shows every region of the running system, and
updates when a region is drained. `globalpool status` reads the same admin API.

Needs `apt-get install -y chromium` (skipped with that hint otherwise). With
GLOBALPOOL_WRITE_SCREENSHOT=1 the screenshot is also written to docs/status-page.png.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import ROOT, skip_for_missing_tool
from tests.integration.stack import RunningUp, small_config, start_up

pytestmark = pytest.mark.integration

TOKEN = "status-page-test-token"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
APT_HINT = "apt-get install -y chromium chromium-driver"
REGIONS = ["us-east", "eu-west", "ap-south"]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningUp]:
    if CHROMIUM is None:
        skip_for_missing_tool(f"chromium is not installed: {APT_HINT}")
    tmp_path = tmp_path_factory.mktemp("status-up")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GLOBALPOOL_ADMIN_TOKEN", TOKEN)  # start_up passes the environment on
        running = start_up(tmp_path, small_config(tmp_path))
    try:
        yield running
    finally:
        running.stop()


class DevTools:
    """A minimal DevTools protocol client: one page target, commands by id."""

    def __init__(self, socket: aiohttp.ClientWebSocketResponse) -> None:
        self._socket = socket
        self._ids = itertools.count(1)

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        message_id = next(self._ids)
        await self._socket.send_json({"id": message_id, "method": method, "params": params})
        while True:
            async with asyncio.timeout(60):
                message = await self._socket.receive_json()
            if message.get("id") == message_id:
                if "error" in message:
                    raise AssertionError(f"{method}: {message['error']}")
                result: dict[str, Any] = message.get("result", {})
                return result

    async def evaluate(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression,
                                 returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def navigate(self, url: str, timeout_s: float = 30.0) -> None:
        """Open `url` and return once its document has loaded: `Page.navigate` answers
        before the new document exists, and an expression evaluated then runs in the old
        one (about:blank), where the page's elements are missing."""
        await self.send("Page.navigate", url=url)
        await self.wait_for(f"location.href === {json.dumps(url)} && "
                            "document.readyState === 'complete'", timeout_s)

    async def wait_for(self, expression: str, timeout_s: float = 30.0) -> Any:
        """Evaluate until truthy (the page polls every second; a loaded CI box is slow)."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"never true within {timeout_s:g} s: {expression}")
            await asyncio.sleep(0.2)


@pytest.fixture
async def browser(tmp_path: Path) -> AsyncIterator[DevTools]:
    assert CHROMIUM is not None
    profile = tmp_path / "chromium-profile"
    log = (tmp_path / "chromium.log").open("wb")
    process = await asyncio.create_subprocess_exec(
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--hide-scrollbars", "--window-size=1400,1000",
        f"--user-data-dir={profile}", "--remote-debugging-address=127.0.0.1",
        "--remote-debugging-port=0", "about:blank",
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
        start_new_session=True,
    )
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            assert process.returncode is None, f"chromium exited {process.returncode}"
            assert time.monotonic() < deadline, "chromium did not open its DevTools port"
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().splitlines()[0])
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as response:
                targets = await response.json()
            page = next(t for t in targets if t["type"] == "page")
            async with session.ws_connect(page["webSocketDebuggerUrl"],
                                          max_msg_size=64 * 1024 * 1024) as socket:
                devtools = DevTools(socket)
                await devtools.send("Page.enable")
                await devtools.send("Runtime.enable")
                yield devtools
    finally:
        # Only what this test started: chromium's own process group.
        with _suppress_lookup():
            os.killpg(process.pid, signal.SIGTERM)
        try:
            async with asyncio.timeout(10):
                await process.wait()
        except TimeoutError:
            with _suppress_lookup():
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
        log.close()


class _suppress_lookup:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> bool:
        return kind is not None and issubclass(kind, ProcessLookupError)


async def _traffic(url: str) -> None:
    """Some streams from each region's clients, so every card has numbers."""
    body = {"model": "tiny-llama", "stream": True, "max_tokens": 8,
            "messages": [{"role": "user", "content": "Hello there"}]}
    async with aiohttp.ClientSession() as session:
        async def one(origin: str) -> None:
            async with session.post(f"{url}/v1/chat/completions", json=body,
                                    headers={"x-globalpool-client-region": origin}) as response:
                assert response.status == 200
                await response.read()

        await asyncio.gather(*(one(origin) for origin in REGIONS for _ in range(8)))


async def _admin(url: str, path: str, body: dict[str, str]) -> None:
    async with aiohttp.ClientSession() as session, session.post(
            f"{url}{path}", json=body, headers={"Authorization": f"Bearer {TOKEN}"}) as response:
        assert response.status == 200, await response.text()


async def _until_all_ready(url: str, timeout_s: float = 30.0) -> None:
    """Until /admin/status says every worker of the stack is ready."""
    async with aiohttp.ClientSession() as session, asyncio.timeout(timeout_s):
        while True:
            async with session.get(f"{url}/admin/status",
                                   headers={"Authorization": f"Bearer {TOKEN}"}) as response:
                workers = (await response.json())["workers"]
            if len(workers) == 6 and all(w["status"] == "ready" for w in workers):
                return
            await asyncio.sleep(0.2)


CARDS = ("JSON.stringify(Object.fromEntries([...document.querySelectorAll('.card')].map("
         "c => [c.dataset.region, c.querySelector('[data-role=health]').textContent])))")


async def test_status_page_shows_the_regions_and_follows_a_drain(
        up: RunningUp, browser: DevTools, tmp_path: Path) -> None:
    await _traffic(up.url)
    await browser.navigate(f"{up.url}/status")
    # No token yet: the page asks for one.
    await browser.wait_for("!document.getElementById('login').hidden")
    await browser.evaluate("document.getElementById('token').focus()")
    await browser.send("Input.insertText", text=TOKEN)
    await browser.evaluate("document.getElementById('login-button').click()")

    cards = json.loads(await browser.wait_for(
        f"(() => {{ const c = {CARDS}; return Object.keys(JSON.parse(c)).length === 3 && c }})()"))
    assert set(cards) == set(REGIONS)
    # Every region ok. The page follows the router every second: a worker whose engine
    # probe timed out while this machine started Chromium (it happened: `degraded`, so
    # ejected for 1 s) shows as ready again once its breaker's backoff has run out.
    await browser.wait_for(f"Object.values(JSON.parse({CARDS})).every(h => h === 'ok')")
    assert await browser.evaluate("document.getElementById('router-region').textContent") \
        == "us-east"
    # `up` runs one router replica; nothing waits for a worker at this load.
    assert await browser.evaluate("document.getElementById('replicas').textContent") == "1"
    assert await browser.evaluate("document.getElementById('queued').textContent") == "0"
    workers = await browser.evaluate(
        "document.querySelectorAll('#workers tbody tr[data-worker]').length")
    assert workers == 6
    await browser.wait_for("document.querySelector('.card[data-region=\"eu-west\"] dd')"
                           " && document.body.innerText.includes('TTFT p50')")
    await browser.wait_for("document.querySelector('#batches tbody').innerText"
                           ".includes('no batch running')")

    await _admin(up.url, "/admin/drain", {"region": "eu-west", "reason": "browser test"})
    cards = json.loads(await browser.wait_for(
        f"(() => {{ const c = {CARDS}; return JSON.parse(c)['eu-west'] === 'drained' && c }})()"))
    assert cards == {"us-east": "ok", "eu-west": "drained", "ap-south": "ok"}
    await browser.wait_for("!!document.querySelector('#drains tr[data-drain=\"region:eu-west\"]')")
    await browser.wait_for("document.getElementById('events').innerText.includes('drain')")

    height = await browser.evaluate("document.documentElement.scrollHeight")
    await browser.send("Emulation.setDeviceMetricsOverride", width=1400,
                       height=max(800, int(height)), deviceScaleFactor=1, mobile=False)
    shot = await browser.send("Page.captureScreenshot", format="png")
    png = base64.b64decode(shot["data"])
    assert png.startswith(b"\x89PNG")
    (tmp_path / "status-page.png").write_bytes(png)
    if os.environ.get("GLOBALPOOL_WRITE_SCREENSHOT") == "1":
        (ROOT / "docs").mkdir(exist_ok=True)
        (ROOT / "docs" / "status-page.png").write_bytes(png)

    await _admin(up.url, "/admin/undrain", {"region": "eu-west"})
    await browser.wait_for(
        f"(() => {{ const c = {CARDS}; return JSON.parse(c)['eu-west'] === 'ok' }})()")


def test_status_command_prints_the_table(up: RunningUp) -> None:
    env = {**os.environ, "GLOBALPOOL_ADMIN_TOKEN": TOKEN}
    asyncio.run(_until_all_ready(up.url))  # as the page test: a probe blip passes in ~1 s
    result = subprocess.run(
        [sys.executable, "-m", "router.cli", "status", "--router", up.url],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=env,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("router us-east") and "redis connected" in lines[0]
    assert any(line.startswith("REGION") for line in lines)
    for region in REGIONS:
        assert any(line.startswith(region) for line in lines), result.stdout
    assert sum(line.split()[2] == "ready" for line in lines
               if line.split() and line.split()[0].count("-") >= 2
               and len(line.split()) > 2) == 6
    assert TOKEN not in result.stdout + result.stderr
    env.pop("GLOBALPOOL_ADMIN_TOKEN")
    refused = subprocess.run(
        [sys.executable, "-m", "router.cli", "status", "--router", up.url],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=env,
    )
    assert refused.returncode == 2 and "GLOBALPOOL_ADMIN_TOKEN" in refused.stderr
