"""Characters that must not reach an operator's terminal as they are.

Control characters (Unicode category Cc: C0, DEL, C1) can move the cursor, clear the
screen or retitle the window (ESC [2J); bidirectional overrides and isolates (U+202A-202E,
U+2066-2069, the marks U+200E/200F/061C) reorder the rest of the line, so that what an
operator reads is not what is there. The admin API refuses them in what an operator
writes (a drain's reason); `globalpool status` escapes them in whatever it prints, since
worker ids, regions and refused files come from elsewhere.
"""

from __future__ import annotations

import re
from typing import Any

UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def first_unsafe(text: str) -> str | None:
    """The first control or bidi character in `text`, or None."""
    found = UNSAFE.search(text)
    return None if found is None else found.group()


def escape(text: str) -> str:
    """`text` with every control or bidi character written as an escape (\\x1b, \\u202e)."""
    return UNSAFE.sub(lambda found: _escaped(found.group()), text)


def escape_all(value: Any) -> Any:
    """`value` (a JSON document) with `escape` applied to every string, keys included."""
    if isinstance(value, str):
        return escape(value)
    if isinstance(value, dict):
        return {escape_all(key): escape_all(item) for key, item in value.items()}
    if isinstance(value, list):
        return [escape_all(item) for item in value]
    return value


def _escaped(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
