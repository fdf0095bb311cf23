"""The benchmark's arithmetic: the /proc CPU reader, percentiles, the profile summary."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest

from lab.benchproxy.cpu import (
    CLOCK_TICKS_PER_S,
    descendants,
    parse_stat,
    read_stat,
    tree_cpu_s,
)
from lab.benchproxy.profile import top_functions
from lab.benchproxy.stats import percentile, summarize

# A real /proc/PID/stat line, with a command name holding a space and a parenthesis.
STAT = ("4242 (my proc) x) S 4200 4242 4200 0 -1 4194560 1234 0 0 0 "
        "150 25 7 3 20 0 3 0 100 12345678 900 18446744073709551615 1 1 0 0 0 0 0 4096 "
        "0 0 0 0 17 1 0 0 0 0 0")


def test_parse_stat_counts_fields_after_the_last_parenthesis() -> None:
    stat = parse_stat(STAT)
    assert (stat.pid, stat.ppid) == (4242, 4200)
    assert (stat.utime, stat.stime, stat.cutime, stat.cstime) == (150, 25, 7, 3)
    assert stat.own_ticks == 175 and stat.reaped_children_ticks == 10


def _fake_proc(root: Path, processes: dict[int, tuple[int, int, int]]) -> Path:
    """A /proc with one stat file per pid: {pid: (ppid, utime, stime)}."""
    for pid, (ppid, utime, stime) in processes.items():
        (root / str(pid)).mkdir()
        (root / str(pid) / "stat").write_text(
            f"{pid} (p{pid}) S {ppid} 0 0 0 -1 0 0 0 0 0 {utime} {stime} 0 0 20 0 1 0")
    (root / "self").mkdir()  # not a pid: ignored
    return root


def test_tree_cpu_sums_the_process_and_all_its_descendants(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path, {
        10: (1, 100, 50),  # the router
        11: (10, 10, 5),  # its child
        12: (11, 1, 1),  # a grandchild
        20: (1, 999, 999),  # someone else
    })
    assert tree_cpu_s(10, proc) == pytest.approx((150 + 15 + 2) / CLOCK_TICKS_PER_S)
    assert tree_cpu_s(11, proc) == pytest.approx(17 / CLOCK_TICKS_PER_S)
    assert tree_cpu_s(99, proc) is None


def test_descendants_walks_the_whole_tree() -> None:
    stats = [parse_stat(f"{pid} (x) S {ppid} 0 0 0 0 0 0 0 0 0 0 0 0 0")
             for pid, ppid in ((2, 1), (3, 2), (4, 3), (5, 1))]
    assert sorted(s.pid for s in descendants(2, stats)) == [3, 4]


def test_tree_cpu_of_this_process_grows_with_work() -> None:
    before = tree_cpu_s(os.getpid())
    assert before is not None and read_stat(os.getpid()) is not None
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:
        pass
    after = tree_cpu_s(os.getpid())
    assert after is not None and after >= before


def test_percentile_interpolates_like_numpy_linear() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_p99_of_a_hundred_values_is_near_the_top() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 50) == pytest.approx(50.5)


def test_summarize_sorts_and_reports_the_tail() -> None:
    summary = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert summary["count"] == 5 and summary["mean"] == 3.0
    assert summary["p50"] == 3.0 and summary["max"] == 5.0
    assert math.isnan(summarize([])["p99"])


def test_top_functions_counts_own_time_at_the_leaf() -> None:
    raw = ("Thread 1 (idle);run (loop.py:10);handle (proxy.py:5);write (io.py:1) 30\n"
           "Thread 1 (idle);run (loop.py:10);handle (proxy.py:6) 50\n"
           "Thread 1 (idle);run (loop.py:10);parse (json.py:2) 20\n")
    summary = top_functions(raw)
    assert summary["samples"] == 100
    own = {e["function"]: e["pct"] for e in summary["own"]}
    assert own == {"handle (proxy.py)": 50.0, "write (io.py)": 30.0, "parse (json.py)": 20.0}
    total = {e["function"]: e["pct"] for e in summary["total"]}
    assert total["run (loop.py)"] == 100.0 and total["handle (proxy.py)"] == 80.0


def test_the_heartbeat_bench_publishes_what_an_agent_would() -> None:
    from lab.benchproxy.hbpublish import Template, worker_heartbeat
    from worker.heartbeat_keys import HeartbeatKeys
    from worker.load_records import load_record
    from worker.signing import HeartbeatSigner

    heartbeat = worker_heartbeat(42, 10, 1.0)
    keys = HeartbeatKeys("p")
    signer = HeartbeatSigner("bench", b"a-bench-secret-of-some-length")
    for seq, now_s in ((1, 1_796_000_000.123456), (7, 1_796_000_001.5), (12345, 1e9)):
        beat = heartbeat.model_copy(update={"seq": seq, "sent_at_s": now_s})
        assert Template(heartbeat, keys, signer).payload(seq, now_s) == \
            signer.signed_payload(beat)[1]
        assert Template(heartbeat, keys, None).payload(seq, now_s) == beat.to_json().encode()
        # The load records, as worker.publisher writes them.
        signed = signer.signed_payload(beat)[0]
        assert Template(heartbeat, keys, signer).record(seq, now_s) == \
            signer.signed_record(load_record(signed))
        assert Template(heartbeat, keys, None).record(seq, now_s) == load_record(beat)


def _result(router: str, cpu_us: float, round_: int = 0) -> dict[str, object]:
    return {"round": round_, "workload": "unary", "router": router, "status": "ok",
            "completed": 100, "errors": 0, "requests_per_s": 1000.0,
            "ttft_ms": {"p50": 1.0, "p99": 2.0}, "e2e_ms": {"p50": 1.0, "p99": 2.0},
            "cpu_us_per_request": cpu_us}


def test_ratios_are_to_the_compiled_build_when_it_ran() -> None:
    from lab.benchproxy.report import ratio_base
    from lab.benchproxy.report import summarize as summarize_runs

    both = {"results": [_result("globalpool", 80.0), _result("globalpool-compiled", 50.0),
                        _result("vllm-router", 40.0)]}
    assert ratio_base(both) == "globalpool-compiled"
    ratios = {line["router"]: line["cpu_vs_globalpool"] for line in summarize_runs(both)}
    assert ratios == {"globalpool": 1.6, "globalpool-compiled": 1.0, "vllm-router": 0.8}
    pure_only = {"results": [_result("globalpool", 80.0), _result("vllm-router", 40.0)]}
    assert ratio_base(pure_only) == "globalpool"
    assert {line["router"]: line["cpu_vs_globalpool"] for line in summarize_runs(pure_only)} \
        == {"globalpool": 1.0, "vllm-router": 0.5}
