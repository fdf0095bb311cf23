"""Where one worker's requests go, and what of the client's request they carry.

A `Target` per worker endpoint (address, path prefix, TLS, the request heads it sends),
and the client's headers that workers see (`upstream_headers`).
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import Mapping
from urllib.parse import urlsplit

from router.proxy.tls import client_context
from router.proxy.trace_context import inject_current_trace
from router.proxy.upstream.request import RequestHead

# Request headers passed to workers. Everything else (Authorization, cookies, hop-by-hop
# headers, Host, Content-Length) stays at the router.
FORWARDED_REQUEST_HEADERS = ("content-type", "accept", "traceparent", "tracestate", "x-request-id")
_FORWARDED = frozenset(FORWARDED_REQUEST_HEADERS)


def upstream_headers(incoming: Mapping[str, str]) -> dict[str, str]:
    """The client's headers that workers see (lower-case names)."""
    if type(incoming) is dict:  # the front's: lower-case names already
        return {name: value for name, value in incoming.items() if name in _FORWARDED}
    headers: dict[str, str] = {}
    for name in FORWARDED_REQUEST_HEADERS:
        value = incoming.get(name)
        if value is not None:
            headers[name] = value
    return headers


def worker_headers(incoming: Mapping[str, str], request_id: str,
                   propagate_trace: bool) -> dict[str, str]:
    """A request's headers as its workers get them (each attempt adds its region's key):
    the client's that pass, the request id, the router's trace context if traced."""
    headers = upstream_headers(incoming)
    headers["x-request-id"] = request_id  # the worker's logs name it too
    if propagate_trace:
        inject_current_trace(headers)  # the worker continues this router's span
    return headers


class Target:
    """Where one worker's requests go: address, path prefix and the request's head."""

    __slots__ = ("_heads", "base_path", "host", "host_header", "port", "ssl")

    def __init__(self, endpoint: str) -> None:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) endpoint: {endpoint!r}")
        secure = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if secure else 80)
        self.host_header = parts.netloc.rpartition("@")[2]
        self.base_path = parts.path.rstrip("/")
        self.ssl: ssl.SSLContext | None = client_context() if secure else None  # one for all
        self._heads: dict[str, RequestHead] = {}  # per path: the request line and Host

    def request(self, path: str, headers: Mapping[str, str], body: bytes) -> bytes:
        """`encode_request("POST", base_path + path, host_header, headers.items(), body)`;
        `headers` have lower-case names (`upstream_headers`)."""
        head = self._heads.get(path)
        if head is None:
            head = self._heads[path] = RequestHead("POST", self.base_path + path,
                                                   self.host_header)
        return head.encode_lower(headers, body)


@functools.lru_cache(maxsize=16384)
def target_of(endpoint: str) -> Target:
    """One `Target` per worker endpoint (parsed once, not per request). Endpoints that left
    the fleet (a restarted pod's old address) age out: ~1.3 KB each, 22 MB at most, and
    room for a 10,000-worker fleet's own."""
    return Target(endpoint)
