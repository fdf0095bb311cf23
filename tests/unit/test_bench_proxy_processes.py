"""bench-proxy with several router processes: the CPU of a process tree (real processes),
stopping a tree whose root will not stop, wrk's output, the throughput summary."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab.benchproxy import procs
from lab.benchproxy.cpu import (
    CLOCK_TICKS_PER_S,
    cpu_by_process,
    live_descendants,
    read_stat,
    start_ticks,
    tree_cpu_s,
)
from lab.benchproxy.routers import processes_answered
from lab.benchproxy.throughput import MARK, parse_wrk, summarize, wrk_script

# A parent (a supervisor's stand-in) that starts a child which burns ~0.4 s of CPU and
# then sleeps; the parent itself only waits. The parent prints the child's PID when the
# child has burnt its CPU.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
import sys, time
end = time.process_time() + 0.4
while time.process_time() < end:
    pass
print("burnt", flush=True)
time.sleep(60)
'''], stdout=subprocess.PIPE)
child.stdout.readline()
print(child.pid, flush=True)
%(then)s
time.sleep(60)
"""


def _start_parent(tmp_path: Path, then: str = "") -> tuple[subprocess.Popen[bytes], int]:
    process = procs.start([sys.executable, "-c", PARENT % {"then": then}], cores=None,
                          log_path=tmp_path / "parent.log", stdout_pipe=True)
    assert process.stdout is not None
    child = int(process.stdout.readline())
    return process, child


def _gone(pid: int) -> bool:
    """Dead (gone, or a zombie nobody reaped yet), within 5 s: a SIGKILL takes a moment."""
    deadline = time.monotonic() + 5
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def test_a_parent_is_charged_with_its_child_processes_cpu(tmp_path: Path) -> None:
    """What a `--processes 2` supervisor is charged: its own CPU and its children's."""
    process, child = _start_parent(tmp_path)
    try:
        parent_own = read_stat(process.pid)
        assert parent_own is not None
        whole = tree_cpu_s(process.pid)
        by_process = cpu_by_process(process.pid)
        assert whole is not None
        assert set(by_process) == {process.pid, child}
        assert by_process[child] >= 0.3  # the child's burnt CPU (clock ticks: 10 ms)
        assert whole == pytest.approx(sum(by_process.values()))
        assert whole >= by_process[child] + parent_own.own_ticks / CLOCK_TICKS_PER_S - 0.02
        assert [pid for pid, _ in live_descendants(process.pid)] == [child]
        # a process that is not one's parent is not charged with it
        child_alone = tree_cpu_s(child)
        assert child_alone is not None and child_alone < whole
    finally:
        procs.stop_tree(process, timeout_s=5)
    assert _gone(child) and cpu_by_process(process.pid) == {}


def test_stop_tree_kills_the_children_a_root_killed_late_leaves_behind(
        tmp_path: Path) -> None:
    """A root that ignores SIGTERM is killed after the timeout; its child, left to init,
    is killed too (only that PID, checked by its start time)."""
    process, child = _start_parent(
        tmp_path, then="import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    started = start_ticks(child)
    assert started is not None
    time.sleep(0.1)  # the parent's handler is in place once it reads its child's line
    procs.stop_tree(process, timeout_s=0.5)
    assert process.returncode == -signal.SIGKILL
    assert _gone(child)


def test_stop_tree_of_a_single_process_is_stop(tmp_path: Path) -> None:
    process = procs.start([sys.executable, "-c", "import time; time.sleep(60)"], cores=None,
                          log_path=tmp_path / "one.log")
    procs.stop_tree(process, timeout_s=5)
    assert process.returncode == -signal.SIGTERM
    assert start_ticks(os.getpid()) is not None and start_ticks(process.pid) is None


WRK_OUTPUT = f"""Running 10s test @ http://127.0.0.1:4242/v1/chat/completions
  1 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     2.31ms  512.10us  14.02ms   88.20%
    Req/Sec    13.90k   401.22    14.50k    71.00%
  138290 requests in 10.00s, 79.41MB read
  Non-2xx or 3xx responses: 10
Requests/sec:  13826.55
Transfer/sec:      7.94MB
{MARK}{{"requests":138290,"duration_us":10001837,"bytes":83268345,"errors":{{"connect":0,\
"read":0,"write":0,"status":10,"timeout":2}},"latency_us":{{"p50":2250,"p90":2801,\
"p99":3987,"max":14020,"mean":2310.4}}}}
"""


def test_parse_wrk_reads_the_done_line_and_wrk_s_own_rate() -> None:
    result = parse_wrk(WRK_OUTPUT)
    assert result.requests == 138290 and result.ok == 138280
    assert result.duration_s == pytest.approx(10.001837)
    assert result.requests_per_s == pytest.approx(138280 / 10.001837)
    assert result.requests_per_s_printed == pytest.approx(13826.55)
    assert result.latency_ms == {"p50": 2.25, "p90": 2.801, "p99": 3.987, "max": 14.02,
                                 "mean": pytest.approx(2.3104)}
    assert result.failed == 12


def test_parse_wrk_without_the_done_line_says_so() -> None:
    with pytest.raises(ValueError, match="GPBENCH-WRK"):
        parse_wrk("unable to connect to 127.0.0.1:1 Connection refused\n")


def test_the_wrk_script_posts_the_body_as_it_is() -> None:
    body = b'{"model":"bench","messages":[{"role":"user","content":"a \\"b\\" [[c]]"}]}'
    script = wrk_script(body)
    assert f"wrk.body = [==[{body.decode()}]==]" in script
    assert 'wrk.method = "POST"' in script and MARK in script
    with pytest.raises(ValueError):
        wrk_script(b'{"x":"]==]"}')


def _row(round_number: int, processes: int, pinned: bool, rps: float,
         cpu: float | None) -> dict[str, object]:
    return {"round": round_number, "variant": f"{processes}p-{pinned}", "processes": processes,
            "pinned": pinned, "status": "ok", "requests_per_s": rps,
            "latency_ms": {"p50": 1.0, "p99": 2.0}, "cpu_us_per_request": cpu,
            "router_cores_used": 1.0, "backends_cores_used": 0.3, "wrk_cores_used": 0.2,
            "errors": {"status": 0}, "cores_used_by_process": [0.0, 0.5, 0.5]}


def test_throughput_ratios_are_taken_within_a_round_and_placement() -> None:
    rows = [
        _row(1, 1, False, 1000.0, 70.0), _row(1, 2, False, 1500.0, 77.0),
        _row(1, 1, True, 900.0, 60.0), _row(1, 2, True, 900.0, 66.0),
        _row(2, 1, False, 2000.0, 80.0), _row(2, 2, False, 2200.0, 80.0),
        {"round": 2, "variant": "2p-True", "processes": 2, "pinned": True,
         "status": "failed", "reason": "wrk exited 1"},
    ]
    lines = {line["variant"]: line for line in summarize(rows)}
    unpinned = lines["2p-False"]
    assert unpinned["requests_per_s_vs_1p"] == pytest.approx((1.5 + 1.1) / 2)
    assert unpinned["cpu_vs_1p"] == pytest.approx((1.1 + 1.0) / 2)
    assert unpinned["requests_per_s"] == pytest.approx(1850.0)
    assert lines["2p-True"]["rounds"] == 1
    assert lines["2p-True"]["cpu_vs_1p"] == pytest.approx(1.1)
    assert lines["1p-False"]["requests_per_s_vs_1p"] is None


def test_processes_answered_reads_the_merged_metrics_gauge() -> None:
    text = ('# TYPE globalpool_router_processes gauge\n'
            'globalpool_router_processes{state="configured"} 2.0\n'
            'globalpool_router_processes{state="answered"} 1.0\n')
    assert processes_answered(text) == 1
    assert processes_answered(text.replace("} 1.0", "} 2.0")) == 2
    assert processes_answered("globalpool_requests_total 3.0\n") is None
