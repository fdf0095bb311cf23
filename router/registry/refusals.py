"""Why heartbeats and load records are refused, counted by reason.

The reasons are the schema's (worker.schema.HEARTBEAT_REFUSALS and
worker.load_records.RECORD_REFUSALS: malformed_json, oversize, unknown_field,
invalid:<field path>) and what the collector finds once a payload is parsed.
A bounded set, never text from the input: each is a label value of
globalpool_heartbeats_refused_total.
"""

from __future__ import annotations

import logging

from worker.load_records import RECORD_REFUSALS
from worker.schema import HEARTBEAT_REFUSALS

log = logging.getLogger("globalpool.registry")

WORKER_ID_MISMATCH = "worker_id_mismatch"  # not the worker its bytes or hash field name
ORDER_MISMATCH = "order_mismatch"  # sent_at_s and seq read otherwise than they parse
WRONG_REGION = "wrong_region"  # a load record in another region than its worker's
REFUSAL_REASONS = (HEARTBEAT_REFUSALS | RECORD_REFUSALS
                   | {WORKER_ID_MISMATCH, ORDER_MISMATCH, WRONG_REGION})
# The collector's counts() names each reason's count so (router.telemetry.fleet labels
# them).
REFUSED_COUNT_PREFIX = "heartbeats_refused:"


class Refusals:
    """The refused heartbeats and load records: `total`, and `by_reason` (REFUSAL_REASONS)."""

    def __init__(self) -> None:
        self.total = 0
        self.by_reason: dict[str, int] = {}

    def refuse(self, reason: str, why: str) -> None:
        """Count a refused heartbeat or load record by `reason` (REFUSAL_REASONS)."""
        self.total += 1
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1
        count = self.total
        if count & (count - 1) == 0:  # 1st, 2nd, 4th, 8th...: garbage cannot flood logs
            log.warning("refused a heartbeat or load record (%s; %d so far): %s",
                        reason, count, why)

    def counts(self) -> dict[str, int]:
        """Each reason's count, named REFUSED_COUNT_PREFIX + reason."""
        return {REFUSED_COUNT_PREFIX + reason: count
                for reason, count in self.by_reason.items()}
