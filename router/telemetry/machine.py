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
how many answered this scrape ("answered").

The machine's counters never go backwards (Prometheus would read a drop as a reset, and
`rate()` would spike when the counts came back). Each process keeps what it last
answered in the supervisor's directory (`Kept`): a sibling that does not answer a scrape
(stopped, stuck, restarting) counts what it last answered, and a process started again
in a slot first folds its predecessors' last counts into the slot's base, which every
scrape adds. Only counters, histograms and summaries are kept so; a missing sibling's
gauges are left out.
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
    metrics text, kept as `Kept.note` does), then close it."""

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
                        timeout_s: float = SIBLING_TIMEOUT_S) -> list[bytes | None]:
    """The metrics texts of the siblings, in order (None: no answer within `timeout_s`)."""

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

    return list(await asyncio.gather(*(one(path) for path in paths)))


class Kept:
    """The counts each process of the machine last answered, and the counts of the
    processes a slot had before its current one (see the module doc), as files in the
    supervisor's private directory: `counts-<slot>-<start>.prom`, and
    `base-<slot>-<up to start>.prom`."""

    def __init__(self, directory: Path, index: int, count: int, starts: int) -> None:
        self._directory = directory
        self._index = index
        self._count = count
        self._starts = starts

    def note(self, text: bytes) -> bytes:
        """Keep `text`, this process's metrics as it answers them; returns it."""
        path = self._directory / f"counts-{self._index}-{self._starts}.prom"
        _write(path, text)
        return text

    def fold(self) -> None:
        """At this process's start: fold the slot's predecessors' last counts into its
        base (a new file, then the old ones go: a scrape meanwhile reads one or the
        other, never both)."""
        upto, base = self._base(self._index)
        earlier = {start: path for start, path in self._counts(self._index).items()
                   if upto < start < self._starts}
        if not earlier:
            return
        texts = [path.read_bytes() for _, path in sorted(earlier.items())]
        _write(self._directory / f"base-{self._index}-{max(earlier)}.prom",
               _counters_text([*([base] if base else []), *texts]))
        for path in [*earlier.values(), *self._bases(self._index).values()]:
            if path.name != f"base-{self._index}-{max(earlier)}.prom":
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def missing(self, answered: Sequence[bool]) -> list[bytes]:
        """What a scrape adds for every slot: its base, and for a sibling that did not
        answer (`answered[i]`: slot i's, this process's own included), the counts it
        last answered."""
        texts: list[bytes] = []
        for index in range(self._count):
            upto, base = self._base(index)
            if base:
                texts.append(base)
            if not answered[index]:
                later = {start: path for start, path in self._counts(index).items()
                         if start > upto}
                if later:
                    with contextlib.suppress(FileNotFoundError):
                        texts.append(later[max(later)].read_bytes())
        return texts

    def _bases(self, index: int) -> dict[int, Path]:
        return _numbered(self._directory, f"base-{index}-")

    def _base(self, index: int) -> tuple[int, bytes]:
        bases = self._bases(index)
        if not bases:
            return 0, b""
        upto = max(bases)
        try:
            return upto, bases[upto].read_bytes()
        except FileNotFoundError:  # (folded away meanwhile: the next scrape has it)
            return 0, b""

    def _counts(self, index: int) -> dict[int, Path]:
        return _numbered(self._directory, f"counts-{index}-")


def _numbered(directory: Path, prefix: str) -> dict[int, Path]:
    found: dict[int, Path] = {}
    for path in directory.glob(f"{prefix}*.prom"):
        number = path.name[len(prefix):-len(".prom")]
        if number.isdigit():
            found[int(number)] = path
    return found


def _write(path: Path, text: bytes) -> None:
    """`text` to `path`, whole or not at all (readers never see half of it)."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_bytes(text)
    os.replace(partial, path)


def _counters_text(texts: Sequence[bytes]) -> bytes:
    """The counters, histograms and summaries of `texts`, summed."""
    return merge(b"", [], 0, texts, processes=False)


def merge(own: bytes, siblings: Sequence[bytes], configured: int,
          kept: Sequence[bytes] = (), *, processes: bool = True) -> bytes:
    """`own` with `siblings` merged in (see the module doc), and the counters of `kept`
    (`Kept.missing`), in Prometheus' text format."""
    families = {family.name: family for family in _parse(own)}
    order = list(families)
    for text, only_counts in [*((text, False) for text in siblings),
                              *((text, True) for text in kept)]:
        for family in _parse(text):
            if only_counts and family.type == "gauge":
                continue
            mine = families.get(family.name)
            if mine is None:
                if family.type != "gauge":  # a series only a sibling has yet
                    families[family.name] = family
                    order.append(family.name)
                continue
            mine.samples = list(_merged(mine, family))
    merged = [families[name] for name in order]
    if processes:
        gauge = GaugeMetricFamily(
            "globalpool_router_processes", "Processes of this router replica on its port: "
            "configured, and answering this scrape.", labels=["state"])
        gauge.add_metric(["configured"], configured)
        gauge.add_metric(["answered"], 1 + len(siblings))
        merged.append(gauge)
    return generate_latest(_Families(merged))


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
