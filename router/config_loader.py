"""Reading `regions.yaml` into a `GlobalConfig`, with errors that name the file, the path
and the reason.

    regions.yaml: regions.eu-west.rtt_ms.us-east: must be >= 0

`load_config(path)` returns a frozen `GlobalConfig` or raises `ConfigError` carrying every
problem found, so an operator fixes the file in one pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from router.auth.config import KeysFileError, merge_keys_file
from router.config import API_VERSION, GlobalConfig, ReferenceErrors


class ConfigError(Exception):
    """A config file that cannot be used; `problems` lists every error as `file: path: reason`."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = [f"{source}: {p}" for p in problems]
        super().__init__("\n".join(self.problems))


_MESSAGES = {
    "greater_than_equal": "must be >= {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}",
    "less_than": "must be < {lt}",
    "missing": "is required",
    "extra_forbidden": "unknown field",
    "too_short": "must not be empty",
}


def _describe(error: Any) -> list[str]:
    ctx = error.get("ctx") or {}
    inner = ctx.get("error")
    if isinstance(inner, ReferenceErrors):
        return inner.problems
    path = ".".join(str(part) for part in error["loc"]) or "(document)"
    template = _MESSAGES.get(error["type"])
    if template is not None:
        try:
            return [f"{path}: {template.format(**ctx)}"]
        except KeyError:
            pass
    message = str(error["msg"]).removeprefix("Value error, ")
    return [f"{path}: {message}"]


def parse_config(document: Any, source: str = "regions.yaml") -> GlobalConfig:
    """Validate an already-parsed document. Raises ConfigError naming `source`."""
    if not isinstance(document, dict):
        raise ConfigError(source, ["(document): must be a mapping with apiVersion and regions"])
    if document.get("apiVersion") not in (None, API_VERSION):
        raise ConfigError(
            source,
            [f"apiVersion: unsupported {document['apiVersion']!r}, expected {API_VERSION!r}"],
        )
    try:
        # A keys file named by auth.keys_file is relative to the file being read.
        document = merge_keys_file(document, Path(source).parent)
    except KeysFileError as exc:
        raise ConfigError(exc.source, exc.problems) from None
    try:
        return GlobalConfig.model_validate(document)
    except ValidationError as exc:
        problems: list[str] = []
        for error in exc.errors():
            problems.extend(_describe(error))
        raise ConfigError(source, problems) from None


def load_config(path: str | Path) -> GlobalConfig:
    """Read and validate a regions.yaml. Raises ConfigError on any problem."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(source, [f"(file): cannot read: {exc.strerror or exc}"]) from None
    return parse_config_text(text, source)


def parse_config_text(text: str | bytes, source: str = "regions.yaml") -> GlobalConfig:
    """Parse and validate the YAML text of a regions.yaml. Raises ConfigError naming `source`."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(document)"
        reason = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(source, [f"{where}: invalid YAML: {reason}"]) from None
    return parse_config(document, source)
