"""Reading `regions.yaml` into a `GlobalConfig`, with errors that name the file, the path
and the reason.

    regions.yaml: regions.eu-west.rtt_ms.us-east: must be >= 0

`load_config(path)` returns a frozen `GlobalConfig` or raises `ConfigError` carrying every
problem found, so an operator fixes the file in one pass. A file is refused before it is
parsed when it is larger than `MAX_CONFIG_BYTES`, and while parsed when a mapping repeats a
key (plain YAML keeps the last one silently: a region pasted twice would lose its first
definition) or when it is nested too deeply for the parser.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from router.auth.config import KeysFileError, merge_keys_file
from router.config import API_VERSION, GlobalConfig, ReferenceErrors

# A regions.yaml for hundreds of regions is a few hundred KB. Pure-Python YAML parses about
# 100 KB a second, so a bigger file is a mistake (or an attack), refused before reading.
MAX_CONFIG_BYTES = 4 * 1024 * 1024


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
    "finite_number": "must be a finite number (not .inf or .nan)",
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


def read_config_bytes(path: str | Path) -> bytes:
    """The bytes of a config file, refused (ConfigError) if it cannot be read or is larger
    than MAX_CONFIG_BYTES; the size is checked before reading, and again on what was read
    (the file may grow in between)."""
    source = str(path)
    try:
        with Path(path).open("rb") as file:
            size = os.fstat(file.fileno()).st_size
            text = b"" if size > MAX_CONFIG_BYTES else file.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(source, [f"(file): cannot read: {exc.strerror or exc}"]) from None
    if size > MAX_CONFIG_BYTES or len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(source, [
            f"(file): {max(size, len(text)):,} bytes is larger than the "
            f"{MAX_CONFIG_BYTES:,}-byte limit for a config file"])
    return text


def load_config(path: str | Path) -> GlobalConfig:
    """Read and validate a regions.yaml. Raises ConfigError on any problem."""
    return parse_config_text(read_config_bytes(path), str(path))


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping repeating a key (SafeLoader keeps the last).

    The check runs on a mapping's own keys before `<<` merges are flattened into it, so a
    key that overrides a merged one is not a duplicate."""

    def __init__(self, stream: str | bytes) -> None:
        super().__init__(stream)
        self._checked: set[int] = set()  # mappings checked, by id (flattened in place)

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        if id(node) not in self._checked:
            self._checked.add(id(node))
            _refuse_repeated_keys(self, node)
        super().flatten_mapping(node)


def _refuse_repeated_keys(loader: _StrictLoader, node: yaml.MappingNode) -> None:
    first_line: dict[Any, int] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
            continue
        key = loader.construct_object(key_node)
        try:
            line = first_line.get(key)
        except TypeError:  # unhashable: SafeLoader itself refuses it
            continue
        if line is None:
            first_line[key] = key_node.start_mark.line + 1
        else:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark,
                f"duplicate key {str(key)[:100]!r} (first on line {line}; a key may appear "
                "only once in a mapping)", key_node.start_mark)


_MERGE_TAG = "tag:yaml.org,2002:merge"


def parse_config_text(text: str | bytes, source: str = "regions.yaml") -> GlobalConfig:
    """Parse and validate the YAML text of a regions.yaml. Raises ConfigError naming `source`."""
    try:
        document = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(document)"
        reason = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(source, [f"{where}: invalid YAML: {reason}"]) from None
    except RecursionError:  # e.g. thousands of '[': the parser recurses once per level
        raise ConfigError(source, ["(document): nested too deeply to parse (lists or "
                                   "mappings thousands of levels deep)"]) from None
    return parse_config(document, source)
