"""ConfigWatcher: a changed regions.yaml is validated and swapped in; a bad one is refused."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from router.config import GlobalConfig
from router.config_loader import load_config
from router.config_reload import ConfigHolder, ConfigWatcher, ReloadError, initial_holder

GOOD = {
    "apiVersion": "globalpool/v1",
    "router": {"region": "us-east"},
    "regions": {"us-east": {"rtt_ms": {"eu-west": 80}, "models": ["m"]},
                "eu-west": {"models": ["m"]}},
}


def _write(path: Path, document: object) -> None:
    path.write_text(yaml.safe_dump(document))
    # Make the change visible to a stat-based watcher even within one mtime tick.
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))


def _watcher(tmp_path: Path, **changes: object) -> tuple[ConfigHolder, ConfigWatcher, Path]:
    path = tmp_path / "regions.yaml"
    _write(path, GOOD | changes)
    holder = initial_holder(load_config(path), path)
    watcher = ConfigWatcher(holder, path, router_region="us-east", interval_s=lambda: 0.01,
                            settle_s=0.0)
    return holder, watcher, path


async def test_a_changed_good_file_is_swapped_in_and_listeners_hear_of_it(tmp_path: Path) -> None:
    holder, watcher, path = _watcher(tmp_path)
    swaps: list[tuple[GlobalConfig, GlobalConfig]] = []
    holder.on_swap(lambda old, new: swaps.append((old, new)))
    first_version = holder.version
    assert holder.rtt_ms("eu-west", "us-east") == 80  # remembered for this config
    assert await watcher.check() is False  # nothing changed
    changed = GOOD | {"regions": {**GOOD["regions"],  # type: ignore[dict-item]
                                  "us-east": {"rtt_ms": {"eu-west": 30}, "models": ["m"]}}}
    _write(path, changed)
    assert await watcher.check() is True
    assert holder.current.rtt_ms("us-east", "eu-west") == 30
    assert holder.rtt_ms("eu-west", "us-east") == 30
    assert holder.version != first_version and holder.reloads == 1
    assert len(swaps) == 1 and swaps[0][0].rtt_ms("us-east", "eu-west") == 80


def test_remembered_rtts_are_bounded_and_follow_the_config_in_force() -> None:
    from router import config_reload

    holder = ConfigHolder(GlobalConfig.model_validate(GOOD))
    for number in range(config_reload.MAX_REMEMBERED_RTTS + 50):
        assert holder.rtt_ms("us-east", f"forged-{number}") == 1000.0  # unknown region
    assert len(holder._rtt) == config_reload.MAX_REMEMBERED_RTTS
    assert holder.rtt_ms("us-east", "eu-west") == 80
    changed = GOOD | {"regions": {**GOOD["regions"],  # type: ignore[dict-item]
                                  "us-east": {"rtt_ms": {"eu-west": 30}, "models": ["m"]}}}
    holder.current = GlobalConfig.model_validate(changed)  # even without swap()
    assert holder.rtt_ms("us-east", "eu-west") == 30 and len(holder._rtt) == 1


async def test_a_touched_but_unchanged_file_is_not_reloaded(tmp_path: Path) -> None:
    holder, watcher, path = _watcher(tmp_path)
    _write(path, GOOD)
    assert await watcher.check() is False
    assert holder.reloads == 0 and holder.last_error is None


async def test_a_bad_file_is_refused_and_the_last_good_config_stays(tmp_path: Path) -> None:
    holder, watcher, path = _watcher(tmp_path)
    refusals: list[ReloadError] = []
    holder.on_refused(refusals.append)
    good = holder.current
    bad = GOOD | {"regions": {**GOOD["regions"],  # type: ignore[dict-item]
                              "eu-west": {"rtt_ms": {"us-east": -5}, "models": ["m"]}}}
    _write(path, bad)
    assert await watcher.check() is False
    assert holder.current is good
    assert holder.last_error is not None and holder.reload_errors == 1
    assert holder.last_error.problems == (f"{path}: regions.eu-west.rtt_ms.us-east: must be >= 0",)
    assert refusals == [holder.last_error]
    path.write_text("regions: [\n")
    assert await watcher.check() is False
    assert holder.last_error.problems[0].startswith(f"{path}: line 2, column 1: invalid YAML")
    # Putting the good file back clears the error.
    _write(path, GOOD)
    assert await watcher.check() is True
    assert holder.last_error is None and holder.current == good


async def test_a_file_without_the_routers_region_is_refused(tmp_path: Path) -> None:
    holder, watcher, path = _watcher(tmp_path)
    _write(path, {"apiVersion": "globalpool/v1", "regions": {"eu-west": {"models": ["m"]}}})
    assert await watcher.check() is False
    assert holder.last_error is not None
    assert "this router's region 'us-east' is missing" in holder.last_error.problems[0]


async def test_extra_checks_and_a_missing_file_are_refusals(tmp_path: Path) -> None:
    holder, _, path = _watcher(tmp_path)
    watcher = ConfigWatcher(holder, path, router_region=None, interval_s=lambda: 1.0,
                            settle_s=0.0, extra_checks=lambda c: ["router.policy: unknown"])
    _write(path, GOOD | {"router": {"near_equal_ms": 9}})
    assert await watcher.check() is False
    assert holder.last_error is not None
    assert holder.last_error.problems == (f"{path}: router.policy: unknown",)
    path.unlink()
    assert await watcher.check() is False
    assert "cannot read" in holder.last_error.problems[0]


async def test_settings_bound_at_start_are_reported_as_needing_a_restart(
        tmp_path: Path) -> None:
    holder, watcher, path = _watcher(tmp_path)
    _write(path, GOOD | {"router": {"region": "us-east", "port": 9999, "near_equal_ms": 1}})
    assert await watcher.check() is True
    assert holder.restart_required == ("router.port",)
    assert holder.current.router.near_equal_ms == 1
