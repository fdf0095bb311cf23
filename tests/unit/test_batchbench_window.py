"""The window a batch ran in, as bench-batch reads it from its looks every second
(lab.batchbench.analysis.ran_window): a small batch can run wholly between two looks."""

from __future__ import annotations

from lab.batchbench.analysis import ran_window, throughput
from lab.batchbench.phase import BatchOutcome, PhaseRecord
from lab.batchbench.probe import Sample

TOTAL = 40


def record(*looks: tuple[float, str | None, int]) -> PhaseRecord:
    """A phase whose probe saw (time, the batch's status, lines done) at each look."""
    found = PhaseRecord("with_batch", t0_s=0.0)
    found.samples = [Sample(t_s, status=status, completed=done, failed=0, total=TOTAL)
                     for t_s, status, done in looks]
    found.batch = BatchOutcome("batch_1", "completed", created_s=0.5, ended_s=looks[-1][0],
                               request_counts={"total": TOTAL, "completed": TOTAL,
                                               "failed": 0})
    return found


def test_a_batch_seen_running_is_timed_from_its_first_look_running() -> None:
    phase = record((1.0, "validating", 0), (2.0, "in_progress", 10), (3.0, "in_progress", 30),
                   (4.0, "completed", TOTAL))
    assert ran_window(phase) == (2.0, 4.0)
    assert throughput(phase)["ran_lines_per_s"] == 20.0


def test_a_batch_that_ran_between_two_looks_is_timed_from_the_look_before() -> None:
    """Its first look past validating already saw every line done (CI once failed on
    ran_lines_per_s None for 40 lines on a fast moment of the machine)."""
    phase = record((1.0, "validating", 0), (2.0, "completed", TOTAL))
    assert ran_window(phase) == (1.0, 2.0)
    assert throughput(phase)["ran_lines_per_s"] == 40.0  # a lower bound


def test_a_batch_never_seen_running_or_done_has_no_window() -> None:
    assert ran_window(record((1.0, "validating", 0), (2.0, "validating", 0))) is None
    assert ran_window(record((1.0, "completed", TOTAL))) is None  # no look before it
