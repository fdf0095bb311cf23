"""The commands as a user mistypes them: a port, a router URL, an interval that is not one
is a usage error naming the argument (exit 2, before anything starts), never a
traceback; a router that takes the connection and says nothing is given up."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT
from tests.integration.test_batches import globalpool

pytestmark = pytest.mark.integration


async def test_a_mistyped_argument_is_a_usage_error_and_a_silent_router_is_given_up(
        ) -> None:
    # A usage error naming the argument (exit 2), never a traceback from the HTTP client.
    for argv in (["up", "--port", "99999"],
                 ["router", "--port", "-1"],
                 ["sim", "--port", "65536"],
                 ["batch", "--router", "notaurl", "list"],
                 ["batch", "list", "--router", "http://127.0.0.1:port"],
                 ["batch", "--timeout", "-1", "list"],
                 ["status", "--router", "ftp://127.0.0.1"],
                 ["status", "--watch", "--interval", "0"]):
        code, _, err = await globalpool(*argv)
        assert code == 2 and "error: argument --" in err and "Traceback" not in err, (argv, err)
    # A router that takes the connection (the kernel's backlog does) and never answers.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        started_s = time.monotonic()
        code, _, err = await globalpool("batch", "--router",
                                        f"http://127.0.0.1:{silent.getsockname()[1]}",
                                        "--timeout", "1", "list")
        assert code == 1 and "no answer within 1 s (--timeout)" in err, err
        assert time.monotonic() - started_s < 15  # the command's start, then 1 s


@pytest.mark.parametrize("command", [["router", "--redis-url", "redis://127.0.0.1:1"], ["up"]])
async def test_a_short_admin_token_stops_the_router_before_it_starts(
        command: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # README's old example, `change-me`, would have let anyone who guessed it drain regions.
    monkeypatch.setenv("GLOBALPOOL_ADMIN_TOKEN", "change-me")
    code, out, err = await globalpool(*command, "--config", str(ROOT / "regions.yaml"))
    assert code == 2, (out, err)
    assert "GLOBALPOOL_ADMIN_TOKEN is 9 characters: a token must have at least 16" in err
    assert "change-me" not in out + err  # (never printed)
    assert "[1/" not in out  # nothing started


def test_more_router_processes_than_cores_are_noted() -> None:
    # On one core (its affinity), two processes: started as asked, with a note why not.
    with subprocess.Popen(
            [sys.executable, "-m", "router.cli", "router", "--config", str(ROOT / "regions.yaml"),
             "--processes", "2", "--port", "0", "--redis-url", "redis://127.0.0.1:1"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}),
    ) as supervisor:
        try:
            assert supervisor.stderr is not None
            first = supervisor.stderr.readline()
        finally:
            supervisor.terminate()
            supervisor.wait(30)
    assert first.startswith("note: 2 router processes on 1 core(s): processes that share"), first
