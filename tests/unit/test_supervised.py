"""router.supervisor.Supervised: a crash is restarted, a cancellation ends the task."""

from __future__ import annotations

import asyncio

import pytest

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


async def test_a_loop_that_swallows_its_cancel_cannot_hang_the_stop(
        caplog: pytest.LogCaptureFixture) -> None:
    """Stopping waits for the loop, cancels it again, then leaves it and says where it
    was: a shutdown must not wait forever on a loop that ignores the first cancel."""
    cancels = 0

    async def stubborn() -> None:
        nonlocal cancels
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancels += 1
                if cancels >= 2:
                    raise

    supervised = Supervised("stubborn", stubborn).start()
    await asyncio.sleep(0.01)
    async with asyncio.timeout(5):
        await supervised.stop(wait_s=0.1)
    assert cancels == 2
    assert "stubborn has not stopped 0.1 s after it was cancelled; cancelling it again" in (
        caplog.text)
    assert "in stubborn" in caplog.text or "stubborn" in caplog.text


async def test_a_loop_that_never_stops_is_left_behind() -> None:
    deaf_to_cancels = True

    async def deaf() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if not deaf_to_cancels:
                    raise

    supervised = Supervised("deaf", deaf).start()
    await asyncio.sleep(0.01)
    async with asyncio.timeout(5):
        await supervised.stop(wait_s=0.1)  # returns: the shutdown goes on
    assert supervised._task is not None and not supervised._task.done()
    deaf_to_cancels = False  # (end it, so that the test's event loop can close)
    async with asyncio.timeout(5):
        await supervised.stop(wait_s=1.0)
    assert supervised._task.done()
