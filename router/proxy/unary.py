"""A non-streaming request upstream: one attempt's whole answer, for the client at once."""

from __future__ import annotations

import asyncio
import time

from router.config import Timeouts
from router.core.outcome import Attempt
from router.proxy.exchange import Reply
from router.proxy.failures import broken_before_answer, unary_timeout
from router.proxy.send import answer_headers, read_all, refuse_if_failed, send
from router.proxy.targets import Target
from router.proxy.timeouts import Deadline
from router.proxy.upstream.errors import ConnectionBroken
from router.proxy.upstream.pool import UpstreamPool


async def forward_unary(
    pool: UpstreamPool,
    target: Target,
    payload: bytes,
    timeouts: Timeouts,
    response_headers: dict[str, str],
    attempt: Attempt,
) -> Reply:
    """A non-streaming request: the whole answer (with `response_headers`, completed),
    or UpstreamFailure."""
    # The whole wait is the first-byte phase of a non-streaming answer (it comes when
    # generation is done), so passive health may abandon it too (Attempt.abandon): a hung
    # worker is found by its heartbeats, not by total_s.
    deadline = attempt.first_byte_deadline = Deadline(timeouts.total_s, pool.loop)
    try:
        upstream = await send(pool, target, payload, deadline)
        answer = upstream.whole_body() if upstream.status == 200 else None
        if answer is not None:
            upstream.release()
        else:
            attempt.answering = upstream
            attempt.answer_head = (upstream.reads, time.monotonic())
            answer = await refuse_if_failed(upstream)
            if answer is None:
                answer = await read_all(upstream)
    except ConnectionBroken as exc:
        if deadline.expired:
            raise unary_timeout(attempt, timeouts) from None
        raise broken_before_answer(exc) from None
    except asyncio.CancelledError:
        if deadline.timed_out():
            raise unary_timeout(attempt, timeouts) from None
        raise
    finally:
        deadline.cancel()
        attempt.first_byte_deadline = None
        attempt.answering = None
    attempt.first_byte(time.monotonic())
    attempt.status = upstream.status
    return Reply(upstream.status, answer_headers(response_headers, upstream, attempt), answer)
