"""A batch's input file, checked as OpenAI checks it (router.batch.lines)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, cast

from hypothesis import given
from hypothesis import strategies as st

from router.batch.files import FileStore
from router.batch.jobs import BatchJobs, BatchStats
from router.batch.lines import Line, LineFault, check_input
from router.batch.record import Batch
from router.batch.state import BatchStore
from router.config_reload import ConfigHolder

CHAT = "/v1/chat/completions"


def row(custom_id: Any = "r1", *, url: str = CHAT, method: str = "POST",
        body: Any = None) -> bytes:
    if body is None:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps({"custom_id": custom_id, "method": method, "url": url,
                       "body": body}).encode()


def test_good_lines_run_with_their_bodies_and_the_one_model() -> None:
    checked = check_input(row("a") + b"\n\n" + row("b") + b"\n", CHAT, 10)
    assert checked.faults == ()
    assert checked.model == "m"
    assert [(line.index, line.custom_id) for line in checked.lines
            if isinstance(line, Line)] == [(0, "a"), (1, "b")]
    first = checked.lines[0]
    assert isinstance(first, Line) and json.loads(first.body)["model"] == "m"


def test_a_faulty_line_gets_an_error_and_the_others_run() -> None:
    rows = [row("a"), b"{not json", b"[1, 2]", row(7), row("d", method="GET"),
            row("e", body=[1]), row("f", body={"messages": []}),
            row("g", body={"model": "m", "stream": True}), row("h")]
    checked = check_input(b"\n".join(rows), CHAT, 100)
    assert checked.faults == ()
    faults = {line.index: line.code for line in checked.lines if isinstance(line, LineFault)}
    assert faults == {1: "invalid_json_line", 2: "invalid_json_line",
                      3: "missing_required_parameter", 4: "invalid_method",
                      5: "missing_required_parameter", 6: "missing_required_parameter",
                      7: "invalid_request"}
    assert [line.custom_id for line in checked.lines if isinstance(line, Line)] == ["a", "h"]


def test_faults_of_the_whole_file_fail_the_batch() -> None:
    assert check_input(b"\n \n", CHAT, 10).faults[0].code == "empty_file"
    assert check_input(b"\n".join([row(str(i)) for i in range(4)]), CHAT, 3
                       ).faults[0].code == "too_many_lines"
    twice = check_input(row("a") + b"\n" + row("a"), CHAT, 10).faults
    assert [(f.code, f.line) for f in twice] == [("duplicate_custom_id", 2)]
    elsewhere = check_input(row("a", url="/v1/embeddings"), CHAT, 10).faults
    assert [f.code for f in elsewhere] == ["invalid_url"]
    two_models = check_input(row("a") + b"\n" + row("b", body={"model": "other"}), CHAT, 10)
    assert [(f.code, f.line) for f in two_models.faults] == [("mismatched_model", 2)]


@given(st.lists(st.binary(max_size=200), max_size=30))
def test_any_bytes_are_checked_without_raising(rows: list[bytes]) -> None:
    checked = check_input(b"\n".join(rows), CHAT, 20)
    assert checked.faults or all(isinstance(line, (Line, LineFault)) for line in checked.lines)


def test_faults_name_the_line_of_the_file_blank_lines_counted() -> None:
    checked = check_input(row("a") + b"\n\n \n" + b"{bad" + b"\n" + row("a"), CHAT, 10)
    assert [(f.code, f.line) for f in checked.faults] == [("duplicate_custom_id", 5)]
    fault = checked.lines[1]  # the result's key still counts only the lines not blank
    assert isinstance(fault, LineFault) and fault.index == 1
    assert fault.message == "line 4 is not valid JSON"


def test_a_custom_id_given_twice_fails_the_batch_even_by_a_faulty_line() -> None:
    for rows in ([row("a"), row("a", method="GET")], [row("a", method="GET"), row("a")],
                 [row("a", method="GET"), row("a", body=[1])]):
        faults = check_input(b"\n".join(rows), CHAT, 10).faults
        assert [(f.code, f.line) for f in faults] == [("duplicate_custom_id", 2)], rows


def test_a_line_nested_too_deeply_is_a_faulty_line() -> None:
    deep = b'{"custom_id": "d", "method": "POST", "body": {"model": "m", "x": ' + (
        b"[" * 100_000 + b"]" * 100_000 + b"}}")
    checked = check_input(row("a") + b"\n" + deep, CHAT, 10)
    assert checked.faults == () and checked.model == "m"
    fault = checked.lines[1]
    assert isinstance(fault, LineFault) and fault.code == "invalid_json_line"


async def test_an_accepted_batch_keeps_its_lines_when_max_lines_is_lowered() -> None:
    # A reload lowers batch.max_lines while a batch of 5 lines runs: re-reading its file
    # (another replica, or after the parsed file was dropped) must still give 5 lines.
    data = b"\n".join(row(str(i)) for i in range(5))

    class Files:
        async def read(self, file_id: str) -> bytes:
            return data

    configs = SimpleNamespace(current=SimpleNamespace(batch=SimpleNamespace(max_lines=3)))
    jobs = BatchJobs(cast(BatchStore, None), cast(FileStore, Files()),
                     cast(ConfigHolder, configs), BatchStats(), lambda _: None)
    doc = {"endpoint": CHAT, "input_file_id": "file-x"}
    running = await jobs.input(Batch("batch_run", doc, "in_progress", {"total": "5"}))
    assert running.faults == () and running.total == 5
    new = await jobs.input(Batch("batch_new", doc, "validating", {}))
    assert [f.code for f in new.faults] == ["too_many_lines"]
