"""What regions.yaml refuses beyond its schema: repeated keys, deep nesting, a file too
large to parse; and how much of a refusal is kept (the status is polled every second)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import yaml

from router import config_loader, config_reload
from router.cli import main
from router.config_loader import ConfigError, load_config, parse_config_text
from router.config_reload import (
    MAX_PROBLEM_CHARS,
    MAX_PROBLEMS,
    ConfigWatcher,
    bounded_problems,
    initial_holder,
)

GOOD = """apiVersion: globalpool/v1
regions:
  us-east:
    rtt_ms: {eu-west: 80}
    models: [m]
  eu-west:
    models: [m]
"""


def _problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config_text(text, "r.yaml")
    return caught.value.problems


def test_a_region_given_twice_is_refused_naming_the_key_and_both_lines() -> None:
    text = GOOD + "  eu-west:\n    models: [n]\n"
    assert yaml.safe_load(text)["regions"]["eu-west"] == {"models": ["n"]}  # plain YAML
    assert _problems(text) == [
        "r.yaml: line 8, column 3: invalid YAML: duplicate key 'eu-west' (first on line 6; "
        "a key may appear only once in a mapping)"]


@pytest.mark.parametrize("text", [
    "apiVersion: globalpool/v1\napiVersion: globalpool/v1\nregions: {}\n",
    GOOD.replace("models: [m]\n  eu-west", "models: [m]\n    models: [n]\n  eu-west"),
    GOOD + "  x: {models: [m], models: [n]}\n",  # on one line
    GOOD + "  x: {1: a, 0x1: b}\n",  # two spellings of one key
])
def test_every_repeated_key_is_refused(text: str) -> None:
    problems = _problems(text)
    assert len(problems) == 1 and "duplicate key" in problems[0], problems


@pytest.mark.parametrize(("old", "new", "where"), [
    ("rtt_ms: {eu-west: 80}", "rtt_ms: {eu-west: .nan}", "regions.us-east.rtt_ms.eu-west"),
    ("rtt_ms: {eu-west: 80}", "rtt_ms: {eu-west: .inf}", "regions.us-east.rtt_ms.eu-west"),
    ("models: [m]\n  eu-west", "models: [m]\n    cost_per_gpu_hour: .inf\n  eu-west",
     "regions.us-east.cost_per_gpu_hour"),
    ("regions:", "router: {timeouts: {connect_s: .inf}}\nregions:", "router.timeouts.connect_s"),
    ("regions:", "router: {near_equal_ms: .Inf}\nregions:", "router.near_equal_ms"),
    ("regions:", "batch: {max_file_bytes: .nan}\nregions:", "batch.max_file_bytes"),
])
def test_a_number_that_is_not_finite_is_refused(old: str, new: str, where: str) -> None:
    # NaN passed every bound (a NaN RTT was 'OK' and poisoned every prediction through
    # that path); inf passed the lower ones (an endless connect timeout, every worker
    # "equally good").
    problems = _problems(GOOD.replace(old, new, 1))
    assert any(problem.startswith(f"r.yaml: {where}: ") for problem in problems), problems


def test_a_key_overriding_a_merged_one_is_not_a_duplicate() -> None:
    text = ("base: &base {models: [m], rtt_ms: {eu-west: 80}}\n"
            "regions:\n  us-east: {<<: *base, models: [n]}\n  eu-west: {<<: *base}\n")
    document = yaml.load(text, Loader=config_loader._StrictLoader)
    assert document["regions"]["us-east"] == {"models": ["n"], "rtt_ms": {"eu-west": 80}}
    assert document["regions"]["eu-west"] == {"models": ["m"], "rtt_ms": {"eu-west": 80}}


def test_deep_nesting_is_a_clear_refusal_not_a_recursion_error() -> None:
    assert _problems(GOOD + "deep: " + "[" * 3000 + "]" * 3000 + "\n") == [
        "r.yaml: (document): nested too deeply to parse (lists or mappings thousands of "
        "levels deep)"]


def test_a_file_over_the_size_limit_is_refused_before_it_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "regions.yaml"
    path.write_text(GOOD + "#" * 1000 + "\n")
    monkeypatch.setattr(config_loader, "MAX_CONFIG_BYTES", 1000)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems == [f"{path}: (file): {path.stat().st_size:,} bytes is "
                                     "larger than the 1,000-byte limit for a config file"]
    monkeypatch.setattr(config_loader, "MAX_CONFIG_BYTES", 2000)
    assert list(load_config(path).regions) == ["us-east", "eu-west"]


def test_check_config_prints_one_line_not_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "regions.yaml"
    for text, expected in ((GOOD + "deep: " + "[" * 3000 + "]" * 3000 + "\n", "too deeply"),
                           (GOOD + "  eu-west: {models: [n]}\n", "duplicate key 'eu-west'")):
        path.write_text(text)
        assert main(["check-config", str(path)]) == 1
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err and err.count("\n") == 1, err


def test_a_refusal_keeps_the_first_problems_cut_and_counts_the_rest() -> None:
    problems = [f"r.yaml: regions.x.unknown-{i}-{'z' * 1000}: unknown field"
                for i in range(5000)]
    kept = bounded_problems(problems, "r.yaml")
    assert len(kept) == MAX_PROBLEMS + 1
    assert all(len(p) <= MAX_PROBLEM_CHARS for p in kept)
    assert kept[0].startswith("r.yaml: regions.x.unknown-0-zzz") and kept[0].endswith("…")
    assert kept[-1] == f"r.yaml: ... and {5000 - MAX_PROBLEMS:,} more problems (not shown)"
    assert bounded_problems(["a", "b"], "r.yaml") == ["a", "b"]


async def test_the_watcher_keeps_a_bounded_refusal(tmp_path: Path) -> None:
    path = tmp_path / "regions.yaml"
    path.write_text(GOOD)
    holder = initial_holder(load_config(path), path)
    watcher = ConfigWatcher(holder, path, router_region=None, interval_s=lambda: 1.0)
    path.write_text(GOOD + "".join(f"    unknown-{i}: 1\n" for i in range(500)))
    assert await watcher.reload() is False
    assert holder.last_error is not None and len(holder.last_error.problems) == MAX_PROBLEMS + 1
    assert holder.last_error.problems[-1].startswith(f"{path}: ... and 450 more problems")


async def test_the_watcher_parses_in_a_thread_while_the_loop_serves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "regions.yaml"
    path.write_text(GOOD)
    holder = initial_holder(load_config(path), path)
    watcher = ConfigWatcher(holder, path, router_region=None, interval_s=lambda: 1.0)
    real_parse = config_loader.parse_config_text

    def slow_parse(text: str | bytes, source: str) -> object:
        time.sleep(0.5)  # as pure-Python YAML on a few MB
        return real_parse(text, source)

    monkeypatch.setattr(config_reload, "parse_config_text", slow_parse)  # as imported there
    path.write_text(GOOD.replace("[m]", "[m, n]", 1))
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    try:
        assert await watcher.reload() is True
    finally:
        ticker.cancel()
    assert ticks >= 20, ticks  # the loop kept turning while the file was parsed
    assert list(holder.current.regions["us-east"].models) == ["m", "n"]
