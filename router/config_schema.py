"""regions.schema.json: the JSON Schema of regions.yaml, generated from the pydantic models.

Editors validate regions.yaml as it is typed through the first line of the file:

    # yaml-language-server: $schema=./regions.schema.json

Regenerate after changing `router.config` (a test fails until the committed file matches):

    python -m router.config_schema --write regions.schema.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from router.config import _REGION_NAME, GlobalConfig

SCHEMA_FILE = "regions.schema.json"
DIALECT = "https://json-schema.org/draft/2020-12/schema"


def config_schema() -> dict[str, Any]:
    """The schema of the document `router.config_loader.parse_config` accepts."""
    schema = GlobalConfig.model_json_schema(mode="validation")
    schema = {"$schema": DIALECT, "title": "globalpool regions.yaml",
              **{k: v for k, v in schema.items() if k != "title"}}
    # Checked by a model validator in Python; spelled out here so editors check it too.
    schema["properties"]["regions"]["propertyNames"] = {"pattern": _REGION_NAME}
    return schema


def render() -> str:
    return json.dumps(config_schema(), indent=2) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m router.config_schema",
                                     description="print or write the regions.yaml JSON Schema")
    parser.add_argument("--write", metavar="FILE", help="write the schema to FILE")
    args = parser.parse_args(argv)
    if args.write:
        Path(args.write).write_text(render(), encoding="utf-8")
    else:
        sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
