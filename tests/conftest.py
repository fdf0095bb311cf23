"""Shared fixtures: a real Redis-protocol server (embedded Valkey, or REDIS_URL when set)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from router.devstack.valkey import EmbeddedValkey

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


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
