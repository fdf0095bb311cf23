"""How `globalpool worker` resolves flags, environment and regions.yaml (no servers)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from worker.cli import (
    WorkerConfigError,
    add_worker_arguments,
    run_worker,
    settings_from_args,
)
from worker.redis_client import redact_url

REQUIRED = ["--region", "eu-west", "--engine-url", "http://10.0.0.7:8000/"]


def parse(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    return parser.parse_args([*REQUIRED, *extra])


def write_config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "regions.yaml"
    path.write_text(
        "apiVersion: globalpool/v1\n" + body
        + "regions:\n  eu-west: {rtt_ms: {eu-west: 1}, models: [tiny-llama]}\n"
    )
    return path


def test_defaults() -> None:
    settings = settings_from_args(parse("--redis-url", "redis://r:6379/0"), {})
    assert settings.identity.worker_id == "eu-west-10.0.0.7-8000"
    assert settings.identity.endpoint == "http://10.0.0.7:8000"
    assert settings.identity.max_num_seqs == 256
    assert settings.identity.engine_kind == "vllm"
    assert settings.engine_url == "http://10.0.0.7:8000"
    assert settings.key_prefix == "globalpool"
    assert (settings.timing.interval_s, settings.timing.ttl_s) == (0.5, 2.0)
    assert settings.drain_timeout_s == 30.0
    assert settings.probe_timeout_s < settings.timing.ttl_s / 2


def test_worker_id_follows_the_advertised_endpoint() -> None:
    args = parse("--redis-url", "redis://r", "--advertise-url", "https://gpu-3.eu.example.com")
    settings = settings_from_args(args, {})
    assert settings.identity.worker_id == "eu-west-gpu-3.eu.example.com-443"
    assert settings.identity.endpoint == "https://gpu-3.eu.example.com"
    assert settings.engine_url == "http://10.0.0.7:8000"


def test_redis_url_comes_from_environment_when_no_flag() -> None:
    settings = settings_from_args(parse(), {"REDIS_URL": "redis://env:6379/0"})
    assert settings.redis_url == "redis://env:6379/0"
    flagged = settings_from_args(parse("--redis-url", "redis://flag"), {"REDIS_URL": "redis://env"})
    assert flagged.redis_url == "redis://flag"


def test_missing_redis_url_is_an_error() -> None:
    with pytest.raises(WorkerConfigError, match="REDIS_URL"):
        settings_from_args(parse(), {})


def test_run_worker_refuses_bad_settings_with_exit_code_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    assert run_worker(parse()) == 2
    assert "no Redis URL" in capsys.readouterr().err


def test_config_file_supplies_what_flags_do_not(tmp_path: Path) -> None:
    config = write_config(tmp_path, (
        "redis: {url: 'rediss://:s3cret@cfg:6380/1', key_prefix: prod}\n"
        "heartbeat: {interval_s: 1.0, ttl_s: 5.0}\n"
    ))
    settings = settings_from_args(parse("--config", str(config)), {})
    assert settings.redis_url == "rediss://:s3cret@cfg:6380/1"
    assert settings.key_prefix == "prod"
    assert (settings.timing.interval_s, settings.timing.ttl_s) == (1.0, 5.0)

    flagged = settings_from_args(
        parse("--config", str(config), "--interval-s", "0.2", "--key-prefix", "x"),
        {"REDIS_URL": "redis://env"},
    )
    assert flagged.redis_url == "redis://env"
    assert (flagged.timing.interval_s, flagged.timing.ttl_s, flagged.key_prefix) == (0.2, 5.0, "x")


def test_embedded_redis_in_config_needs_a_real_url(tmp_path: Path) -> None:
    config = write_config(tmp_path, "redis: {url: embedded}\n")
    with pytest.raises(WorkerConfigError, match="no Redis URL"):
        settings_from_args(parse("--config", str(config)), {})


def test_config_errors_name_file_and_path(tmp_path: Path) -> None:
    config = write_config(tmp_path, "heartbeat: {interval_s: -1}\n")
    with pytest.raises(WorkerConfigError, match=r"regions\.yaml: heartbeat\.interval_s: "):
        settings_from_args(parse("--config", str(config), "--redis-url", "redis://r"), {})
    with pytest.raises(WorkerConfigError, match="cannot read"):
        settings_from_args(parse("--config", str(tmp_path / "nope.yaml")), {})


@pytest.mark.parametrize(("flags", "message"), [
    (["--ttl-s", "0.6"], "at least twice"),
    (["--interval-s", "0"], "must be a number > 0"),
    (["--interval-s", "nan"], "must be a number > 0"),  # (NaN passed every comparison)
    (["--drain-timeout-s", "nan"], "--drain-timeout-s: must be a number >= 0"),
    (["--drain-timeout-s", "inf"], "--drain-timeout-s: must be a number >= 0"),
    (["--max-num-seqs", "0"], "max-num-seqs"),
    (["--worker-id", "has space"], "worker-id"),
    (["--advertise-url", "gpu-1:8000"], "advertise-url"),
])
def test_bad_flags_are_refused(flags: list[str], message: str) -> None:
    with pytest.raises(WorkerConfigError, match=message):
        settings_from_args(parse("--redis-url", "redis://r", *flags), {})


def test_passwords_are_not_printed() -> None:
    assert redact_url("rediss://default:s3cret@host:6380/0") == "rediss://default:***@host:6380/0"
    assert redact_url("redis://:s3cret@host:6379") == "redis://:***@host:6379"
    assert redact_url("redis://host:6379/0") == "redis://host:6379/0"
    assert redact_url("redis+sentinel://:pw@s1:26379,s2/gp/0?sentinel_password=spw"
                      "&sentinel_username=u") == (
        "redis+sentinel://:***@s1:26379,s2/gp/0?sentinel_password=***&sentinel_username=u")


def test_a_malformed_sentinel_url_is_refused_before_connecting() -> None:
    with pytest.raises(WorkerConfigError, match=r"is not host:port"):
        settings_from_args(parse("--redis-url", "redis+sentinel://s1:x/gp"), {})
    with pytest.raises(WorkerConfigError, match=r"\*\*\*.*name the monitored service"):
        settings_from_args(parse("--redis-url", "redis+sentinel://:pw@s1"), {})


def parse_launch(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    return parser.parse_args(["--region", "us-east", "--redis-url", "redis://r", *argv])


def test_launch_reads_url_and_max_num_seqs_from_the_engine_command(tmp_path: Path) -> None:
    settings = settings_from_args(parse_launch(
        "--engine-log", str(tmp_path / "vllm.log"), "--start-timeout-s", "90",
        "--launch", "--", "vllm", "serve", "/models/tiny", "--host", "127.0.1.1",
        "--port", "9001", "--max-num-seqs", "8",
    ), {})
    assert settings.engine_url == "http://127.0.1.1:9001"
    assert settings.identity.endpoint == "http://127.0.1.1:9001"
    assert settings.identity.worker_id == "us-east-127.0.1.1-9001"
    assert settings.identity.max_num_seqs == 8
    assert settings.launch is not None
    assert settings.launch.argv == ("vllm", "serve", "/models/tiny", "--host", "127.0.1.1",
                                    "--port", "9001", "--max-num-seqs", "8")
    assert settings.launch.log_path == tmp_path / "vllm.log"
    assert settings.restart.start_timeout_s == 90
    assert settings.restart.max_backoff_s == 30


@pytest.mark.parametrize(("command", "url", "max_num_seqs"), [
    (["vllm", "serve", "m"], "http://127.0.0.1:8000", 256),
    (["vllm", "serve", "m", "--host=0.0.0.0", "--port=8123", "--max_num_seqs=4"],
     "http://127.0.0.1:8123", 4),
    (["python", "-m", "vllm.entrypoints.openai.api_server", "--host", "::", "--port", "81"],
     "http://[::1]:81", 256),
])
def test_launch_defaults_follow_vllm(command: list[str], url: str, max_num_seqs: int) -> None:
    settings = settings_from_args(parse_launch("--launch", "--", *command), {})
    assert (settings.engine_url, settings.identity.max_num_seqs) == (url, max_num_seqs)


def test_flags_win_over_the_launched_command() -> None:
    settings = settings_from_args(parse_launch(
        "--engine-url", "http://127.0.0.1:9999", "--max-num-seqs", "3",
        "--advertise-url", "http://gpu-1.example:8000",
        "--launch", "--", "vllm", "serve", "m", "--port", "8000", "--max-num-seqs", "64",
    ), {})
    assert settings.engine_url == "http://127.0.0.1:9999"
    assert settings.identity.endpoint == "http://gpu-1.example:8000"
    assert settings.identity.max_num_seqs == 3
    assert settings.launch is not None


def test_attaching_has_no_launch() -> None:
    assert settings_from_args(parse("--redis-url", "redis://r"), {}).launch is None


def test_probe_timeout_may_be_raised_for_a_slow_engine() -> None:
    settings = settings_from_args(parse("--redis-url", "redis://r", "--ttl-s", "8",
                                        "--probe-timeout-s", "2.5"), {})
    assert settings.probe_timeout_s == 2.5


@pytest.mark.parametrize(("argv", "message"), [
    ([], "pass --engine-url URL, or --launch -- COMMAND"),
    (["--launch"], "give the engine's command after `--`"),
    (["--engine-url", "http://e:1", "--", "vllm", "serve"], "unexpected arguments 'vllm serve'"),
    (["--launch", "--", "vllm", "serve", "m", "--port", "http"], "--port 'http'"),
    (["--launch", "--", "vllm", "serve", "m", "--max-num-seqs", "0"], "must be 1..10,000,000"),
    (["--stop-timeout-s", "0", "--launch", "--", "vllm"], "--stop-timeout-s: must be a number > 0"),
    (["--start-timeout-s", "nan", "--launch", "--", "vllm"],
     "--start-timeout-s: must be a number > 0"),
    (["--max-failed-starts", "-1", "--launch", "--", "vllm"], "--max-failed-starts"),
    (["--probe-timeout-s", "1.5", "--engine-url", "http://e:1"], "at most half the TTL"),
])
def test_bad_launch_settings_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(WorkerConfigError, match=re.escape(message)):
        settings_from_args(parse_launch(*argv), {})
