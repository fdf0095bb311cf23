"""Shared fixtures: a real Redis-protocol server (embedded Valkey, or REDIS_URL when set)."""

from __future__ import annotations

import asyncio
import os
import tempfile
import uuid
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import NoReturn, TypeVar

import pytest

from lab.devstack.valkey import EmbeddedValkey

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
# A CPU hog: a Python program that spins on one core for {s} seconds, then ends itself.
CPU_HOG = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end:\n    pass\n"

T = TypeVar("T")


async def within(awaitable: Awaitable[T], timeout_s: float) -> T:
    """`awaitable`'s result, or TimeoutError after `timeout_s` seconds: what
    `asyncio.wait_for` does, without its flaw on Python 3.11 (a cancel that arrives just as
    the awaited thing finishes is dropped, and the result returned: a loop around it then
    never stops). `asyncio.wait_for` is banned in this project (ruff TID251)."""
    async with asyncio.timeout(timeout_s):
        return await awaitable


def skip_unless_slow_tests_are_asked_for(config: pytest.Config, why: str) -> None:
    """Skip, saying `why`, unless this run selects the slow tier (`pytest -m slow`): a slow
    test that runs by name or in the default run would add minutes to it."""
    if "slow" not in (config.getoption("markexpr") or "").replace("not slow", ""):
        pytest.skip(f"{why}: run with `pytest -m slow`")


REQUIRE_ALL_TOOLS_ENV = "GLOBALPOOL_REQUIRE_ALL_TOOLS"


def skip_for_missing_tool(why: str) -> NoReturn:
    """Skip a test whose outside tool (chromium, valgrind) is not installed, saying `why`;
    with GLOBALPOOL_REQUIRE_ALL_TOOLS=1 (set by CI, which installs them) fail instead, so
    that a tool CI lost cannot turn its tests into silent skips."""
    if os.environ.get(REQUIRE_ALL_TOOLS_ENV) == "1":
        pytest.fail(f"{why} ({REQUIRE_ALL_TOOLS_ENV}=1: a missing tool fails the run)",
                    pytrace=False)
    pytest.skip(why)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test (or a parameter of one) marked `slow` runs in the slow tier only: the default
    run and the compiled tier skip it, saying the marker's `why`. Moved there from the
    default run once that passed 15 minutes on a slow host: a bench's harness, a second
    Redis flavour of a failover test already run on Valkey, the longest kill tests."""
    marker = item.get_closest_marker("slow")
    if marker is not None:
        skip_unless_slow_tests_are_asked_for(item.config, marker.kwargs.get("why", "slow"))


def pytest_configure(config: pytest.Config) -> None:
    """Routers that tests start with the default `batch.storage: local` keep their files in
    a directory of this run, not in the home directory (router.batch.blobs)."""
    if "GLOBALPOOL_FILES_DIR" not in os.environ:
        os.environ["GLOBALPOOL_FILES_DIR"] = tempfile.mkdtemp(prefix="globalpool-test-files-")


def pytest_sessionstart(session: pytest.Session) -> None:
    """The compiled tier (GLOBALPOOL_EXPECT_COMPILED=1, in a `globalpool compile` copy)
    stops at once if the request path it should test is not the compiled one."""
    if os.environ.get("GLOBALPOOL_EXPECT_COMPILED") != "1":
        return
    import router.app  # noqa: F401  (imports the whole request path)
    from router.compiled import compiled_modules

    if "router.proxy.handlers" not in compiled_modules():
        pytest.exit("GLOBALPOOL_EXPECT_COMPILED=1, but the request path imported here is "
                    "pure Python: run from a `globalpool compile --out DIR` copy, with "
                    "PYTHONPATH=DIR", returncode=3)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """One server for the session; tests isolate themselves with `key_prefix`."""
    external = os.environ.get("REDIS_URL")
    if external:
        yield external
        return
    server = EmbeddedValkey.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def key_prefix() -> str:
    """A namespace of Redis keys and channels that no other test uses."""
    return f"gptest-{uuid.uuid4().hex[:10]}"
