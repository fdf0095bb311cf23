"""What Linux's /proc says about the processes a test started."""

from __future__ import annotations

import contextlib
from pathlib import Path


def children(pid: int) -> list[int]:
    """The direct children of `pid`; [] once it is gone. A thread of it that ends while
    it is read is skipped: its children, if any, go to a sibling thread, and callers that
    wait for a child poll again."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found += [int(child) for child in (task / "children").read_text().split()]
    return found
