"""Stopping the background tasks a service owns; handing on together what one turn of the
event loop produced; one timer for the deadlines of many operations."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancels `task` and waits until it has finished unwinding."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class PerLoopTurn(Generic[T]):
    """Items handed on together: everything `put` in one turn of the event loop goes to
    `flush` as one list, from a callback scheduled after them (so the other callbacks of that
    turn add theirs first), without a task waking per item. `flush_now` hands on what is
    waiting at once (a stream about to end)."""

    __slots__ = ("_flush", "_items", "_loop")

    def __init__(self, flush: Callable[[list[T]], None]) -> None:
        self._flush = flush
        self._items: list[T] = []
        # The loop of the first put (asyncio.get_running_loop costs a getpid system call).
        self._loop: asyncio.AbstractEventLoop | None = None

    def put(self, item: T) -> None:
        self._items.append(item)
        if len(self._items) == 1:
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            loop.call_soon(self.flush_now)

    def flush_now(self) -> None:
        items, self._items = self._items, []
        if items:
            self._flush(items)


# How often a DeadlineSweep looks for operations past their deadline: one ends at most this
# much after it (one timer for all instead of an `asyncio.timeout` per operation, ≈ 4 to 5 µs
# each, a tenth of a ledger op).
DEADLINE_SWEEP_S = 0.05


class DeadlineSweep:
    """One timer for the deadlines of many operations: `arm` when one starts; every
    `interval_s` the owner's `sweep(now)` ends what is past its deadline (loop time) and says
    whether any operation is still under way — the timer runs again only then."""

    __slots__ = ("_interval_s", "_loop", "_sweep", "_timer")

    def __init__(self, sweep: Callable[[float], bool], interval_s: float = DEADLINE_SWEEP_S):
        self._sweep = sweep
        self._interval_s = interval_s
        self._timer: asyncio.TimerHandle | None = None
        # The loop of the first arm (asyncio.get_running_loop costs a getpid system call).
        self._loop: asyncio.AbstractEventLoop | None = None

    def arm(self) -> None:
        """Makes sure the sweep runs while operations are under way."""
        if self._timer is None:
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self._interval_s, self._run)

    def _run(self) -> None:
        self._timer = None
        loop = self._loop or asyncio.get_running_loop()
        if self._sweep(loop.time()):
            self._timer = loop.call_later(self._interval_s, self._run)
