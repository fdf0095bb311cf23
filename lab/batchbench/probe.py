"""The 1 Hz look at the fleet while a phase runs: batch lines served per region (the
router's /metrics), each worker's load as its heartbeat reports it (/admin/status), and
the batch's request_counts (the Batch API, through the `openai` client).

A look that fails (a timeout, the router busy) leaves its fields empty; the analysis
uses the looks that have them.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
from openai import AsyncOpenAI

LINES_METRIC = "globalpool_batch_lines_total"
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})


@dataclass(slots=True)
class Sample:
    """One look; `t_s` is seconds since the phase started."""

    t_s: float
    ok_by_region: dict[str, float] | None = None  # batch lines answered 200, cumulative
    running_by_worker: dict[str, int] | None = None  # heartbeat: sequences running
    waiting_by_worker: dict[str, int] | None = None  # heartbeat: sequences waiting
    status: str | None = None  # the batch's
    completed: int | None = None
    failed: int | None = None
    total: int | None = None

    @property
    def done(self) -> int | None:
        if self.completed is None or self.failed is None:
            return None
        return self.completed + self.failed

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


def batch_lines_ok(text: str) -> dict[str, float]:
    """`globalpool_batch_lines_total{outcome="ok"}` by region, from /metrics text."""
    served: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(LINES_METRIC + "{"):
            continue
        labels_text, _, value = line[len(LINES_METRIC) + 1:].rpartition("} ")
        labels = dict(_LABEL.findall(labels_text))
        if labels.get("outcome") == "ok":
            region = labels.get("region", "")
            served[region] = served.get(region, 0.0) + float(value)
    return served


@dataclass
class FleetProbe:
    """Looks at one router; `batch_id` is followed once set."""

    router_url: str
    admin_token: str
    session: aiohttp.ClientSession
    client: AsyncOpenAI
    batch_id: str | None = None
    samples: list[Sample] = field(default_factory=list)

    @property
    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    async def look(self, t_s: float) -> Sample:
        sample = Sample(t_s)
        await asyncio.gather(self._metrics(sample), self._workers(sample), self._batch(sample))
        self.samples.append(sample)
        return sample

    async def follow(self, t0_s: float, every_s: float = 1.0) -> None:
        """Look every `every_s` until cancelled (times since `t0_s`, monotonic)."""
        while True:
            started = time.monotonic()
            await self.look(round(started - t0_s, 3))
            await asyncio.sleep(max(0.0, every_s - (time.monotonic() - started)))

    async def _metrics(self, sample: Sample) -> None:
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
            async with self.session.get(f"{self.router_url}/metrics", headers=self._headers,
                                        timeout=_TIMEOUT) as response:
                if response.status == 200:
                    sample.ok_by_region = batch_lines_ok(await response.text())

    async def _workers(self, sample: Sample) -> None:
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
            async with self.session.get(f"{self.router_url}/admin/status",
                                        headers=self._headers, timeout=_TIMEOUT) as response:
                if response.status != 200:
                    return
                status = await response.json()
            workers = status.get("workers") or []
            sample.running_by_worker = {w["id"]: int(w["load"]["running"]) for w in workers}
            sample.waiting_by_worker = {w["id"]: int(w["load"]["waiting"]) for w in workers}

    async def _batch(self, sample: Sample) -> None:
        if self.batch_id is None:
            return
        with contextlib.suppress(openai.APIError):
            batch = await self.client.batches.retrieve(self.batch_id, timeout=2.0)
            sample.status = batch.status
            counts = batch.request_counts
            if counts is not None:
                sample.completed, sample.failed = counts.completed, counts.failed
                sample.total = counts.total

    async def idle(self, timeout_s: float = 20.0) -> bool:
        """Wait until every worker's heartbeat shows nothing running or waiting (the
        previous phase's requests gone); False if that took longer than `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            sample = Sample(0.0)
            await self._workers(sample)
            running, waiting = sample.running_by_worker, sample.waiting_by_worker
            if running is not None and waiting is not None and not any(
                    running.values()) and not any(waiting.values()):
                return True
            await asyncio.sleep(0.5)
        return False
