"""`globalpool drill hostile`: bring the lanes up, run every cell, write the report.

One Valkey; `lanes` topologies (lab.drill.hostile.lane) that share it and take the
cells in turn, so that the cells' waits (timeouts are seconds long) overlap; each cell
gets a fresh router on its lane. Progress is one line per cell. Every request of every
cell is appended to requests.jsonl as it ends, the report is written at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lab.devstack.valkey import EmbeddedValkey, free_port
from lab.drill.hostile.cell import CellSettings, run_cell
from lab.drill.hostile.clients import ClientSettings, ensure_open_files
from lab.drill.hostile.lane import Lane, lane_document
from lab.drill.hostile.measure import STALL_S, goals_missed, summarize
from lab.drill.hostile.report import build_report, write_outputs

# The faults and behaviours of the issue, in its order (the simulator can play
# short_content_length too: --faults names it).
WORKER_FAULTS = ("no_answer", "headers_then_hang", "half_body_close", "wrong_content_length",
                 "huge_headers", "endless_body", "garbage", "reset_mid_stream", "slow_tokens",
                 "wedge")
CLIENT_BEHAVIOURS = ("normal", "slow_reader", "reads_then_stalls", "disconnects_before_headers",
                     "disconnects_after_headers", "disconnects_mid_stream", "big_body",
                     "idle_connections")


@dataclass(frozen=True)
class HostileOptions:
    out: Path
    faults: tuple[str, ...] = WORKER_FAULTS
    clients: tuple[str, ...] = CLIENT_BEHAVIOURS
    quick: bool = False
    lanes: int = 2
    healthy_workers: int = 3
    cell: CellSettings = field(default_factory=CellSettings)
    client_settings: ClientSettings = field(default_factory=ClientSettings)
    overrides: tuple[str, ...] = ()  # PATH=VALUE settings of the lanes' regions.yaml
    command: str = ""

    def cells(self) -> list[tuple[str, str]]:
        """Every fault x every behaviour; --quick: each fault with a normal client, and
        each behaviour against the first fault."""
        if not self.quick:
            return [(f, c) for f in self.faults for c in self.clients]
        picked = [(f, self.clients[0]) for f in self.faults]
        picked += [(self.faults[0], c) for c in self.clients[1:]]
        return picked


async def run_hostile(options: HostileOptions, say: Callable[[str], None]) -> dict[str, Any]:
    """Run the drill; returns the report (also written under options.out)."""
    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    planned = options.cells()
    # Clients and routers each hold the idle connections (children inherit the limit).
    ensure_open_files(options.client_settings.idle_connections + 2000)
    load_at_start = os.getloadavg()[0]
    started = time.monotonic()
    say(f"drill hostile: {len(planned)} cells ({len(options.faults)} worker faults x "
        f"{len(options.clients)} client behaviours{', quick' if options.quick else ''}) on "
        f"{options.lanes} lane(s) of {options.healthy_workers} healthy workers + 1 bad; "
        f"out: {out}")
    valkey = await asyncio.to_thread(EmbeddedValkey.start, die_with_parent=True,
                                     log_path=out / "valkey.log")
    lanes = [Lane(i, out, valkey.url, lane_document(i, options.healthy_workers, free_port()),
                  options.overrides, secrets.token_urlsafe(16), say)
             for i in range(min(options.lanes, len(planned)))]
    cells: dict[int, dict[str, Any]] = {}
    stopped_by: Exception | None = None  # what ended the run before its last cell
    try:
        await asyncio.gather(*(lane.start() for lane in lanes))
        say(f"lanes up in {time.monotonic() - started:.1f} s; logs in {out}/lane-N/logs")
        todo = list(enumerate(planned))
        with (out / "requests.jsonl").open("w") as records:
            try:
                async with asyncio.TaskGroup() as lanes_at_work:  # one failing stops the others
                    for lane in lanes:
                        lanes_at_work.create_task(
                            _work(lane, todo, cells, options, records, say, len(planned)))
            except ExceptionGroup as failed:
                stopped_by = failed.exceptions[0]  # what stopped the first lane
    finally:
        say("stopping the lanes ...")
        await asyncio.gather(*(lane.stop() for lane in lanes), return_exceptions=True)
        await asyncio.to_thread(valkey.stop)
    report = build_report(
        [cells[i] for i in sorted(cells)], faults=options.faults, clients=options.clients,
        settings=_settings(options), wall_s=time.monotonic() - started,
        host={"cpus": os.cpu_count(), "load_average_1m_at_start": load_at_start,
              "load_average_1m_at_end": os.getloadavg()[0]},
        command=options.command,
        incomplete=None if stopped_by is None else f"{len(cells)} of {len(planned)} cells "
        f"ran; then {type(stopped_by).__name__}: {stopped_by}")
    write_outputs(out, report)  # what was measured is kept, also when a lane failed
    if stopped_by is not None:
        raise stopped_by
    return report


async def _work(lane: Lane, todo: list[tuple[int, tuple[str, str]]],
                cells: dict[int, dict[str, Any]], options: HostileOptions,
                records: Any, say: Callable[[str], None], total: int) -> None:
    """Take cells off `todo` until none is left."""
    while todo:
        index, (fault, client) = todo.pop(0)
        run = await run_cell(lane, fault, client, options.cell, options.client_settings)
        cell = cells[index] = summarize(run)
        for outcome in run.outcomes:
            records.write(json.dumps({"fault": fault, "client": client, **outcome.to_json()})
                          + "\n")
        say(_progress(index, total, cell))


def _progress(index: int, total: int, cell: dict[str, Any]) -> str:
    missed = goals_missed(cell)
    detect = cell["detect_s"]
    width = len(str(total))
    return (f"[{index + 1:>{width}}/{total}] lane {cell['lane']} "
            f"{cell['worker_fault'] + ' x ' + cell['client_behaviour']:<50} "
            f"{cell['requests']:3d} req, lost {cell['lost']}, healthy ejected "
            f"{cell['healthy_ejected']}, detect {'-' if detect is None else f'{detect:.2f} s'}, "
            f"router 5xx {cell['router_5xx']}, RSS {cell['rss_mb_before']:.0f}->"
            f"{cell['rss_mb_after']:.0f} MB, {cell['wall_s']:.1f} s  "
            + ("ok" if not missed else "MISSED " + ", ".join(missed))
            + (f" (the machine stalled {cell['max_loop_lag_s']:.1f} s)"
               if cell["max_loop_lag_s"] > STALL_S else ""))


def _settings(options: HostileOptions) -> dict[str, Any]:
    document = lane_document(0, options.healthy_workers, 0)
    return {
        "quick": options.quick, "lanes": options.lanes,
        "healthy_workers": options.healthy_workers,
        "cell": asdict(options.cell), "clients": asdict(options.client_settings),
        "router": document["router"] | {"port": None}, "overrides": list(options.overrides),
        "simulated_worker": document["regions"]["lab"]["simulated"],
        "heartbeat": document["heartbeat"],
        "isolation": "a fresh router process per cell (no breaker, retry budget, latency "
                     "penalty, connection pool or memory carries over); the bad worker's "
                     "misbehave (or wedge) knob set at the cell's start and cleared at its "
                     "end; every "
                     "simulator warmed up with 2 direct requests before each cell so that "
                     "all report a recent TTFT",
    }
