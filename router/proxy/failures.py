"""How an attempt's failures are told: `UpstreamFailure`, and what a worker's refusal means.

A worker's refusal (a status, a first event that is an error) is either worth a retry
elsewhere (`retryable`: busy, or a server error) or passed to the client in OpenAI's
error format (`client_error_body`). A wait that ran out, or a connection that broke
before the answer, is a failure worth a retry too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from http import HTTPStatus

from router.config import Timeouts
from router.core.errors import error_body
from router.core.outcome import Attempt, Failure
from router.proxy.progress import error_status
from router.proxy.upstream.errors import ConnectionBroken


class UpstreamFailure(Exception):
    """An attempt failed before anything reached the client; safe to retry elsewhere.

    `message` may be shown to the client: it names no address and quotes nothing the
    worker sent. `detail` (for logs and traces) adds what the worker or the socket said.
    `attempt`: the attempt that failed, when it is not the one the caller sent (a hedged
    stream's copy that answered, router.proxy.hedging).
    """

    def __init__(
        self,
        message: str,
        kind: Failure,
        *,
        status: int = 502,
        retry_after_s: float | None = None,
        detail: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.status = status
        self.retry_after_s = retry_after_s
        self.detail = detail if detail is not None else message
        self.attempt: Attempt | None = None


class WorkerRefusal(UpstreamFailure):
    """A worker refused the request for a reason of its own that another worker may not
    share (a 4xx): retried on one that may take it, at no cost (no work was done). `answer`
    is the refusal as the client gets it (`client_error_body`) when none can."""

    def __init__(self, message: str, kind: Failure, status: int, answer: bytes,
                 detail: str) -> None:
        super().__init__(message, kind, status=status, detail=detail)
        self.answer = answer


class TooLong(WorkerRefusal):
    """The worker refused the request as longer than its context of `context` tokens
    (a 400): a worker with a longer one may take it."""

    def __init__(self, context: int, answer: bytes, detail: str) -> None:
        super().__init__(f"the request is longer than the worker's context ({context} "
                         "tokens)", Failure.TOO_LONG, 400, answer, detail)
        self.context = context


# How vLLM names the context it refused a request for (0.32: the renderer's prompt checks,
# the engine's, `max_tokens` above it, the Responses API; earlier releases' wording is the
# first): the number is the worker's `max_model_len`.
_CONTEXT_REFUSALS = re.compile(
    rb"maximum context length is (\d{1,10}) tokens"
    rb"|maximum model length of (\d{1,10})"
    rb"|(?:greater than|exceeds the) max_model_len[= ](\d{1,10})")


# vLLM's 404 for a model it does not serve (vllm/entrypoints/serve/engine/serving.py).
_NOT_SERVED = re.compile(rb"The model `[^`]{0,1024}` does not exist")


def worker_refusal(status: int, body: bytes) -> WorkerRefusal | None:
    """A worker's 4xx as a WorkerRefusal that another worker may not share: a 400 that
    names the context the request was too long for (TooLong), a 404 saying the model
    does not exist there (its heartbeat lists it: the heartbeat is behind). None for any
    other answer, which is the client's own."""
    if status == 400:
        found = _CONTEXT_REFUSALS.search(body[:4096])
        if found is None:
            return None
        context = int(next(group for group in found.groups() if group is not None))
        return TooLong(context, client_error_body(400, body),
                       f"worker answered 400, too long for its context of {context} "
                       f"tokens: {body[:200].decode(errors='replace')}")
    if status == 404 and _NOT_SERVED.search(body[:2048]) is not None:
        return WorkerRefusal("the worker does not serve the model now", Failure.NOT_SERVED,
                             404, client_error_body(404, body),
                             f"worker answered 404: {body[:200].decode(errors='replace')}")
    return None


class StreamBroken(UpstreamFailure):
    """A started stream broke off (its client has had some of it): the caller may
    continue it on another worker (`router.proxy.continuation`) or end it with
    `router.proxy.stream.end_broken_stream`. `status` and `message` are the error event's."""


def retryable(status: int) -> Failure | None:
    """What a worker's refusal with `status` counts as, if it is worth a retry elsewhere:
    429/503 "engine busy" (BUSY, not a failure of the worker), other 5xx SERVER_ERROR."""
    if status in (429, 503):
        return Failure.BUSY
    return Failure.SERVER_ERROR if status >= 500 else None


def retry_after(headers: Mapping[str, str]) -> float | None:
    value = headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def first_byte_timeout(attempt: Attempt, timeouts: Timeouts) -> UpstreamFailure:
    return _timed_out(attempt, f"no first byte within {timeouts.first_byte_s:g} s")


def unary_timeout(attempt: Attempt, timeouts: Timeouts) -> UpstreamFailure:
    return _timed_out(attempt, f"no answer within {timeouts.total_s:g} s")


def _timed_out(attempt: Attempt, message: str) -> UpstreamFailure:
    """The attempt's wait ended: abandoned by passive health (a stalled worker), or
    `message` (its own deadline)."""
    if attempt.abandoned is not None:
        return UpstreamFailure("the worker stopped answering", Failure.TIMEOUT, status=504,
                               detail=f"abandoned before its first byte: {attempt.abandoned}")
    return UpstreamFailure(message, Failure.TIMEOUT, status=504)


def broken_before_answer(exc: ConnectionBroken) -> UpstreamFailure:
    return UpstreamFailure("the connection to the worker broke before its answer",
                           Failure.RESET, detail=f"worker connection failed: {exc}")


def client_error_body(status: int, body: bytes) -> bytes:
    """A worker's 4xx (or other non-retried) error as the client gets it: OpenAI-format
    JSON. vLLM's own errors (`{"error": {...}}`) pass as they are; an older vLLM's flat
    `{"object": "error", "message": ...}` keeps its message and code; anything else (a
    `text/plain` "404: Not Found", HTML from a proxy in front of the worker) is replaced
    by a message that quotes none of it."""
    try:
        document = json.loads(body)
    except ValueError:
        document = None
    if isinstance(document, dict):
        error = document.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return body
        message = document.get("message")
        if isinstance(message, str):
            code = document.get("code")
            return error_body(status, message[:1000],
                              code=code if isinstance(code, str) else "upstream_error")
    phrase = _PHRASES.get(status, "error")
    return error_body(status, f"the worker answered {status} {phrase}", code="upstream_error")


_PHRASES = {status.value: status.phrase for status in HTTPStatus}


def error_event(first: bytes) -> tuple[int, str] | None:
    """(status, message) when a stream's first bytes are an error event, as vLLM writes
    one (`data: {"error": {"message": ..., "code": 503, ...}}`); None for anything else.
    Costs a prefix test per stream: only an event that starts like an error is decoded."""
    if not first.startswith(_ERROR_EVENT_PREFIXES):
        return None
    line = first[5:].split(b"\n", 1)[0]
    try:
        document = json.loads(line)
    except ValueError:
        return None  # not one whole JSON event: passed through as it is
    error = document.get("error") if isinstance(document, dict) else None
    if not isinstance(error, dict):
        return None
    return error_status(error)


_ERROR_EVENT_PREFIXES = (b'data: {"error"', b'data:{"error"')
