"""Heartbeats received on the channel, queued by worker until the next snapshot build.

Heartbeats that arrive between two snapshot builds are only queued, by worker, and each
worker's newest is parsed and checked when the next snapshot is built: a large fleet
heartbeats faster than its snapshot is rebuilt (10,000 workers at 4 Hz against a build
every ~0.45 s), and the heartbeats in between would be parsed only to be replaced. The
worker id is read from the payload's bytes to queue it, and must match the id the parsed
heartbeat carries. When a worker has several queued, they are tried newest first by their
own send time and seq (read from the bytes, checked once parsed), not by arrival, until one
is taken: a replay or forgery published after a real report cannot hide it.
"""

from __future__ import annotations

import math

from router.registry.refusals import ORDER_MISMATCH, WORKER_ID_MISMATCH, Refusals
from router.registry.worker_table import HeartbeatCheck, WorkerTable
from worker.heartbeat_keys import HeartbeatKeys

GONE_PREFIX = HeartbeatKeys.GONE_PREFIX.encode()
# How a heartbeat's JSON (pydantic's model_dump_json) names its worker: read without parsing.
WORKER_ID_FIELD = b'"worker_id":"'

# Heartbeats waiting for the next build, by worker id (bytes): (payload, received at),
# in the order they arrived.
_Queued = list[tuple[bytes, float]]


def _order_of(payload: bytes) -> tuple[float, int] | None:
    """(sent_at_s, seq) read from a heartbeat's bytes without parsing it: the last
    occurrence of each (after every nested object) up to the next comma, as both forms
    agents publish write them (other fields follow both); None when they cannot be read
    so. A payload that reads otherwise than it parses is refused (`MessageQueue._apply`)."""
    try:
        sent = payload.rindex(b'"sent_at_s":') + 12
        seq = payload.rindex(b'"seq":') + 6
        return (float(payload[sent : payload.index(b",", sent)]),
                int(payload[seq : payload.index(b",", seq)]))
    except ValueError:
        return None


def _newest_first(candidate: tuple[tuple[float, int] | None, float, bytes]) -> tuple[float, int]:
    return candidate[0] if candidate[0] is not None else (-math.inf, -1)


class MessageQueue:
    """The channel's messages as the collector takes them: heartbeats queued by worker
    (`queued`) until `apply`, `gone:` messages at once. Counts what it received
    (`received`, `gone:` ones included) and the `gone:` messages it ignored."""

    def __init__(self, *, table: WorkerTable, gate: HeartbeatCheck | None,
                 refusals: Refusals) -> None:
        self._table = table
        self._gate = gate
        self._refusals = refusals
        self.queued: dict[bytes, _Queued] = {}
        self.received = 0
        self.ignored_gone = 0

    def take(self, payloads: list[bytes], received_s: float) -> bool:
        """Queue the messages received at `received_s`. Whether anything may have changed."""
        self.received += len(payloads)
        changed = False
        for payload in payloads:
            changed |= self._queue(payload, received_s)
        return changed

    def _queue(self, payload: bytes, received_s: float) -> bool:
        """Queue a heartbeat for the next build (see the module doc); a `gone:` message
        takes effect now. Whether anything may have changed."""
        if payload.startswith(GONE_PREFIX):
            if self._gate is not None and self._gate.signing:
                # `gone:` carries no signature: anyone allowed to PUBLISH could remove any
                # worker with it. With signing on, a departed worker ages out by its TTL
                # instead (its last, signed, heartbeat already said `draining`).
                self.ignored_gone += 1
                return False
            worker = payload[len(GONE_PREFIX):]
            self.queued.pop(worker, None)  # it said gone after these
            return self._table.drop(worker.decode(errors="replace"), worker) is not None
        start = payload.find(WORKER_ID_FIELD)
        if start < 0:  # not as a worker writes one: parsed now, to be refused and counted
            return self._apply(payload, received_s, None, None)
        start += len(WORKER_ID_FIELD)
        worker = payload[start : payload.find(b'"', start)]
        waiting = self.queued.get(worker)
        if waiting is None:
            self.queued[worker] = [(payload, received_s)]
        else:
            waiting.append((payload, received_s))
        self._table.last_ok_at_s = received_s  # Redis delivered: its clock runs (WorkerTable)
        return True

    def apply(self) -> None:
        """Parse and store each queued worker's newest heartbeat that is taken."""
        queued, self.queued = self.queued, {}
        for worker, waiting in queued.items():
            if len(waiting) == 1:  # one heartbeat since the last build
                payload, received_s = waiting[0]
                self._apply(payload, received_s, worker, None)
                continue
            # Several: by their own order (send time, then seq), as read from the bytes and
            # checked once parsed, not by arrival: a replay published after the real report
            # is then tried only if that report is not taken.
            candidates = [(_order_of(payload), received_s, payload)
                          for payload, received_s in reversed(waiting)]
            candidates.sort(key=_newest_first, reverse=True)
            for order, received_s, payload in candidates:
                if self._apply(payload, received_s, worker, order):
                    break

    def _apply(self, payload: bytes, received_s: float, worker: bytes | None,
               order: tuple[float, int] | None) -> bool:
        table = self._table
        view = table.parse(payload, received_s, via_pubsub=True)
        if view is None:
            return False
        heartbeat = view.heartbeat
        if worker is not None and heartbeat.worker_id.encode() != worker:
            self._refusals.refuse(
                WORKER_ID_MISMATCH, f"worker id {heartbeat.worker_id!r} does not match the "
                f"payload's first worker_id field ({worker[:60]!r})")
            return False
        if order is not None and (heartbeat.sent_at_s, heartbeat.seq) != order:
            self._refusals.refuse(
                ORDER_MISMATCH, f"sent_at_s and seq of {heartbeat.worker_id!r} do not match "
                "the payload's last such fields")
            return False
        table.last_ok_at_s = max(table.last_ok_at_s or received_s, received_s)
        return table.store(view, force=False)
