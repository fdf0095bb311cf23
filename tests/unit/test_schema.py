"""regions.schema.json: generated from the config models, committed, and in step with them."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from router.config_loader import ConfigError, parse_config
from router.config_schema import SCHEMA_FILE, config_schema
from tests.conftest import ROOT


def test_committed_schema_matches_the_models() -> None:
    committed = json.loads((ROOT / SCHEMA_FILE).read_text())
    assert committed == config_schema(), (
        f"{SCHEMA_FILE} is out of date with router/config.py: regenerate it with "
        f"`python -m router.config_schema --write {SCHEMA_FILE}`")


def test_regions_yaml_points_editors_at_the_schema() -> None:
    first_line = (ROOT / "regions.yaml").read_text().splitlines()[0]
    assert first_line == f"# yaml-language-server: $schema=./{SCHEMA_FILE}"


def _validator() -> Any:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((ROOT / SCHEMA_FILE).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_shipped_regions_yaml_validates_against_the_schema() -> None:
    validator = _validator()
    document = yaml.safe_load((ROOT / "regions.yaml").read_text())
    assert list(validator.iter_errors(document)) == []


@pytest.mark.parametrize(("change", "path"), [
    ({"router": {"port": 70000}}, ["router", "port"]),
    ({"router": {"polcy": "x"}}, ["router"]),  # a typo: unknown fields are refused
    ({"regions": {"EU_West": {"models": ["m"]}}}, ["regions"]),
    ({"regions": {"eu": {"models": []}}}, ["regions", "eu", "models"]),
    ({"admin": {"config_check_s": -1}}, ["admin", "config_check_s"]),
])
def test_schema_refuses_what_the_loader_refuses(change: dict[str, Any], path: list[str]) -> None:
    validator = _validator()
    document = {"apiVersion": "globalpool/v1", "regions": {"eu": {"models": ["m"]}}, **change}
    errors = list(validator.iter_errors(document))
    assert errors, f"the schema accepted {change}"
    assert list(errors[0].absolute_path)[: len(path)] == path
    with pytest.raises(ConfigError):
        parse_config(document)
