"""A batch's input file, checked the way OpenAI checks it, before any line runs.

Each line of the JSONL file is one request:

    {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [...]}}

Two kinds of fault:
- **the file's** (the batch then fails at validation, as OpenAI's does, and nothing runs:
  it could not be answered one line per request): no lines, more than `max_lines`, a
  `custom_id` given twice (by any two lines, faulty ones included: each names one
  result), a line for another endpoint than the batch's, lines naming more than one model;
- **a line's** (that line gets an entry in the error file, the others run): not JSON (or
  nested too deeply to read), not an object, no string `custom_id`, a method other than
  POST, no `body` object, no `model`, `stream: true` (a batch's answers are whole).

Messages and `FileFault.line` name a line by its number in the file (from 1, blank lines
counted); a line's `index`, the key of its result, counts only the lines that are not blank.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# What a batch may be created for (OpenAI's list, as far as vLLM serves it).
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                   "/v1/responses")
MAX_CUSTOM_ID_CHARS = 512
MAX_FILE_ERRORS = 20  # the batch's `errors` lists this many of the file's faults at most


@dataclass(frozen=True, slots=True)
class Line:
    """A request that will run."""

    index: int  # its place among the file's lines that are not blank, from 0 (the key of
    # its result; messages name its line in the file, blank lines counted, from 1)
    custom_id: str
    body: bytes  # the request body as the engine gets it (JSON)


@dataclass(frozen=True, slots=True)
class LineFault:
    """A line that will not run: its entry in the error file."""

    index: int
    custom_id: str | None
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class FileFault:
    """A fault of the whole file, as OpenAI lists it in a failed batch's `errors`."""

    code: str
    message: str
    line: int | None = None  # from 1, as OpenAI numbers them
    param: str | None = None

    def to_openai(self) -> dict[str, object]:
        return {"code": self.code, "message": self.message, "param": self.param,
                "line": self.line}


@dataclass(frozen=True)
class CheckedInput:
    """An input file, checked: `faults` empty means the batch can run."""

    model: str | None
    lines: tuple[Line | LineFault, ...]
    faults: tuple[FileFault, ...]

    @property
    def total(self) -> int:
        return len(self.lines)


def check_input(data: bytes, endpoint: str, max_lines: int | None) -> CheckedInput:
    """Check a batch's input file against the batch's `endpoint` (see the module doc);
    `max_lines` None: no limit (re-reading the file of a batch already accepted)."""
    # (line number in the file from 1, blank lines counted; the row)
    rows = [(number, row) for number, row in enumerate(data.split(b"\n"), start=1)
            if row.strip()]
    if not rows:
        return CheckedInput(None, (), (FileFault("empty_file", "the input file has no lines"),))
    if max_lines is not None and len(rows) > max_lines:
        return CheckedInput(None, (), (FileFault(
            "too_many_lines",
            f"the input file has {len(rows)} lines; a batch takes at most {max_lines}"),))
    lines: list[Line | LineFault] = []
    faults: list[FileFault] = []
    seen_ids: set[str] = set()
    models: dict[str, int] = {}
    for index, (number, row) in enumerate(rows):
        checked, url, model = _check_line(index, number, row)
        lines.append(checked)
        # A custom_id names one result, whether the line runs or not.
        if checked.custom_id is not None:
            if checked.custom_id in seen_ids:
                faults.append(FileFault(
                    "duplicate_custom_id", f"the custom_id {checked.custom_id[:80]!r} is "
                    "given twice; each line's must be unique", number, "custom_id"))
            seen_ids.add(checked.custom_id)
        if isinstance(checked, LineFault):
            continue
        if url != endpoint:
            faults.append(FileFault("invalid_url",
                                    f"the line is for {str(url)[:80]!r}; this batch is for "
                                    f"{endpoint}", number, "url"))
        models.setdefault(model, number)
    if len(models) > 1:
        (first, _), (second, line) = list(models.items())[:2]
        faults.append(FileFault("mismatched_model",
                                f"the lines name more than one model ({first[:80]!r}, "
                                f"{second[:80]!r}); a batch runs one model", line, "body.model"))
    return CheckedInput(next(iter(models), None), tuple(lines), tuple(faults[:MAX_FILE_ERRORS]))


def _check_line(index: int, number: int, row: bytes) -> tuple[Line | LineFault, object, str]:
    """The line (`index`: among the file's lines that are not blank; `number`: its line
    in the file, from 1, for the messages), its `url` and its model (meaningful only for
    a Line)."""
    try:
        checked = _checked_line(index, number, row)
    except RecursionError:  # nested too deeply for json to read (or write) it
        checked = LineFault(index, None, "invalid_json_line",
                            f"line {number} is nested too deeply to be read as JSON")
    if isinstance(checked, LineFault):
        return checked, None, ""
    line, request = checked
    return line, request.get("url"), request["body"]["model"]


def _checked_line(index: int, number: int, row: bytes
                  ) -> tuple[Line, dict[str, Any]] | LineFault:
    try:
        request = json.loads(row)
    except ValueError:
        return LineFault(index, None, "invalid_json_line", f"line {number} is not valid JSON")
    if not isinstance(request, dict):
        return LineFault(index, None, "invalid_json_line",
                         f"line {number} is not a JSON object")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return LineFault(index, None, "missing_required_parameter",
                         f"line {number}: 'custom_id' must be a string of 1 to "
                         f"{MAX_CUSTOM_ID_CHARS} characters")
    if request.get("method") != "POST":
        return LineFault(index, custom_id, "invalid_method",
                         f"line {number}: 'method' must be \"POST\"")
    body = request.get("body")
    if not isinstance(body, dict):
        return LineFault(index, custom_id, "missing_required_parameter",
                         f"line {number}: 'body' must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return LineFault(index, custom_id, "missing_required_parameter",
                         f"line {number}: 'body.model' is required")
    if body.get("stream", False) is not False:
        return LineFault(index, custom_id, "invalid_request",
                         f"line {number}: a batch's requests cannot stream ('stream' must "
                         "be false or absent)")
    return Line(index, custom_id, json.dumps(body, separators=(",", ":")).encode()), request
