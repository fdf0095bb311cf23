"""One line of a batch as the request path sees a client's request.

The runner sends each line through `Proxy.inference` like any request (admission, the
policy, retries, metrics), as the `batch` class: the cheapest region with spare batch
slots. Its answer comes back whole: a batch's lines do not stream (router.batch.lines
refuses `stream: true`), so nothing is relayed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from router.admission.gate import Admission
from router.auth.config import AuthConfig
from router.auth.keys import Principal
from router.batch.record import Batch
from router.proxy.exchange import Reply
from router.proxy.routing_hints import CLASS_HEADER
from router.proxy.transcript import Transcript
from router.proxy.upstream.connection import UpstreamConnection
from router.proxy.upstream.errors import UpstreamError


class LineExchange:
    """A batch line's request: `path`, `body`, sent as the `batch` class with the line's
    request id."""

    __slots__ = ("_body", "_headers", "_path")
    paced = True  # started into the room interactive traffic leaves (router.batch.runner)

    def __init__(self, path: str, body: bytes, request_id: str) -> None:
        self._path = path
        self._body = body
        self._headers = {"content-type": "application/json", CLASS_HEADER: "batch",
                         "x-request-id": request_id}

    @property
    def path(self) -> str:
        return self._path

    @property
    def headers(self) -> Mapping[str, str]:
        return self._headers

    @property
    def content_length(self) -> int | None:
        return len(self._body)

    def body_if_here(self) -> bytes | None:
        return self._body

    async def read_body(self, timeout_s: float) -> bytes:
        return self._body

    async def relay(self, headers: Mapping[str, str], first: bytes,
                    upstream: UpstreamConnection, transcript: Transcript | None = None,
                    ) -> UpstreamError | None:
        raise RuntimeError("a batch line does not stream")

    async def relay_more(self, first: bytes, upstream: UpstreamConnection,
                         rewrite: Callable[[bytes], bytes]) -> UpstreamError | None:
        raise RuntimeError("a batch line does not stream")

    async def end_stream(self, tail: bytes, server_timing: str | None = None) -> None:
        raise RuntimeError("a batch line does not stream")

    def client_pending_bytes(self) -> int:
        return 0  # nothing is written for this client: its answer is returned whole

    def abort_client(self) -> None:
        """Nothing to cut: the runner waits for the whole answer."""


def retry_after(reply: Reply) -> float:
    """The seconds a 429 asks to wait (Retry-After), within 0.1 to 60 (1 when unsaid)."""
    try:
        return min(60.0, max(0.1, float(reply.headers.get("Retry-After", "1"))))
    except ValueError:
        return 1.0


def sender_of(batch: Batch, admission: Admission | None, auth: AuthConfig
              ) -> tuple[Principal | None, str | None]:
    """Whom the batch's lines are sent as (None: no keys are configured), or why they
    cannot be sent."""
    if admission is None:
        return None, None
    keyring = admission.keyring(auth)
    if not keyring.enabled:
        return None, None
    principal = keyring.principal_of(batch.key_id or "")
    if principal is None or principal.tenant != batch.owner:
        return None, "the API key that created this batch is no longer configured"
    return principal, None
