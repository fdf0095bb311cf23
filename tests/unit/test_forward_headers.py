"""What of the client's request head reaches a worker, from either server's headers."""

from __future__ import annotations

from multidict import CIMultiDict, CIMultiDictProxy

from router.proxy.front_head import parse_head
from router.proxy.targets import FORWARDED_REQUEST_HEADERS, target_of, upstream_headers

HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: router:8080\r\n"
        b"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        b"Authorization: Bearer client-key\r\nCookie: a=b\r\nTraceparent: 00-ab-cd-01\r\n"
        b"X-Request-Id: r-1\r\nUser-Agent: test\r\nContent-Length: 2")
EXPECTED = {"content-type": "application/json", "accept": "text/event-stream",
            "traceparent": "00-ab-cd-01", "x-request-id": "r-1"}


def test_the_fronts_headers_and_aiohttps_forward_the_same() -> None:
    parsed = parse_head(HEAD)
    assert parsed is not None
    from_front = upstream_headers(parsed[1])
    raw: CIMultiDict[str] = CIMultiDict(
        line.partition(": ")[::2] for line in HEAD.decode().split("\r\n")[1:])
    from_aiohttp = upstream_headers(CIMultiDictProxy(raw))
    assert from_front == from_aiohttp == EXPECTED
    assert set(EXPECTED) <= set(FORWARDED_REQUEST_HEADERS)


def test_the_request_a_worker_gets_carries_no_credential_of_the_client() -> None:
    parsed = parse_head(HEAD)
    assert parsed is not None
    payload = target_of("http://10.0.0.1:8000/base").request(
        "/v1/chat/completions", upstream_headers(parsed[1]), b"{}")
    head, _, body = payload.partition(b"\r\n\r\n")
    assert body == b"{}"
    lines = head.decode().split("\r\n")
    assert lines[:2] == ["POST /base/v1/chat/completions HTTP/1.1", "Host: 10.0.0.1:8000"]
    assert sorted(lines[2:]) == sorted([*(f"{k}: {v}" for k, v in EXPECTED.items()),
                                        "Content-Length: 2"])
