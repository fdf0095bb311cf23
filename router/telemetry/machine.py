"""/metrics for the whole machine when one replica runs as several processes.

Under `globalpool router --processes N` (router.processes) a scrape reaches one process
of N. Each process also answers its own metrics on a Unix socket in the supervisor's
private directory (`serve_own`), and the process that is scraped reads its siblings'
(`read_siblings`) and merges them into its own (`merge`), as prometheus-client's
multiprocess mode would for its own metric types (our collectors build their families at
scrape time, which that mode cannot see):

- counters, histograms and summaries: summed, series by series (a `_created` sample is
  the earliest);
- the gauges that count this process's own things (`SUMMED_GAUGES`: requests open,
  queued, idle upstream connections): summed;
- gauges that say something is up or fine (`MIN_GAUGES`): the lowest, so one process in
  trouble shows;
- every other gauge describes the fleet, the config or the view, which every process
  keeps alike: the scraped process's own value.

`globalpool_router_processes{state}` says how many processes there are ("configured") and
how many answered this scrape ("answered"): a sibling restarting is missing from one
scrape, not silently counted as zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

SUMMED_GAUGES = frozenset({
    "globalpool_inflight_requests", "globalpool_queued_requests",
    "globalpool_upstream_idle_connections",
})
MIN_GAUGES = frozenset({
    "globalpool_redis_connected", "globalpool_config_last_reload_ok",
    "globalpool_background_task_up",
})
# A sibling that does not answer within this long is left out of the scrape.
SIBLING_TIMEOUT_S = 2.0


async def serve_own(path: Path, own: Callable[[], bytes]) -> asyncio.AbstractServer:
    """Answer every connection to the Unix socket `path` with `own()` (this process's
    metrics text), then close it."""

    async def answer(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(own())
            await writer.drain()
        except ConnectionError:
            pass  # the sibling gave up on us
        finally:
            writer.close()

    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # left by this slot's previous process
    return await asyncio.start_unix_server(answer, path=str(path))


async def read_siblings(paths: Sequence[Path],
                        timeout_s: float = SIBLING_TIMEOUT_S) -> list[bytes]:
    """The metrics texts of the siblings that answer within `timeout_s`."""

    async def one(path: Path) -> bytes | None:
        try:
            async with asyncio.timeout(timeout_s):
                reader, writer = await asyncio.open_unix_connection(str(path))
                try:
                    return await reader.read()
                finally:
                    writer.close()
        except (OSError, TimeoutError):
            return None  # not started yet, restarting, or stuck: not in this scrape

    answers = await asyncio.gather(*(one(path) for path in paths))
    return [text for text in answers if text is not None]


def merge(own: bytes, siblings: Sequence[bytes], configured: int) -> bytes:
    """`own` with `siblings` merged in (see the module doc), in Prometheus' text format."""
    families = {family.name: family for family in _parse(own)}
    order = list(families)
    for text in siblings:
        for family in _parse(text):
            mine = families.get(family.name)
            if mine is None:
                if family.type != "gauge":  # a series only a sibling has yet
                    families[family.name] = family
                    order.append(family.name)
                continue
            mine.samples = list(_merged(mine, family))
    processes = GaugeMetricFamily(
        "globalpool_router_processes", "Processes of this router replica on its port: "
        "configured, and answering this scrape.", labels=["state"])
    processes.add_metric(["configured"], configured)
    processes.add_metric(["answered"], 1 + len(siblings))
    return generate_latest(_Families([*(families[name] for name in order), processes]))


def _parse(text: bytes) -> Iterable[Metric]:
    return text_string_to_metric_families(text.decode("utf-8"))


def _merged(mine: Metric, theirs: Metric) -> Iterable[Sample]:
    combine = _combiner(mine)
    if combine is None:
        return mine.samples
    by_key = {_key(sample): sample for sample in mine.samples}
    for sample in theirs.samples:
        key = _key(sample)
        have = by_key.get(key)
        if have is None:
            by_key[key] = sample
        else:
            by_key[key] = have._replace(value=combine(sample.name, have.value, sample.value))
    return by_key.values()


def _combiner(family: Metric) -> Callable[[str, float, float], float] | None:
    """How two processes' values of a series of `family` combine; None: ours stands."""
    if family.type == "gauge":
        if family.name in SUMMED_GAUGES:
            return _sum
        if family.name in MIN_GAUGES:
            return _min
        return None
    return _sum


def _sum(name: str, a: float, b: float) -> float:
    return min(a, b) if name.endswith("_created") else a + b


def _min(_name: str, a: float, b: float) -> float:
    return min(a, b)


def _key(sample: Sample) -> tuple[str, tuple[tuple[str, str], ...]]:
    return sample.name, tuple(sorted(sample.labels.items()))


class _Families:
    """A registry-like holder of ready families, for `generate_latest`."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families
