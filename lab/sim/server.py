"""Run the simulator on a TCP port, in this event loop: for the CLI and for tests.

async with SimServer(SimConfig(), port=0) as sim:
    client = AsyncOpenAI(base_url=sim.url + "/v1", api_key="unused")
"""

from __future__ import annotations

from types import TracebackType

from aiohttp import web

from lab.sim.api import build_app
from lab.sim.clock import Clock
from lab.sim.config import SimConfig

# Streams in flight get this long to finish when the server stops; then they are cut.
SHUTDOWN_GRACE_S = 1.0


class SimServer:
    """One simulator app behind an aiohttp runner on `host:port` (0 = any free port)."""

    def __init__(
        self,
        config: SimConfig,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        clock: Clock | None = None,
    ) -> None:
        self.config = config
        self._host = host
        self._port = port
        self._clock = clock
        self._runner: web.AppRunner | None = None
        self.port = port

    @property
    def url(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}"

    async def start(self) -> str:
        """Listen; returns the base URL (with the real port when 0 was asked for)."""
        runner = web.AppRunner(
            build_app(self.config, clock=self._clock),
            handler_cancellation=True,  # a client that goes away aborts its sequence
            access_log=None,  # one log line per request costs too much on a 2-core box
            shutdown_timeout=SHUTDOWN_GRACE_S,
        )
        await runner.setup()
        site = web.TCPSite(runner, self._host, self._port)
        await site.start()
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def __aenter__(self) -> SimServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.stop()
