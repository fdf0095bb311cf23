"""Mid-stream failover on the request path: whether a stream may be continued elsewhere,
ending one that will not be, and continuing one on another worker.

The continuation's own mechanics (what the client has had, the request for the rest, the
rewriting of its events) are `router.proxy.continuation`'s.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable

from router.config import RouterConfig
from router.core.outcome import Attempt, RequestRecord
from router.core.parse import ParsedRequest
from router.proxy.continuation import FAILOVER_HEADER, Failover, Rewriter
from router.proxy.exchange import Exchange, Reply
from router.proxy.failures import StreamBroken
from router.proxy.replies import continuation_timing
from router.proxy.stream import continue_stream, end_broken_stream
from router.proxy.targets import Target
from router.proxy.trace_context import continuation_span
from router.proxy.transcript import event_limit
from router.proxy.upstream.pool import UpstreamPool

log = logging.getLogger("globalpool.proxy")


# What a continuation can carry on: chat's and completions' streams (a Responses stream's
# typed events are not rewritten: it ends as without failover).
_CONTINUED_KINDS = frozenset({"chat", "completions"})


def failover_for(config: RouterConfig, exchange: Exchange, parsed: ParsedRequest,
                 body: bytes, kind: str) -> Failover | None:
    """The failover state of a stream that may be continued elsewhere, else None (not a
    stream, switched off for the model or by the client)."""
    if not parsed.stream or kind not in _CONTINUED_KINDS:
        return None
    settings = config.stream_failover
    if (not settings.enabled or parsed.model in settings.disabled_models
            or exchange.headers.get(FAILOVER_HEADER, "").lower() == "off"):
        return None
    return Failover(body, kind, event_limit(parsed.completion_tokens, parsed.choices))


PROMPT_COUNT_UNKNOWN = "no worker counted the prompt: usage left out"


async def stream_ended(exchange: Exchange, failover: Failover, broken: StreamBroken,
                       record: RequestRecord,
                       count_prompt: Callable[[bytes], Awaitable[int | None]]) -> bool:
    """After a stream broke off: end it here if it cannot or need not be continued (True),
    else False (the caller continues it on another worker). A stream ended here gets its
    usage chunk if its client asked for one and has not had it: the completion tokens
    are those it was sent, the prompt's are counted by a worker (`count_prompt` with a
    `/tokenize` body: None when none could)."""
    if failover.finished():
        record.failover = "finished"  # nothing left to generate: only its end was missing
        prompt_tokens = None
        count_body = failover.count_body()
        if count_body is not None:
            prompt_tokens = await count_prompt(count_body)
            if prompt_tokens is None:
                record.failover_reason = PROMPT_COUNT_UNKNOWN
                log.warning("request %s: stream ended without its usage: %s",
                            record.request_id, PROMPT_COUNT_UNKNOWN)
        await exchange.end_stream(failover.closing_events(prompt_tokens))
        return True
    reason = failover.refusal()
    if reason is None:
        return False
    record.failover, record.failover_reason = "not_continued", reason
    record.error = broken.detail
    log.warning("request %s: stream not continued elsewhere: %s", record.request_id, reason)
    await end_broken_stream(exchange, failover.transcript, broken)
    return True


async def continue_broken_stream(
    exchange: Exchange, upstreams: UpstreamPool, config: RouterConfig, failover: Failover,
    target: Target, headers: dict[str, str], attempt: Attempt, record: RequestRecord,
) -> Reply:
    """Ask `target` for the rest of a broken stream and pass it on (raises
    UpstreamFailure when it does not start, StreamBroken when it breaks off too)."""
    payload = target.request(exchange.path, headers, failover.next_body())
    record.continuations += 1
    with continuation_span(attempt.worker_id, attempt.region):
        await continue_stream(exchange, upstreams, target, payload, config.timeouts, attempt,
                              config.client_timeouts.stall_s, failover.transcript,
                              Rewriter(failover.transcript),
                              functools.partial(continuation_timing, record))
    record.failover = "continued"
    log.info("request %s: stream continued on %s (%s)", record.request_id,
             attempt.worker_id, attempt.region)
    return Reply(200, {}, streamed=True)

