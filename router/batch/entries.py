"""The lines of a batch's output and error files, as OpenAI writes them."""

from __future__ import annotations

import json
from typing import Any


def request_id(batch_id: str, index: int) -> str:
    """The `id` of line `index`'s entry in the output or error file (the same for every
    run of the line)."""
    return f"batch_req_{batch_id.removeprefix('batch_')[:24]}{index:07d}"


def output_line(batch_id: str, index: int, custom_id: str, status: int, request_id_: str,
                body: Any) -> str:
    """A line of the output (status 200) or error file (any other status): the engine's
    answer, as OpenAI writes it."""
    return json.dumps({"id": request_id(batch_id, index), "custom_id": custom_id,
                       "response": {"status_code": status, "request_id": request_id_,
                                    "body": body},
                       "error": None}, separators=(",", ":"))


def error_line(batch_id: str, index: int, custom_id: str | None, code: str,
               message: str) -> str:
    """A line of the error file for a request that got no answer."""
    return json.dumps({"id": request_id(batch_id, index), "custom_id": custom_id,
                       "response": None, "error": {"code": code, "message": message}},
                      separators=(",", ":"))
