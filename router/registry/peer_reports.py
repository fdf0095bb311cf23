"""The peer reports' wire format (router.registry.peers): one PUBLISH per report,
`v1 <key_id> <hex HMAC-SHA256 of the body> <body>` (`v1 - - <body>` unsigned); the body is
described in router.registry.peers. Checked here, whatever the sender claims."""

from __future__ import annotations

import hmac
import json
import math
from collections.abc import Collection, Mapping
from typing import NamedTuple, TypeGuard

from router.registry.shared_sends import MAX_SHARED_SERVED, MAX_WROTE_PER_WORKER, SharedSends
from worker.signing import hmac_sha256_hex

MAX_REPORT_BYTES = 1 << 20
MAX_OPEN_PER_WORKER = 100_000
MAX_PREFILL_PER_WORKER = 100_000_000  # tokens: a report claiming more is not believed
MAX_PREFIX_KEYS = 32  # a prompt's prefix keys (router.core.parse.prefix_keys_of: CRC-32s)
MAX_WORKER_ID = 256  # characters
MAX_READY_MODELS = 32  # models a report says it holds Batch API lines ready for
MAX_MODEL_NAME = 256  # characters
# A signed report older than this (by its `sent_at`), or not newer (`seq`) than the last
# taken from its sender, is a replay: anyone who can read the channel could otherwise
# publish a captured report again, and keep a stopped replica's requests counting.
MAX_REPORT_AGE_S = 10.0
_VERSION = b"v1"
_UNSIGNED = b"-"


def encode_report(router: str, open_: Mapping[str, int],
                  key: tuple[str, bytes] | None = None, region: str | None = None,
                  prefill: Mapping[str, int] | None = None,
                  affinity: SharedSends | None = None, sent_at_s: float | None = None,
                  seq: int | None = None, batch: Mapping[str, int] | None = None,
                  batch_ready: Collection[str] = ()) -> bytes:
    # Figures past what a peer believes are sent as that much: one too large would get the
    # whole report refused by every peer (a client's absurd request, counted as sent).
    document: dict[str, object] = {"router": router,
                                   "open": _believable(open_, MAX_OPEN_PER_WORKER)}
    if sent_at_s is not None:
        document["sent_at"] = round(sent_at_s, 3)
    if seq is not None:
        document["seq"] = seq
    if region is not None:
        document["region"] = region
    if prefill:
        document["prefill"] = _believable(prefill, MAX_PREFILL_PER_WORKER)
    if batch:
        document["batch"] = {worker: min(lines, open_.get(worker, 0))
                             for worker, lines in batch.items() if open_.get(worker, 0) > 0}
    if batch_ready:  # (past the limits, not said at all: a peer then keeps its whole room)
        ready = sorted(batch_ready)
        if _model_names(ready):
            document["batch_ready"] = ready
    if affinity:
        document["affinity"] = {"wrote": affinity.wrote, "served": affinity.served}
    body = json.dumps(document, separators=(",", ":")).encode()
    if key is None:
        return b"v1 - - " + body
    key_id, secret = key
    signature = hmac_sha256_hex(secret, body)
    return b" ".join((_VERSION, key_id.encode(), signature.encode(), body))


def _believable(figures: Mapping[str, int], limit: int) -> Mapping[str, int]:
    """`figures`, each at most `limit` (the same mapping when none is above it)."""
    if all(figure <= limit for figure in figures.values()):
        return figures
    return {worker: min(figure, limit) for worker, figure in figures.items()}


class ReportError(ValueError):
    """A peer report that is not believed: `reason` is a metrics label ("too_large",
    "malformed", "unsigned", "unknown_key", "bad_signature"), the message says more."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class PeerReport(NamedTuple):
    """One peer report, checked: the sender's id and open requests per worker, the region
    it serves (None: it does not say, as replicas before it did not), its prompt tokens
    not yet prefilled per worker (empty: none, or a replica from before they were
    reported), what it sent since its last report (None: nothing, or a replica from
    before it was reported), when it sent the report (Unix s) as its how-manyth
    (None: a replica from before reports carried them), and how many of its open
    requests per worker are Batch API lines (at most its open requests there; empty:
    none, or a replica from before they were reported), and the models it holds Batch
    API lines for, to start as room allows (empty: none, or a replica from before)."""

    router: str
    open: dict[str, int]
    region: str | None
    prefill: dict[str, int]
    shared: SharedSends | None
    sent_at_s: float | None
    seq: int | None
    batch: dict[str, int]
    batch_ready: frozenset[str] = frozenset()


def decode_report(payload: bytes, keys: Mapping[str, bytes]) -> tuple[str, dict[str, int]]:
    """(router id, open requests per worker). Raises ReportError. With `keys`, the report
    must be signed by one of them."""
    report = decode_report_from(payload, keys)
    return report.router, report.open


def decode_report_from(payload: bytes, keys: Mapping[str, bytes]) -> PeerReport:
    """A peer report, checked (`decode_report`)."""
    if len(payload) > MAX_REPORT_BYTES:
        raise ReportError("too_large", f"larger than {MAX_REPORT_BYTES} bytes")
    parts = payload.split(b" ", 3)
    if len(parts) != 4 or parts[0] != _VERSION:
        raise ReportError("malformed", "not a v1 report")
    _, key_id, signature, body = parts
    if keys:
        secret = keys.get(key_id.decode(errors="replace"))
        if secret is None:
            if key_id == _UNSIGNED:
                raise ReportError("unsigned", "unsigned")
            raise ReportError("unknown_key", "unknown key id")
        expected = hmac_sha256_hex(secret, body).encode()
        if not hmac.compare_digest(expected, signature):
            raise ReportError("bad_signature", "bad signature")
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        raise ReportError("malformed", "body is not JSON") from None
    if not isinstance(document, dict):
        raise ReportError("malformed", "body is not an object")
    router, open_ = document.get("router"), document.get("open")
    if not isinstance(router, str) or not 0 < len(router) <= 200:
        raise ReportError("malformed", "no router id")
    if not _per_worker(open_, MAX_OPEN_PER_WORKER):
        raise ReportError("malformed", "`open` is not {worker id: count}")
    prefill = document.get("prefill", {})
    if not _per_worker(prefill, MAX_PREFILL_PER_WORKER) or not prefill.keys() <= open_.keys():
        raise ReportError("malformed", "`prefill` is not {worker id with open requests: "
                                       "tokens}")
    batch = document.get("batch", {})
    if not _per_worker(batch, MAX_OPEN_PER_WORKER) or not all(
            lines <= open_.get(worker, 0) for worker, lines in batch.items()):
        raise ReportError("malformed", "`batch` is not {worker id: lines, at most its "
                                       "open requests there}")
    ready = document.get("batch_ready", [])
    if not _model_names(ready):
        raise ReportError("malformed", f"`batch_ready` is not a list of at most "
                                       f"{MAX_READY_MODELS} model names")
    region = document.get("region")
    region = region if isinstance(region, str) and len(region) <= 64 else None
    sent_at, seq = document.get("sent_at"), document.get("seq")
    if not (sent_at is None or (isinstance(sent_at, int | float) and type(sent_at) is not bool
                                and math.isfinite(sent_at))) or not (
            seq is None or (type(seq) is int and seq >= 0)):
        raise ReportError("malformed", "`sent_at` is not a time or `seq` not a count")
    return PeerReport(router, open_, region, prefill, _shared_sends(document.get("affinity")),
                      None if sent_at is None else float(sent_at), seq, batch,
                      frozenset(ready))


def _shared_sends(affinity: object) -> SharedSends | None:
    """A report's `affinity`, checked (see the module doc); raises ReportError."""
    if affinity is None:
        return None
    wrote = affinity.get("wrote") if isinstance(affinity, dict) else None
    served = affinity.get("served") if isinstance(affinity, dict) else None
    if (not _per_worker(wrote, MAX_WROTE_PER_WORKER) or not isinstance(served, list)
            or len(served) > MAX_SHARED_SERVED):
        raise ReportError("malformed", "`affinity` is not {wrote: {worker id: tokens}, "
                                       "served: [...]}")
    sends = SharedSends()
    sends.wrote = wrote
    for item in served:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                and 0 < len(item[0]) <= MAX_WORKER_ID and isinstance(item[1], list)
                and 0 < len(item[1]) <= MAX_PREFIX_KEYS
                and all(type(key) is int and 0 <= key <= 0xFFFFFFFF for key in item[1])
                and type(item[2]) is int and 0 <= item[2] <= MAX_WROTE_PER_WORKER):
            raise ReportError("malformed", "`affinity.served` is not [[worker id, [prefix "
                                           "keys], tokens], ...]")
        sends.served.append((item[0], tuple(item[1]), item[2]))
    return sends


def _model_names(names: object) -> TypeGuard[list[str]]:
    """Whether `names` is a list of at most MAX_READY_MODELS model names, each 1 to
    MAX_MODEL_NAME characters (what a report's `batch_ready` may be)."""
    return isinstance(names, list) and len(names) <= MAX_READY_MODELS and all(
        isinstance(name, str) and 0 < len(name) <= MAX_MODEL_NAME for name in names)


def _per_worker(figures: object, limit: int) -> TypeGuard[dict[str, int]]:
    """Whether `figures` is {worker id: an int from 0 to `limit`}."""
    return isinstance(figures, dict) and all(
        isinstance(worker, str) and type(figure) is int and 0 <= figure <= limit
        for worker, figure in figures.items())
