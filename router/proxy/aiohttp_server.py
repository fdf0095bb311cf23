"""aiohttp's side of the router's HTTP surface, answering as the router's front does.

Connections the front hands over (`router.proxy.front`: chunked or compressed uploads,
`Expect`, HTTP/1.0, malformed heads, the admin API) are aiohttp's. Two of its answers
bypass the app's `openai_errors` middleware, so they are the router's here:

- `JsonErrorsHandler`: a request aiohttp's parser refuses (ambiguous framing, a folded or
  NUL-bearing header, a bad chunk size, too many headers, a Content-Encoding it cannot
  decode) gets an OpenAI-format JSON error that quotes none of the client's bytes, and is
  logged at debug level (a client's mistake, not the router's).
- `add_inference_routes`: the inference endpoints answer `Expect: 100-continue` with
  `100 Continue` only when the request would be read (RFC 9110 10.1.1): a body over
  router.max_body_bytes gets its 413, a missing or unknown API key its 401, before the
  client sends it; any other expectation gets a JSON 417.

Not compiled (`setup.py`): it subclasses aiohttp's RequestHandler, and no request the
front serves comes here.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import hdrs, web
from aiohttp.http import HttpVersion11
from aiohttp.http_exceptions import (
    BadStatusLine,
    ContentEncodingError,
    ContentLengthError,
    HttpProcessingError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
    TransferEncodingError,
)
from aiohttp.web_protocol import RequestHandler

from router.auth.keys import AuthError
from router.core.endpoints import KIND_BY_PATH
from router.core.errors import ApiError, error_response
from router.proxy.handlers import Proxy

log = logging.getLogger("globalpool.front")

# What each refusal of aiohttp's parser says (its own messages quote the client's bytes).
_FAULTS: tuple[tuple[type[HttpProcessingError], str], ...] = (
    (LineTooLong, "a request line, header or chunk size line is too long"),
    (InvalidHeader, "a header is malformed"),
    (BadStatusLine, "the request line is malformed"),
    (InvalidURLError, "the request target is malformed"),
    (TransferEncodingError, "the chunked body's framing is invalid"),
    (ContentLengthError, "the body does not match its Content-Length"),
    (ContentEncodingError, "the body's compressed data does not inflate"),
)
_MAX_REASON_CHARS = 100


def protocol_fault(exc: HttpProcessingError) -> tuple[int, str]:
    """(status, message) for a request aiohttp's parser refused, without client bytes."""
    if isinstance(exc, ContentEncodingError) and "install" in exc.message:
        # br or zstd without their libraries (aiohttp inflates gzip and deflate).
        return 415, "unsupported Content-Encoding: send the body as identity, gzip or deflate"
    for kind, message in _FAULTS:
        if isinstance(exc, kind):
            return 400, f"malformed HTTP request: {message}"
    # llhttp's reasons ("Duplicate Content-Length", "Invalid header value char") come
    # first; what follows a newline or a colon may quote the client's bytes.
    reason = exc.message.split("\n", 1)[0].split(":", 1)[0].strip()[:_MAX_REASON_CHARS]
    if not reason.isascii() or not reason.isprintable():
        reason = "it cannot be parsed"
    return 400, f"malformed HTTP request: {reason}"


class JsonErrorsHandler(RequestHandler):
    """aiohttp's connection handler, its error answers in OpenAI's JSON format."""

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if isinstance(exc, HttpProcessingError) and 400 <= status < 500:
            status, text = protocol_fault(exc)
            log.debug("refused a malformed request from %s (%d): %s", request.remote,
                      status, text)
        elif isinstance(exc, web.HTTPException) and 400 <= exc.status < 500:
            status, text = exc.status, exc.reason
        else:
            # The router's own fault (or a handler that timed out): as aiohttp logs it.
            self.log_exception("Error handling request from %s", request.remote,
                               exc_info=exc)
            text = ("the request timed out in the router" if status == 504
                    else "internal error in the router (its log has the details)")
        if request.writer.output_size > 0:  # (as aiohttp: an answer had started)
            raise ConnectionError("Response is sent already, cannot send another response "
                                  "with the error message")
        response = error_response(status, text)
        response.force_close()
        return response


def json_errors_handler(server: web.Server) -> RequestHandler:
    """A connection handler for aiohttp's `server`, as `server()` makes its own."""
    return JsonErrorsHandler(server, loop=server._loop, **server._kwargs)


ExpectHandler = Callable[[web.Request], Awaitable[web.StreamResponse | None]]


def add_inference_routes(app: web.Application,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                         proxy_key: web.AppKey[Proxy]) -> None:
    """POST `handler` on each inference path, its `Expect` answered by `expect_for`."""
    expect = expect_for(proxy_key)
    for path in KIND_BY_PATH:
        app.router.add_post(path, handler, expect_handler=expect)


def expect_for(proxy_key: web.AppKey[Proxy]) -> ExpectHandler:
    """The `Expect` handler of the inference routes (see the module's docstring)."""

    async def expect(request: web.Request) -> web.StreamResponse | None:
        if request.version != HttpVersion11:
            return None  # HTTP/1.0 knows no interim answers: aiohttp sends none either
        if request.headers.get(hdrs.EXPECT, "").lower() != "100-continue":
            return _refused(ApiError(417, "unsupported Expect: the router meets only "
                                     "'Expect: 100-continue'"))
        proxy = request.app[proxy_key]
        config = proxy.configs.current
        try:
            admission = proxy.admission
            if admission is not None:
                keyring = admission.keyring(config.auth)
                if keyring.enabled:
                    try:
                        keyring.authenticate(request.headers.get(hdrs.AUTHORIZATION))
                    except AuthError:  # the handler's own refusal, counted as it counts
                        admission.authenticate(request.headers, config.auth)
            limit = config.router.max_body_bytes
            if (request.content_length or 0) > limit:
                raise ApiError(413, f"request body is too large (limit {limit} bytes)")
        except ApiError as exc:
            return _refused(exc)
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # (as aiohttp's: the answer has not started)
        return None

    return expect


def _refused(exc: ApiError) -> web.StreamResponse:
    """`exc`'s answer, closing the connection: the body the client holds is not read."""
    response = exc.response()
    response.force_close()
    return response
