"""`globalpool check-config` is the router's own validation: a file that one accepts the
other accepts, and what the router cannot use is refused before it listens, in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from lab.devstack.valkey import free_port
from tests.conftest import ROOT

pytestmark = pytest.mark.integration


def _config(tmp_path: Path, **changes: Any) -> Path:
    document: dict[str, Any] = {
        "apiVersion": "globalpool/v1",
        "redis": {"url": "redis://127.0.0.1:6379/0"},
        "router": {"region": "us-east", "port": free_port()},
        "regions": {"us-east": {"models": ["m"]}},
    }
    for section, values in changes.items():
        document[section] = {**document[section], **values}
    path = tmp_path / "regions.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def _globalpool(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != "REDIS_URL"} | (env or {})
    return subprocess.run([sys.executable, "-m", "router.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=environment)


@pytest.mark.parametrize(("changes", "problem"), [
    ({"router": {"policy": "fastest"}}, "router.policy: unknown policy 'fastest'"),
    ({"redis": {"url": "redis+sentinel://127.0.0.1:26379"}},
     "redis+sentinel://HOSTS/SERVICE[/DB]: name the monitored service"),
    ({"redis": {"url": "redis://"}}, "redis:// needs a host"),
], ids=["unknown-policy", "sentinel-url-without-service", "no-host"])
def test_check_config_and_the_router_refuse_the_same_file_in_one_line(
        tmp_path: Path, changes: dict[str, Any], problem: str) -> None:
    config = _config(tmp_path, **changes)
    checked = _globalpool("check-config", str(config))
    assert checked.returncode == 1 and problem in checked.stderr, checked
    started = _globalpool("router", "--config", str(config))
    assert started.returncode == 1, started
    assert problem in started.stderr, started.stderr
    assert "listening" not in started.stderr and "Traceback" not in started.stderr
    assert len(started.stderr.strip().splitlines()) == 1, started.stderr


def test_a_redis_url_from_the_environment_is_checked_before_listening(tmp_path: Path) -> None:
    config = _config(tmp_path)
    assert _globalpool("check-config", str(config)).returncode == 0
    started = _globalpool("router", "--config", str(config),
                          env={"REDIS_URL": "redis+shard://127.0.0.1:7000"})
    assert started.returncode == 2, started
    assert started.stderr.strip() == (
        "REDIS_URL: the scheme 'redis+shard' is not supported: use redis://, rediss:// "
        "(TLS), unix://, redis+sentinel:// or redis+cluster:// (rediss+... with TLS)")
    started = _globalpool("router", "--config", str(config),
                          env={"REDIS_URL": "redis+cluster://127.0.0.1:7000/2"})
    assert started.returncode == 2, started
    assert started.stderr.strip() == ("REDIS_URL: redis+cluster://: a cluster has only "
                                      "database 0: redis+cluster://HOSTS/")
    started = _globalpool("router", "--config", str(config),
                          env={"REDIS_URL": "redis+sentinel://127.0.0.1:26379"})
    assert started.returncode == 2, started
    assert started.stderr.strip() == ("REDIS_URL: redis+sentinel://: redis+sentinel://HOSTS/"
                                      "SERVICE[/DB]: name the monitored service")
