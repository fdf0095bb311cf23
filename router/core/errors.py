"""OpenAI-format JSON errors: what every failure at the API looks like to a client.

    {"error": {"message": "...", "type": "invalid_request_error", "param": null, "code": null}}
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from aiohttp import web
from aiohttp.typedefs import Handler

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable_error",
    504: "upstream_timeout_error",
}


def error_body(
    status: int, message: str, *, code: str | None = None, param: str | None = None
) -> bytes:
    error_type = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    payload = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    return json.dumps(payload).encode()


def error_response(
    status: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    return web.Response(
        status=status,
        body=error_body(status, message, code=code, param=param),
        content_type="application/json",
        headers=headers,
    )


def sse_error_event(status: int, message: str, *, code: str | None = None) -> bytes:
    """An SSE event carrying an OpenAI error, then the end-of-stream marker.

    Starts with a blank line so that it ends any partial event the upstream cut short.
    The openai client raises `APIError` with this message when it reads the event.
    """
    return b"\n\ndata: " + error_body(status, message, code=code) + b"\n\ndata: [DONE]\n\n"


class ApiError(Exception):
    """A request the router refuses; rendered by the error middleware."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers

    def response(self) -> web.Response:
        return error_response(
            self.status, self.message, code=self.code, param=self.param, headers=self.headers
        )


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turns refusals and aiohttp's own HTTP errors (404, 405, 413...) into OpenAI JSON."""
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = {
            404: f"no route for {request.method} {request.path}",
            405: f"method {request.method} is not allowed on {request.path}",
            413: "request body is too large",
        }.get(exc.status, exc.reason)
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return error_response(exc.status, message, headers=headers)
