"""regions.yaml loading: every error names the file, the path in the document and the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from router.cli import main
from router.config_loader import ConfigError, load_config, parse_config
from tests.conftest import ROOT

GOOD = {
    "apiVersion": "globalpool/v1",
    "regions": {
        "us-east": {"rtt_ms": {"eu-west": 80}, "models": ["m"]},
        "eu-west": {"models": ["m", "n"]},
    },
}


def _write(tmp_path: Path, document: object) -> Path:
    path = tmp_path / "regions.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def _problems(tmp_path: Path, document: object) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config(_write(tmp_path, document))
    return caught.value.problems


def test_shipped_regions_yaml_is_valid() -> None:
    config = load_config(ROOT / "regions.yaml")
    assert set(config.regions) == {"us-east", "eu-west", "ap-south"}
    assert config.router.region == "us-east"


def test_rtt_is_symmetric_when_given_once() -> None:
    config = parse_config(GOOD)
    assert config.rtt_ms("us-east", "eu-west") == 80
    assert config.rtt_ms("eu-west", "us-east") == 80
    assert config.rtt_ms("eu-west", "eu-west") == 0
    assert config.models == ["m", "n"]


def test_negative_rtt_names_file_path_and_reason(tmp_path: Path) -> None:
    document = {
        "apiVersion": "globalpool/v1",
        "regions": {
            "us-east": {"models": ["m"]},
            "eu-west": {"rtt_ms": {"us-east": -5}, "models": ["m"]},
        },
    }
    path = tmp_path / "regions.yaml"
    expected = f"{path}: regions.eu-west.rtt_ms.us-east: must be >= 0"
    assert _problems(tmp_path, document) == [expected]


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    document = {
        "apiVersion": "globalpool/v1",
        "router": {"port": 70000, "colour": "blue"},
        "regions": {"us-east": {"models": []}},
    }
    problems = [p.split(": ", 1)[1] for p in _problems(tmp_path, document)]
    assert "router.port: must be <= 65535" in problems
    assert "router.colour: unknown field" in problems
    assert "regions.us-east.models: must not be empty" in problems


def test_references_to_unknown_regions(tmp_path: Path) -> None:
    document = {
        "apiVersion": "globalpool/v1",
        "router": {"region": "mars"},
        "regions": {
            "us-east": {"rtt_ms": {"moon": 5}, "models": ["m"]},
            "eu-west": {"models": ["m"]},
        },
    }
    problems = [p.split(": ", 1)[1] for p in _problems(tmp_path, document)]
    assert "regions.us-east.rtt_ms.moon: no such region" in problems
    assert "regions.eu-west.rtt_ms.us-east: missing (give it in either region)" in problems
    assert "router.region: no region named 'mars'" in problems


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ({"regions": {"a": {"models": ["m"]}}}, "apiVersion: is required"),
        ({"apiVersion": "globalpool/v9", "regions": {}}, "apiVersion: unsupported"),
        ({"apiVersion": "globalpool/v1"}, "regions: is required"),
        (["not", "a", "mapping"], "(document): must be a mapping"),
        (
            {"apiVersion": "globalpool/v1", "heartbeat": {"interval_s": 1, "ttl_s": 1},
             "regions": {"a": {"models": ["m"]}}},
            "heartbeat: ttl_s must be at least twice interval_s",
        ),
        (
            {"apiVersion": "globalpool/v1", "regions": {"Bad_Name": {"models": ["m"]}}},
            "regions.Bad_Name: region names are lowercase",
        ),
        (
            {"apiVersion": "globalpool/v1", "router": {"fleet_view_cpu_share": 0},
             "regions": {"a": {"models": ["m"]}}},
            "router.fleet_view_cpu_share: ",
        ),
    ],
)
def test_invalid_documents(tmp_path: Path, document: object, expected: str) -> None:
    problems = _problems(tmp_path, document)
    assert any(expected in p for p in problems), problems


def test_invalid_yaml_names_line(tmp_path: Path) -> None:
    path = tmp_path / "regions.yaml"
    path.write_text("apiVersion: globalpool/v1\nregions: [unclosed\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems[0].startswith(f"{path}: line ")
    assert "invalid YAML" in caught.value.problems[0]


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")


def test_check_config_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", str(ROOT / "regions.yaml")]) == 0
    assert "OK (3 regions" in capsys.readouterr().out
    bad = _write(tmp_path, {"apiVersion": "globalpool/v1", "regions": {"a": {"models": 3}}})
    assert main(["check-config", str(bad)]) == 1
    assert f"{bad}: regions.a.models:" in capsys.readouterr().err
