"""One request inside the simulated engine, and how a handler waits for its tokens.

The engine appends tokens and timestamps; the HTTP handler that submitted the request
reads them. Waking is one future per waiting handler per engine step, never a task per
token, so that hundreds of concurrent streams stay cheap.
"""

from __future__ import annotations

import asyncio
from enum import Enum, StrEnum

from lab.sim.tokens import Prompt, WordSource


class FinishReason(StrEnum):
    """vLLM's finished_reason label values that the simulator produces."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class SequenceState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A request's progress through queue, prefill and decode.

    Timestamps are in the engine clock's seconds; None until the event has happened.
    `output` holds the generated token texts in order.
    """

    __slots__ = (
        "_finish_waiter",
        "_output_waiter",
        "arrival_s",
        "blocks",
        "cached_tokens",
        "eos_at",
        "finish_reason",
        "finished_s",
        "first_token_s",
        "last_token_s",
        "max_tokens",
        "num_preemptions",
        "output",
        "prompt",
        "request_id",
        "scheduled_s",
        "state",
        "words",
    )

    def __init__(
        self,
        request_id: str,
        prompt: Prompt,
        max_tokens: int,
        eos_at: int | None,
        words: WordSource,
        arrival_s: float,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.eos_at = eos_at
        self.words = words
        self.arrival_s = arrival_s
        self.state = SequenceState.WAITING
        self.output: list[str] = []
        self.finish_reason: FinishReason | None = None
        self.scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.finished_s: float | None = None
        self.cached_tokens = 0
        self.num_preemptions = 0
        self.blocks = 0
        self._output_waiter: asyncio.Future[None] | None = None
        self._finish_waiter: asyncio.Future[None] | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV the sequence holds: prompt plus everything generated so far."""
        return self.prompt.num_tokens + len(self.output)

    @property
    def finished(self) -> bool:
        return self.state is SequenceState.FINISHED

    async def wait_for_output(self, seen: int) -> None:
        """Return once more than `seen` tokens exist or the sequence has finished.

        One handler waits per sequence; if it is cancelled the future is cancelled with
        it and the next call makes a new one.
        """
        if len(self.output) > seen or self.finished:
            return
        if self._output_waiter is None or self._output_waiter.done():
            self._output_waiter = asyncio.get_running_loop().create_future()
        await self._output_waiter

    async def wait_finished(self) -> None:
        if self.finished:
            return
        if self._finish_waiter is None or self._finish_waiter.done():
            self._finish_waiter = asyncio.get_running_loop().create_future()
        await self._finish_waiter

    def notify(self) -> None:
        """Wake the handler after the engine changed `output` or the state."""
        waiter = self._output_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if self.finished:
            waiter = self._finish_waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
