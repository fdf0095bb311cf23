"""The load generator of `globalpool bench-slow-readers`: every stream of one run, in one
process.

    python -m lab.benchproxy.slow_clients '{"host": "127.0.0.1", "port": 8000, ...}'

`clients` clients, each on its own keep-alive connection, start a paced stream every
`period_s` until `window_s` has passed, client i first at i / clients x `period_s`: each
keeps its own timetable, as independent users do, so that arrivals stay spread even
after a stall that ended many streams at once (a client whose stream ends after its next
slot starts the next one at once). With `slow_readers`, every 1 / `slow_share`-th client
is a slow reader instead: a raw socket with a small receive buffer (`slow_rcvbuf_bytes`)
and an internet client's segment size (`slow_mss_bytes`), both set before connecting,
that takes `slow_read_bytes` at a time and no more than `slow_bytes_per_s`, so that the
router's buffers towards it fill and the router has to stop reading that stream from its
worker. Without `slow_readers` the same clients read at full speed (and are reported
apart, as `designated`), so that the other clients are the same population in both runs.

Bounded in time: no stream starts after `window_s`; a normal client's stream still open
`drain_s` later is abandoned (an error); a slow reader stops reading one period after the
window (when the last normal streams are due to end) and says so. Prints one JSON document
(see `run`).
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.benchproxy.httpclient import (
    Answer,
    ConnectionClosed,
    HttpConnection,
    connect,
    encode_post,
)
from lab.benchproxy.slow_tally import SlowTally, Tally, in_ms
from lab.benchproxy.stats import summarize
from router.event_loop import new_event_loop

PATH = "/v1/chat/completions"
# The end of a chunked answer: the last data chunk's CRLF, the zero-size chunk, CRLF.
_LAST_CHUNK = b"\r\n0\r\n\r\n"
SAMPLE_S = 0.01  # how often the loop's lag is read (and every 10th time, open streams)


@dataclass(frozen=True)
class Plan:
    """One run's clients (the JSON spec on the command line)."""

    host: str
    port: int
    body: str  # the request body (a streaming chat completion)
    clients: int
    slow_share: float
    slow_readers: bool
    events: int  # SSE events a complete stream carries (tokens, usage, [DONE])
    window_s: float
    warmup_s: float  # streams started before this are not in the TTFT figures
    period_s: float  # each client starts a stream this often
    drain_s: float
    stream_timeout_s: float
    slow_bytes_per_s: float
    slow_rcvbuf_bytes: int
    slow_mss_bytes: int = 1460
    slow_read_bytes: int = 1024

    def designated(self, index: int) -> bool:
        """Whether client `index` is one of the slow share (spread evenly over the
        clients, hence over their start times)."""
        return math.floor((index + 1) * self.slow_share) > math.floor(index * self.slow_share)


class Window:
    """The run's bounds (perf_counter seconds) and the streams open now."""

    def __init__(self, plan: Plan) -> None:
        self.start_s = time.perf_counter()
        self.end_s = self.start_s + plan.window_s
        # Slow readers stop reading when the normal clients' last streams are due to end.
        self.slow_end_s = self.end_s + min(plan.period_s, plan.drain_s - 1.0)
        self.warmup_end_s = self.start_s + plan.warmup_s
        self.open_streams = 0


class Timetable:
    """When one client starts its streams: every `period_s` from its first slot, or at
    once when the previous one ended past the next slot."""

    def __init__(self, window: Window, first_s: float, period_s: float) -> None:
        self._window = window
        self._slot_s = window.start_s + first_s
        self._period_s = period_s

    async def next(self) -> bool:
        """Wait for the next slot; False when the window has closed instead."""
        wait_s = self._slot_s - time.perf_counter()
        if wait_s > 0:
            await asyncio.sleep(wait_s)
        self._slot_s += self._period_s
        return time.perf_counter() < self._window.end_s


def _problem(answer: Answer, events: int) -> str | None:
    """Why a normal client's answer is not one whole stream, or None."""
    if answer.status != 200 or not answer.saw_done:
        return (f"status {answer.status}, [DONE] {'seen' if answer.saw_done else 'missing'}: "
                f"{answer.body_head[:200]!r}")
    if answer.events != events:
        return f"{answer.events} SSE events, expected {events}"
    return None


async def normal_client(plan: Plan, payload: bytes, index: int, window: Window,
                        tally: Tally) -> None:
    """Streams read at full speed, on the client's timetable, until the window closes."""
    timetable = Timetable(window, index / plan.clients * plan.period_s, plan.period_s)
    connection: HttpConnection | None = None
    while await timetable.next():
        started_s = time.perf_counter()
        window.open_streams += 1
        try:
            if connection is None or connection.closed:
                connection = await connect(plan.host, plan.port)
            async with asyncio.timeout(plan.stream_timeout_s):
                answer = await connection.request(payload)
        except (OSError, ConnectionClosed, TimeoutError) as exc:
            tally.error(f"{type(exc).__name__}: {exc}", started_s - window.start_s)
            if connection is not None:
                connection.close()
            connection = None
            continue
        finally:
            window.open_streams -= 1
        problem = _problem(answer, plan.events)
        if problem is not None:
            tally.error(problem, started_s - window.start_s)
            continue
        tally.completed += 1
        if started_s >= window.warmup_end_s:
            tally.measured(answer.first_byte_s - answer.sent_s, started_s - window.start_s)
    if connection is not None:
        connection.close()


def _slow_socket(plan: Plan) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # Before connect: the window and the segment size are announced at the handshake.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, plan.slow_rcvbuf_bytes)
    # An internet client's segment size. Loopback's (64 KB) lets the router's kernel grow
    # its send buffer to tcp_wmem's maximum (4 MB) at once, which holds any stream and
    # hides the slow reader from the router; at 1,460 bytes it holds ~46 KB, as it would.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, plan.slow_mss_bytes)
    sock.setblocking(False)
    return sock


async def _read_slowly(plan: Plan, sock: socket.socket, sent_s: float, window: Window,
                       tally: SlowTally) -> str:
    """Read one answer at the slow pace; returns how it ended: `completed`, `error_event`
    (the router ended it with an error event), `refused` (not a 200 stream),
    `disconnected` or `reset` (by the router), `unfinished` (still reading at the bound)."""
    loop = asyncio.get_running_loop()
    tail = b""
    error_seen = False
    while True:
        left_s = window.slow_end_s - time.perf_counter()
        if left_s <= 0:
            return "unfinished"
        try:
            async with asyncio.timeout(left_s):
                data = await loop.sock_recv(sock, plan.slow_read_bytes)
        except TimeoutError:
            return "unfinished"
        except OSError:
            return "reset"
        if not data:
            return "disconnected"
        if not tail:
            tally.ttft_s.append(time.perf_counter() - sent_s)
            if not data.startswith(b"HTTP/1.1 200"):
                return "refused"
        tally.bytes_read += len(data)
        seen = tail + data
        error_seen = error_seen or b'{"error"' in seen
        if seen.endswith(_LAST_CHUNK):
            return "error_event" if error_seen else "completed"
        tail = seen[-64:]
        await asyncio.sleep(len(data) / plan.slow_bytes_per_s)


async def slow_client(plan: Plan, payload: bytes, index: int, window: Window,
                      tally: SlowTally) -> None:
    """Streams read at the slow pace, on the client's timetable, until the window
    closes (each one usually outlasts it)."""
    timetable = Timetable(window, index / plan.clients * plan.period_s, plan.period_s)
    loop = asyncio.get_running_loop()
    sock: socket.socket | None = None
    while await timetable.next():
        sent_s = time.perf_counter()
        window.open_streams += 1
        try:
            if sock is None:
                sock = _slow_socket(plan)
                await loop.sock_connect(sock, (plan.host, plan.port))
            await loop.sock_sendall(sock, payload)
            outcome = await _read_slowly(plan, sock, sent_s, window, tally)
        except OSError:
            outcome = "reset"
        finally:
            window.open_streams -= 1
        tally.ended(outcome, time.perf_counter() - sent_s)
        if outcome not in ("completed", "error_event"):  # the connection is not reusable
            if sock is not None:
                sock.close()
            sock = None
    if sock is not None:
        sock.close()


def _failed(tally: Tally | SlowTally, what: str) -> None:
    if isinstance(tally, Tally):
        tally.error(what)
    else:
        tally.outcomes[f"load generator: {what[:80]}"] += 1


async def _sample(window: Window, lags_s: list[float], open_streams: list[float]) -> None:
    """How late this process's event loop wakes a timer (a late load generator reads
    late: its TTFTs would then be its own), and the streams open after the warm-up."""
    loop = asyncio.get_running_loop()
    tick = 0
    while True:
        due_s = loop.time() + SAMPLE_S
        await asyncio.sleep(SAMPLE_S)
        lags_s.append(loop.time() - due_s)
        tick += 1
        if tick % 10 == 0 and window.warmup_end_s <= time.perf_counter() < window.end_s:
            open_streams.append(window.open_streams)


def waited_s(pid: int | str = "self") -> float:
    """Seconds `pid` has spent runnable but waiting for a CPU (/proc/PID/schedstat's
    second field): how much other work on the machine held it up."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


async def run(plan: Plan) -> dict[str, Any]:
    """The run's figures: `others` (the clients never slow), `designated` (the slow share
    reading at full speed, without slow readers), `slow` (with them), `open_streams`
    (sampled between the warm-up and the window's end), `wall_s`, `loadgen_cpu_s` and
    `loadgen_waited_s` (this process's CPU time, and its time waiting for a CPU) and
    `loadgen_lag_ms`."""
    payload = encode_post(plan.host, plan.port, PATH, plan.body.encode())
    cpu_s, waited_before_s = time.process_time(), waited_s()
    window = Window(plan)
    others, designated, slow = Tally(), Tally(), SlowTally()
    tallies: dict[asyncio.Task[None], Tally | SlowTally] = {}
    for index in range(plan.clients):
        client: Coroutine[Any, Any, None]
        tally: Tally | SlowTally
        if not plan.designated(index):
            tally, client = others, normal_client(plan, payload, index, window, others)
        elif plan.slow_readers:
            tally, client = slow, slow_client(plan, payload, index, window, slow)
        else:
            tally, client = designated, normal_client(plan, payload, index, window, designated)
        tallies[asyncio.create_task(client)] = tally
    lags_s: list[float] = []
    open_streams: list[float] = []
    sampler = asyncio.create_task(_sample(window, lags_s, open_streams))
    done, pending = await asyncio.wait(tallies, timeout=plan.window_s + plan.drain_s)
    sampler.cancel()
    for task in pending:
        task.cancel()
        _failed(tallies[task], "abandoned: still open after the window and the drain")
    await asyncio.gather(*pending, return_exceptions=True)
    for task in done:
        if task.exception() is not None:
            _failed(tallies[task], repr(task.exception()))
    return {"others": others.to_json(),
            "slow" if plan.slow_readers else "designated":
                slow.to_json() if plan.slow_readers else designated.to_json(),
            "open_streams": summarize(open_streams),
            "wall_s": time.perf_counter() - window.start_s,
            "loadgen_cpu_s": time.process_time() - cpu_s,
            "loadgen_waited_s": waited_s() - waited_before_s,
            "loadgen_lag_ms": in_ms(summarize(lags_s))}


def main() -> None:
    plan = Plan(**json.loads(sys.argv[1]))
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        print(json.dumps(runner.run(run(plan))), flush=True)


if __name__ == "__main__":
    main()
