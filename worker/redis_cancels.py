"""Redis connections that keep their task's cancel.

redis-py sends each command under `asyncio.wait_for` when a socket timeout is set, and on
Python 3.11 a cancel that arrives as the send finishes is dropped there: the command then
returns as if nothing happened, and a loop that is being stopped goes on (measured: 81 of
300 loops of SET against a local Valkey, cancelled at random moments, never stopped; a
test's shutdown hung on one). Every client worker.redis_client opens uses these
connections.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar, cast

from redis.asyncio.connection import AbstractConnection


class _KeepsCancels:
    """A connection that does not drop its task's cancel while sending (see the module
    doc): a cancel that redis-py's `asyncio.wait_for` swallowed is raised once the send
    returns, and the connection is closed (its reply is never read), as redis-py does for
    a cancel while it reads."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        task = asyncio.current_task()
        before = task.cancelling() if task is not None else 0
        await super().send_packed_command(command, check_health)  # type: ignore[misc]
        if task is not None and task.cancelling() > before:
            await cast(AbstractConnection, self).disconnect(nowait=True)
            raise asyncio.CancelledError


_KEEPING: dict[type[AbstractConnection], type[Any]] = {}
C = TypeVar("C", bound=AbstractConnection)


def keeping_cancels(connection_class: type[C]) -> type[C]:
    """`connection_class` (plain, TLS, Unix socket, a sentinel's) with `_KeepsCancels`."""
    if issubclass(connection_class, _KeepsCancels):
        return connection_class
    if connection_class not in _KEEPING:
        _KEEPING[connection_class] = type(f"{connection_class.__name__}KeepingCancels",
                                          (_KeepsCancels, connection_class), {})
    return _KEEPING[connection_class]
