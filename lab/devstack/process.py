"""Child processes of the local stack: started with a known PID, never left behind."""

from __future__ import annotations

import ctypes
import ctypes.util
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: the kernel sends SIGTERM to the child if its parent dies (Linux only).

    `globalpool up` stops its children in order on Ctrl-C or SIGTERM; this covers the
    case where `up` itself is killed with SIGKILL and cannot.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
