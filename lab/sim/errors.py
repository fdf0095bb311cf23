"""Errors in vLLM's OpenAI-server format.

vLLM answers every error with
    {"error": {"message": str, "type": str, "param": str | null, "code": <HTTP status>}}
where `type` is an exception-like name (BadRequestError, NotFoundError, ...) and `code`
is the HTTP status as an integer (not OpenAI's string codes).
"""

from __future__ import annotations

import functools
import json
from http import HTTPStatus
from typing import Any

from aiohttp import web

# Starlette (vLLM's server) writes compact JSON; so do we.
compact_dumps = functools.partial(json.dumps, separators=(",", ":"))
# The same with text as UTF-8, not \u escapes: the events vLLM's streams write themselves.
compact_text = functools.partial(json.dumps, separators=(",", ":"), ensure_ascii=False)


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.json_response(body, status=status, dumps=compact_dumps)


_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
}


class ApiError(Exception):
    """A request that gets an error response instead of a completion."""

    def __init__(self, status: HTTPStatus, message: str, param: str | None = None, *,
                 error_type: str | None = None) -> None:
        """`error_type` overrides the name derived from the status (the Responses API
        says "invalid_request_error" for its unknown ids and refused cancels)."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type
                or _TYPES.get(self.status, self.status.phrase.replace(" ", "")),
                "param": self.param,
                "code": int(self.status),
            }
        }

    def response(self) -> web.Response:
        return json_response(self.body(), status=int(self.status))

    def event(self) -> bytes:
        """The error as vLLM streams it after `200 OK`: one SSE event (`json.dumps`
        spacing, as vLLM's `create_streaming_error_response` writes it)."""
        return f"data: {json.dumps(self.body())}\n\n".encode()
