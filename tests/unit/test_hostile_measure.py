"""The hostile drill's judgement: body framing, what an answer holds, detection, router 5xx,
goals; and how `globalpool drill hostile` is told from the other drills."""

from __future__ import annotations

import json
import math

import pytest

from lab.drill.cli import hostile_argv
from lab.drill.hostile.behaviours import BEHAVIOURS
from lab.drill.hostile.clients import ClientSettings, Outcome, RequestPlan
from lab.drill.hostile.http import AnswerReader, BodyDecoder, MalformedAnswer, parse_head
from lab.drill.hostile.measure import (
    detection,
    ejection_windows,
    goals_missed,
    is_lost,
    is_router_5xx,
)

CHUNKED = parse_head(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked")


def test_chunked_body_decodes_whatever_the_pieces() -> None:
    raw = b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nTrailer: x\r\n\r\nEXTRA"
    for size in (1, 2, 7, len(raw)):
        decoder = BodyDecoder(CHUNKED)
        body = b"".join(decoder.feed(raw[i:i + size]) for i in range(0, len(raw), size))
        assert body == b"hello, world" and decoder.done and decoder.extra_bytes == 5


def test_content_length_body_counts_what_comes_past_its_end() -> None:
    decoder = BodyDecoder(parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 4"))
    assert decoder.feed(b"ab") == b"ab" and not decoder.done
    assert decoder.feed(b"cdEF") == b"cd" and decoder.done and decoder.extra_bytes == 2


def test_body_until_close_is_never_done_by_itself() -> None:
    decoder = BodyDecoder(parse_head(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain"))
    assert decoder.until_close and decoder.feed(b"abc") == b"abc" and not decoder.done


@pytest.mark.parametrize("raw", [b"zz\r\nab", b"2\r\nabXY", b"9" * 5000])
def test_broken_chunking_is_malformed(raw: bytes) -> None:
    with pytest.raises(MalformedAnswer):
        BodyDecoder(CHUNKED).feed(raw)


@pytest.mark.parametrize("head", [b"SSH-2.0-x", b"HTTP/1.1 abc OK", b"HTTP/1.1 200 OK\r\nnocolon"])
def test_a_head_that_is_not_http_is_malformed(head: bytes) -> None:
    with pytest.raises(MalformedAnswer):
        parse_head(head)


def _sse(*payloads: str) -> bytes:
    return b"".join(f"data: {p}\n\n".encode() for p in payloads)


def test_stream_events_count_up_to_done_and_errors_after_it_are_apart() -> None:
    error = json.dumps({"error": {"type": "upstream_error", "code": "upstream_failed"}})
    answer = AnswerReader(stream=True)
    raw = _sse('{"choices":[]}', '{"choices":[]}', "[DONE]", error, "[DONE]")
    for i in range(0, len(raw), 7):
        answer.add(raw[i:i + 7])
    assert (answer.events, answer.done, answer.error, answer.error_after_done) == (
        2, True, None, True)


def test_stream_error_event_gives_its_status() -> None:
    answer = AnswerReader(stream=True)
    answer.add(_sse('{"choices":[]}', json.dumps(
        {"error": {"type": "upstream_timeout_error", "code": "upstream_failed"}})))
    assert answer.error_status == 504 and not answer.done
    vllm = AnswerReader(stream=True)
    vllm.add(_sse(json.dumps({"error": {"type": "ServiceUnavailableError", "code": 503}})))
    assert vllm.error_status == 503


def test_json_answer_or_error() -> None:
    answer = AnswerReader(stream=False)
    answer.add(b'{"choices": [{"text": "hi"}]}')
    answer.finish()
    assert answer.answer_ok and answer.error is None
    error = AnswerReader(stream=False)
    error.add(b'{"error": {"type": "server_error", "code": "internal_error"}}')
    error.finish()
    assert not error.answer_ok and error.error_status == 500


def _outcome(status: int | None, *, stream: bool = False, body: bytes = b"",
             expects: str = "answer", got: bool = False) -> Outcome:
    outcome = Outcome("normal", expects, RequestPlan(0, stream, "/v1/completions"),  # type: ignore[arg-type]
                      started_unix_s=0.0, status=status, got_expected=got)
    outcome.answer = AnswerReader(stream=stream)
    outcome.answer.add(body)
    outcome.answer.finish()
    return outcome


@pytest.mark.parametrize(("status", "stream", "body", "router_caused"), [
    (500, False, b'{"error": {"type": "server_error", "code": "internal_error"}}', True),
    (500, False, b"Internal Server Error", True),
    (502, False, b'{"error": {"type": "upstream_error", "code": "upstream_failed"}}', False),
    (503, False, b'{"error": {"type": "service_unavailable_error", "code": "no_capacity"}}',
     False),
    (502, False, b"<html>bad gateway</html>", True),  # no OpenAI error: not the pool's
    (200, True, _sse(json.dumps({"error": {"type": "upstream_timeout_error",
                                           "code": "upstream_failed"}})), False),
    (200, True, _sse(json.dumps({"error": {"type": "server_error",
                                           "code": "internal_error"}})), True),
    (413, False, b'{"error": {"type": "invalid_request_error", "code": null}}', False),
    (None, False, b"", False),
])
def test_router_5xx_are_the_routers_own(status: int | None, stream: bool, body: bytes,
                                        router_caused: bool) -> None:
    assert is_router_5xx(_outcome(status, stream=stream, body=body)) is router_caused


def test_only_requests_that_wait_for_something_can_be_lost() -> None:
    assert is_lost(_outcome(502))
    assert not is_lost(_outcome(200, got=True))
    assert not is_lost(_outcome(None, expects="nothing"))
    assert not is_lost(_outcome(None, expects="refusal"))  # counted as a refusal missed


def _event(at: float, kind: str, worker: str = "lab-4") -> dict[str, object]:
    return {"at_unix_s": at, "kind": kind, "subject": f"worker {worker} (lab)", "detail": ""}


def test_ejection_windows_run_from_ejection_to_readmission() -> None:
    events = [_event(5.0, "ejected"), _event(2.0, "ejected"), _event(3.0, "readmitted"),
              _event(4.0, "ejected", "lab-1"), _event(6.0, "ejected")]
    assert ejection_windows(events, "lab-4") == [(2.0, 3.0), (5.0, math.inf)]


def test_detection_is_the_last_send_that_is_not_a_probe() -> None:
    windows = [(102.0, math.inf)]
    found = detection([100.2, 101.0, 101.9, 102.01, 103.5, 105.2], 100.0, 106.0, windows)
    # 102.01 arrived within the slack of the ejection: sent before it, not a probe.
    assert found == {"detect_s": 2.01, "first_send_s": 0.2, "sent_to_bad": 6, "probes": 2}


def test_detection_is_null_while_sending_goes_on_and_zero_without_sends() -> None:
    assert detection([100.5, 105.5], 100.0, 106.0, [])["detect_s"] is None
    assert detection([99.0, 106.5], 100.0, 106.0, [])["detect_s"] == 0.0  # outside the load


def _cell(**changes: object) -> dict[str, object]:
    cell: dict[str, object] = {"lost": 0, "refusals_missed": 0, "healthy_ejected": 0,
                               "router_5xx": 0, "detect_s": 1.0, "rss_mb_before": 60.0,
                               "rss_mb_after": 70.0}
    return cell | changes


def test_goals_missed_name_each_goal() -> None:
    assert goals_missed(_cell()) == []
    assert goals_missed(_cell(lost=2, detect_s=None)) == ["lost", "detect_s"]
    assert goals_missed(_cell(detect_s=5.5, rss_mb_after=130.0, router_5xx=1)) == [
        "detect_s", "router_5xx", "rss"]


@pytest.mark.parametrize(("argv", "expected"), [
    (["drill", "hostile", "--out", "d"], ["--out", "d"]),
    (["--log-level", "DEBUG", "drill", "hostile", "--quick"], ["--quick", "--log-level", "DEBUG"]),
    (["--log-level=INFO", "drill", "hostile"], ["--log-level=INFO"]),
    (["drill", "kill-region", "--out", "d"], None),
    (["up"], None),
    ([], None),
])
def test_hostile_is_dispatched_before_the_scenarios(argv: list[str],
                                                    expected: list[str] | None) -> None:
    assert hostile_argv(argv) == expected


@pytest.mark.parametrize(("behaviour", "status", "stream", "body", "complete", "got"), [
    ("normal", 200, True, _sse('{"choices":[]}', "[DONE]"), True, True),
    ("normal", 200, True, _sse('{"choices":[]}'), False, False),  # no [DONE]: broke off
    ("normal", 200, False, b'{"choices": []}', True, True),
    ("normal", 502, False, b'{"error": {}}', True, False),
    ("reads_then_stalls", 200, True, _sse(*['{"choices":[]}'] * 3), False, True),
    ("reads_then_stalls", 200, True, _sse('{"choices":[]}', json.dumps(
        {"error": {"type": "upstream_error"}})), False, False),
    ("reads_then_stalls", 200, False, None, False, True),  # a whole answer: the head only
    ("disconnects_after_headers", 200, False, None, False, True),
    ("disconnects_after_headers", 504, False, None, False, False),
    ("disconnects_before_headers", None, False, None, False, True),
    ("big_body", 413, False, None, False, True),
    ("big_body", None, False, None, False, False),
])
def test_each_behaviour_judges_what_it_waited_for(behaviour: str, status: int | None,
                                                  stream: bool, body: bytes | None,
                                                  complete: bool, got: bool) -> None:
    kind = BEHAVIOURS[behaviour](ClientSettings())
    outcome = Outcome(behaviour, kind.expects, RequestPlan(0, stream, "/v1/completions"),
                      started_unix_s=0.0, status=status, complete=complete)
    if body is not None:
        outcome.answer = AnswerReader(stream=stream)
        outcome.answer.add(body)
        outcome.answer.finish()
    assert kind.judge(outcome) is got
