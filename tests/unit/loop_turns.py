"""Counting the event loop's turns while a coroutine runs: whether it lets others run."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def with_turns(work: Awaitable[T]) -> tuple[T, int]:
    """`work`'s result, and how many times another task got to run while it was awaited
    (0 for a coroutine that never yields)."""
    turns = 0

    async def ticker() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    started = turns
    try:
        result = await work
    finally:
        task.cancel()
    return result, turns - started
