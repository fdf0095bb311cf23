"""The real-vLLM tier: `pytest -m vllm` (or GLOBALPOOL_VLLM=1 pytest tests/vllm).

A plain `pytest` deselects it: it installs vLLM (CPU) into a venv of its own the first
time (~90 s, 3.5 GB, reused afterwards) and runs two real vLLM servers, which takes
minutes. `.ci/run` runs it after the default tier, every time.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.pool import RealPool
from tests.vllm.prepare import build_model, ensure_venv

MEASUREMENTS = pytest.StashKey[dict[str, Any]]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "vllm: runs real vLLM (CPU) servers; selected by -m vllm or GLOBALPOOL_VLLM=1"
    )
    config.stash[MEASUREMENTS] = {}


def _selected(config: pytest.Config) -> bool:
    return "vllm" in str(config.getoption("markexpr") or "") or (
        os.environ.get("GLOBALPOOL_VLLM") == "1"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _selected(config):
        return
    tier = [item for item in items if item.get_closest_marker("vllm") is not None]
    if tier:
        config.hook.pytest_deselected(items=tier)
        items[:] = [item for item in items if item.get_closest_marker("vllm") is None]


def pytest_report_header(config: pytest.Config) -> str | None:
    if _selected(config):
        return "real vLLM tier: selected"
    return None


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    measured = config.stash.get(MEASUREMENTS, {})
    if measured:
        terminalreporter.section("real vLLM: measured")
        for name, value in measured.items():
            terminalreporter.write_line(f"{name}: {value}")


@pytest.fixture(scope="session")
def measurements(pytestconfig: pytest.Config) -> dict[str, Any]:
    """Numbers worth reporting (printed at the end of the run)."""
    return pytestconfig.stash[MEASUREMENTS]


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The CPU vLLM venv's Python ($GLOBALPOOL_VLLM_VENV or ~/.cache/globalpool/vllm-venv)."""
    return ensure_venv()


@pytest.fixture(scope="session")
def tiny_model(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(vllm_python, tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def pool(
    vllm_python: Path, tiny_model: Path, redis_url: str,
    tmp_path_factory: pytest.TempPathFactory, measurements: dict[str, Any],
) -> Iterator[RealPool]:
    """Two regions, each one real vLLM launched by `globalpool worker --launch`, and the
    router in front. Stopping it must leave no process behind."""
    work = tmp_path_factory.mktemp("real-pool")
    running = RealPool(work, vllm_python, tiny_model, redis_url,
                       f"gpvllm-{uuid.uuid4().hex[:8]}")
    running.measurements = measurements
    try:
        running.start()
        yield running
    finally:
        leftovers = running.stop()
        assert leftovers == [], f"processes left behind: {leftovers}; logs in {work}"
