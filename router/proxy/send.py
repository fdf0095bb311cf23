"""Sending one attempt upstream: the request out, the answer's head back.

Nothing reaches the client before the upstream's first body chunk, so any failure up to
then raises `UpstreamFailure` and the caller may retry elsewhere; that includes a refusal
worth a retry (`refuse_if_failed`). A pooled connection that the worker had closed is
sent again at once on a new one.
"""

from __future__ import annotations

from router.core.outcome import Attempt, Failure
from router.proxy.failures import (
    UpstreamFailure,
    client_error_body,
    retry_after,
    retryable,
    worker_refusal,
)
from router.proxy.targets import Target
from router.proxy.timeouts import Deadline
from router.proxy.upstream.connection import UpstreamConnection
from router.proxy.upstream.errors import ConnectFailed, ConnectionBroken
from router.proxy.upstream.pool import UpstreamPool

# Sends repeated at once when the connection breaks before any answer (usually a pooled
# connection the worker closed while it sat idle: nothing of the request was processed).
STALE_CONNECTION_RETRIES = 2


async def send(pool: UpstreamPool, target: Target, payload: bytes,
               deadline: Deadline, attempt: Attempt | None = None) -> UpstreamConnection:
    """Send the request and wait for the answer's head (status and headers). `attempt`:
    told while a new connection is being opened, and how long that took (`connect_s`)."""
    for tries_left in range(STALE_CONNECTION_RETRIES, -1, -1):
        try:
            upstream = pool.send_idle(target.host, target.port, payload)
            if upstream is None:
                # A new connection: its handshakes are a one-off wait, which passive
                # health does not take for the path's (Attempt.connect_s).
                loop = pool.loop
                connecting_s = loop.time()
                if attempt is not None:
                    attempt.connecting = True
                try:
                    upstream = await pool.send(target.host, target.port, payload,
                                               ssl=target.ssl)
                finally:
                    if attempt is not None:
                        attempt.connecting = False
                        attempt.connect_s += loop.time() - connecting_s
        except ConnectFailed as exc:
            raise UpstreamFailure("could not connect to the worker", Failure.CONNECT,
                                  detail=f"cannot connect to worker: {exc}") from None
        deadline.upstream = upstream
        try:
            await upstream.head()
        except ConnectionBroken as broken:  # (not `exc`: the compiled build types a name once)
            upstream.close()
            if not broken.received_any and tries_left and not deadline.expired:
                # Broken before any answer: most likely a pooled connection the worker
                # had closed (stale), else a worker that just died or restarted. Sent
                # again on a new connection: a dead worker then refuses it, which is a
                # path failure (a free retry elsewhere), not a reset.
                deadline.upstream = None
                continue
            raise
        except BaseException:
            upstream.close()  # cancelled: the engine stops working on it
            raise
        return upstream
    raise AssertionError("unreachable")


async def refuse_if_failed(upstream: UpstreamConnection) -> bytes | None:
    """Read a non-200 answer: raise UpstreamFailure if it is worth a retry, else return it
    as the client gets it (an error in OpenAI's format: `client_error_body`)."""
    if upstream.status == 200:
        return None
    body = await read_all(upstream)
    status = upstream.status
    kind = retryable(status)
    if kind is not None:
        raise UpstreamFailure(
            f"the worker answered {status}", kind, status=status,
            retry_after_s=retry_after(upstream.headers),
            detail=f"worker answered {status}: {body[:200].decode(errors='replace')}",
        )
    if status >= 400:
        refused = worker_refusal(status, body)
        if refused is not None:
            raise refused  # another worker may take it
        upstream.headers["content-type"] = "application/json"
        return client_error_body(status, body)
    return body


async def read_all(upstream: UpstreamConnection) -> bytes:
    try:
        body = await upstream.read_all()
    except BaseException:
        upstream.close()
        raise
    upstream.release()
    return body


def answer_headers(
    headers: dict[str, str], upstream: UpstreamConnection, attempt: Attempt
) -> dict[str, str]:
    """`headers` (ours) completed in place for the client: the upstream's content type,
    and the upstream's TTFB added to `server-timing`."""
    headers["Content-Type"] = upstream.headers.get("content-type", "application/json")
    ttfb_s = attempt.ttfb_s
    if ttfb_s is not None:
        timing = headers.get("server-timing")
        upstream_timing = f"upstream;dur={ttfb_s * 1000:.3f}"
        headers["server-timing"] = f"{timing}, {upstream_timing}" if timing else upstream_timing
    return headers
