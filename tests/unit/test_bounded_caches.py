"""The request path's caches stay bounded however long the router runs and however large
the fleet: the known header-line tables (answers' and requests'), and TLS contexts.

Counted in entries, never timed (benchmarks print the memory: `globalpool bench-memory`).
"""

from __future__ import annotations

import ssl
from email.utils import formatdate

import pytest

from router.proxy import front_head
from router.proxy.front_head import parse_head
from router.proxy.targets import Target, target_of
from router.proxy.tls import client_context
from router.proxy.upstream import response_head

COMMON_ANSWER_LINES = ("server: uvicorn", "content-type: application/json")


def _answer(date_s: int, extra: str = "") -> bytes:
    return (f"HTTP/1.1 200 OK\r\ndate: {formatdate(date_s, usegmt=True)}\r\n"
            f"{COMMON_ANSWER_LINES[0]}\r\n{COMMON_ANSWER_LINES[1]}\r\n{extra}"
            "content-length: 2").encode("latin-1")


@pytest.fixture
def answer_lines(monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[str, str]]:
    table: dict[str, tuple[str, str]] = {}
    monkeypatch.setattr(response_head, "_HEADER_LINES", table)
    return table


@pytest.fixture
def request_lines(monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[str, str]]:
    table: dict[str, tuple[str, str]] = {}
    monkeypatch.setattr(front_head, "_HEADER_LINES", table)
    return table


def test_a_new_date_every_answer_never_freezes_the_answers_table(
        answer_lines: dict[str, tuple[str, str]]) -> None:
    # 3x the table's size in distinct Date lines: more than 3 hours of seconds.
    answers = 3 * response_head.MAX_KNOWN_HEADER_LINES
    largest = emptied = parsed_again = 0
    for second in range(answers):
        parsed_again += not all(line in answer_lines for line in COMMON_ANSWER_LINES)
        before = len(answer_lines)
        status, _, headers = response_head.parse_head(_answer(1_700_000_000 + second))
        assert status == 200 and headers["server"] == "uvicorn"
        emptied += len(answer_lines) < before
        largest = max(largest, len(answer_lines))
    assert largest == response_head.MAX_KNOWN_HEADER_LINES
    # Emptied when full, not frozen: the common lines come back at once after each time.
    assert emptied >= 2 and parsed_again <= emptied + 1


def test_the_date_of_this_second_is_kept(answer_lines: dict[str, tuple[str, str]]) -> None:
    response_head.parse_head(_answer(1_700_000_000))
    assert f"date: {formatdate(1_700_000_000, usegmt=True)}" in answer_lines


def test_answer_lines_with_a_value_new_every_time_are_not_kept(
        answer_lines: dict[str, tuple[str, str]]) -> None:
    for number in range(2000):
        extra = (f"x-request-id: gp-{number:x}\r\n"
                 f"traceparent: 00-{number:032x}-{number:016x}-01\r\n")
        headers = response_head.parse_head(_answer(1_700_000_000, extra))[2]
        assert headers["x-request-id"] == f"gp-{number:x}"
    names = {field[0] for field in answer_lines.values()}
    assert names == {"date", "server", "content-type", "content-length"}


def test_a_table_emptied_when_full_parses_as_before(
        answer_lines: dict[str, tuple[str, str]]) -> None:
    head = _answer(1_700_000_000, "vary: a\r\nvary: b\r\n")
    first = response_head.parse_head(head)
    for number in range(response_head.MAX_KNOWN_HEADER_LINES):  # fills it: the next one empties it
        response_head.parse_head(b"HTTP/1.1 200 OK\r\nx-seq: %d" % number)
    assert len(answer_lines) < response_head.MAX_KNOWN_HEADER_LINES
    assert response_head.parse_head(head) == first == (200, True, {
        "date": formatdate(1_700_000_000, usegmt=True), "server": "uvicorn",
        "content-type": "application/json", "vary": "a, b", "content-length": "2"})


def _request(*lines: str) -> bytes:
    return "\r\n".join(["POST /v1/chat/completions HTTP/1.1", "Host: router:8080",
                        "Content-Type: application/json", *lines]).encode("latin-1")


def test_the_requests_table_stays_bounded_and_useful(
        request_lines: dict[str, tuple[str, str]]) -> None:
    requests = 3 * response_head.MAX_KNOWN_HEADER_LINES
    largest = emptied = parsed_again = 0
    for number in range(requests):
        parsed_again += "Host: router:8080" not in request_lines
        before = len(request_lines)
        parsed = parse_head(_request(
            f"X-Request-Id: client-{number}", f"X-Client-Seq: {number}",
            f"Content-Length: {number % 5000}"))
        assert parsed is not None and parsed[1]["x-client-seq"] == str(number)
        assert parsed[2] == number % 5000
        emptied += len(request_lines) < before
        largest = max(largest, len(request_lines))
    assert largest == response_head.MAX_KNOWN_HEADER_LINES
    assert emptied >= 2 and parsed_again <= emptied + 1
    assert not any(field[0] == "x-request-id" for field in request_lines.values())


def test_every_https_endpoint_shares_one_verifying_context() -> None:
    targets = [Target(f"https://w{n}.example:8443/v1") for n in range(50)]
    contexts = {id(target.ssl) for target in targets}
    assert len(contexts) == 1
    context = targets[0].ssl
    assert context is client_context()
    assert context.verify_mode is ssl.CERT_REQUIRED and context.check_hostname
    assert Target("http://w1.example:8000").ssl is None


def test_targets_of_departed_endpoints_age_out() -> None:
    maxsize = target_of.cache_info().maxsize
    assert maxsize is not None
    for n in range(maxsize + 100):
        target_of(f"http://10.{n // 65536}.{n // 256 % 256}.{n % 256}:8000")
    assert target_of.cache_info().currsize == maxsize
