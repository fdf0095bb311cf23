"""Header lines seen before are looked up, not parsed again: same answers, bounded, and
no credential kept."""

from __future__ import annotations

import pytest

from router.proxy import front_head
from router.proxy.front_head import parse_head
from router.proxy.upstream import response_head
from router.proxy.upstream.errors import MalformedAnswer


def _request(*lines: str) -> bytes:
    return "\r\n".join(["POST /v1/chat/completions HTTP/1.1", *lines]).encode("latin-1")


def test_a_known_line_parses_as_it_did_the_first_time() -> None:
    head = _request("Host: router:8080", "Content-Type:  application/json \t",
                    "X-Request-Id: abc", "Content-Length: 42")
    first = parse_head(head)
    assert "Content-Type:  application/json \t" in front_head._HEADER_LINES
    assert parse_head(head) == first == (
        "/v1/chat/completions",
        {"host": "router:8080", "content-type": "application/json",
         "x-request-id": "abc", "content-length": "42"},
        42, False)


@pytest.mark.parametrize("line", ["Authorization: Bearer sk-secret", "Cookie: a=b",
                                  "X-Api-Key: sk-secret", "Proxy-Authorization: Basic eA=="])
def test_lines_with_credentials_are_not_kept(line: str) -> None:
    parsed = parse_head(_request("Host: r", line))
    assert parsed is not None
    assert line.partition(":")[2].strip() in parsed[1].values()
    assert line not in front_head._HEADER_LINES


def test_repeated_single_headers_are_refused_even_when_known() -> None:
    parse_head(_request("Host: r", "Content-Length: 7"))
    assert parse_head(
        _request("Host: r", "Content-Length: 7", "Content-Length: 7")) is None
    # repeatable ones are joined, as before
    parsed = parse_head(_request("Host: r", "Accept: a", "Accept: a"))
    assert parsed is not None and parsed[1]["accept"] == "a, a"


@pytest.mark.parametrize("line", [" Folded: yes", "NoColon", ": empty name", "Name : v"])
def test_malformed_lines_are_refused_and_not_kept(line: str) -> None:
    assert parse_head(_request("Host: r", line)) is None
    assert line not in front_head._HEADER_LINES


def test_other_request_lines_go_elsewhere() -> None:
    for request_line in ("GET /v1/chat/completions HTTP/1.1", "POST /v1/models HTTP/1.1",
                         "POST /v1/chat/completions HTTP/1.0",
                         "POST  /v1/chat/completions HTTP/1.1"):
        assert parse_head(f"{request_line}\r\nHost: r".encode()) is None


def test_the_table_of_known_lines_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(front_head, "_HEADER_LINES", {})
    monkeypatch.setattr(response_head, "MAX_KNOWN_HEADER_LINES", 3)  # both tables' bound
    long_line = "X-Long: " + "v" * response_head.MAX_KNOWN_LINE_CHARS
    parsed = parse_head(_request("Host: r", long_line))
    assert parsed is not None and parsed[1]["x-long"] == "v" * response_head.MAX_KNOWN_LINE_CHARS
    assert long_line not in front_head._HEADER_LINES  # long lines are parsed, never kept
    for number in range(10):
        parsed = parse_head(_request("Host: r", f"X-Trace: {number}"))
        assert parsed is not None and parsed[1]["x-trace"] == str(number)
    assert len(front_head._HEADER_LINES) <= 3  # emptied when full (test_bounded_caches)


def test_an_answers_known_lines_parse_as_before_and_cookies_are_not_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(response_head, "_HEADER_LINES", {})
    head = (b"HTTP/1.1 200 OK\r\nServer: uvicorn\r\nSet-Cookie: s=1\r\n"
            b"Content-Type: text/plain\r\nVary: a\r\nVary: b")
    expected = (200, True, {"server": "uvicorn", "set-cookie": "s=1",
                            "content-type": "text/plain", "vary": "a, b"})
    assert response_head.parse_head(head) == expected
    assert response_head.parse_head(head) == expected
    assert "Server: uvicorn" in response_head._HEADER_LINES
    assert "Set-Cookie: s=1" not in response_head._HEADER_LINES
    with pytest.raises(MalformedAnswer):
        response_head.parse_head(b"HTTP/1.1 200 OK\r\nBad Name: x")
    assert "Bad Name: x" not in response_head._HEADER_LINES
