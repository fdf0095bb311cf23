"""router.supervisor.Supervised: a crash is restarted, a cancellation ends the task."""

from __future__ import annotations

import asyncio

from router.supervisor import Supervised


async def test_a_crash_is_restarted() -> None:
    starts = 0
    ran_again = asyncio.Event()

    async def loop() -> None:
        nonlocal starts
        starts += 1
        if starts == 1:
            raise RuntimeError("a bug in the loop")
        ran_again.set()
        await asyncio.sleep(3600)

    supervised = Supervised("crashing", loop).start()
    async with asyncio.timeout(5):
        await ran_again.wait()
    await supervised.stop()
    assert (starts, supervised.crashes) == (2, 1)


async def test_a_loop_that_fails_as_it_is_cancelled_is_stopped_not_restarted() -> None:
    # redis-py can turn a cancellation in the middle of a command into ConnectionError:
    # the supervisor took that for a crash and started the loop again (the cancel spent),
    # and stop() waited forever.
    starts = 0

    async def loop() -> None:
        nonlocal starts
        starts += 1
        if starts > 1:  # restarted after the cancel: end here, so the test fails, not hangs
            raise asyncio.CancelledError
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise ConnectionError("Connection closed by server.") from None

    supervised = Supervised("redis-loop", loop).start()
    await asyncio.sleep(0.05)
    async with asyncio.timeout(5):
        await supervised.stop()
    assert (starts, supervised.crashes) == (1, 0)
    assert not supervised.running
