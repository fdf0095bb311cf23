"""A prompt's token count, as a worker's engine makes it: for the usage chunk of a stream
the router ends itself (router.proxy.stream_failover), whose worker failed before sending
one. vLLM's `/tokenize` applies the chat template (or the completion's special tokens) as
the request's own endpoint does, and answers at once, without its engine."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping

from router.proxy.failures import UpstreamFailure
from router.proxy.send import read_all, send
from router.proxy.targets import Target
from router.proxy.timeouts import Deadline
from router.proxy.upstream.errors import UpstreamError
from router.proxy.upstream.pool import UpstreamPool

log = logging.getLogger("globalpool.proxy")

PROMPT_COUNT_TIMEOUT_S = 5.0  # the longest wait for a count
MAX_PROMPT_COUNT = 10_000_000  # a count above this is a worker's lie


async def prompt_count(upstreams: UpstreamPool, target: Target, headers: Mapping[str, str],
                       body: bytes) -> int | None:
    """`target`'s count of a prompt's tokens (`body`: `Failover.count_body`), from vLLM's
    `/tokenize`; None when it does not answer one within PROMPT_COUNT_TIMEOUT_S."""
    try:
        async with asyncio.timeout(PROMPT_COUNT_TIMEOUT_S):
            return await _ask_count(upstreams, target, headers, body)
    except (TimeoutError, UpstreamFailure, UpstreamError, ValueError, RecursionError) as exc:
        log.warning("the prompt's tokens were not counted: %s", type(exc).__name__)
        return None


async def _ask_count(upstreams: UpstreamPool, target: Target, headers: Mapping[str, str],
                     body: bytes) -> int | None:
    deadline = Deadline(PROMPT_COUNT_TIMEOUT_S, upstreams.loop)
    try:
        payload = target.request("/tokenize", {**headers, "content-type": "application/json"},
                                 body)
        upstream = await send(upstreams, target, payload, deadline)
    finally:
        deadline.cancel()
    if upstream.status != 200:
        upstream.close()
        return None
    answer = json.loads(await read_all(upstream))
    count = answer.get("count") if isinstance(answer, dict) else None
    return count if type(count) is int and 0 <= count <= MAX_PROMPT_COUNT else None
