"""Stopping the background tasks a service owns; handing on together what one turn of the
event loop produced."""

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

    __slots__ = ("_flush", "_items")

    def __init__(self, flush: Callable[[list[T]], None]) -> None:
        self._flush = flush
        self._items: list[T] = []

    def put(self, item: T) -> None:
        self._items.append(item)
        if len(self._items) == 1:
            asyncio.get_running_loop().call_soon(self.flush_now)

    def flush_now(self) -> None:
        items, self._items = self._items, []
        if items:
            self._flush(items)
