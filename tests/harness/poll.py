"""Waiting for something to become true: the one way tests poll, always with a deadline.

`check` returns a value; the wait ends as soon as it is truthy, or equal to `want` when one
is given, and returns it. An exception raised by `check` (an `assert` of an invariant
included) ends the wait at once: only an unfinished value is waited out. At the deadline the
test fails naming `what` and the last value seen.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 10.0
_ANY = object()


def _done(value: Any, want: Any) -> bool:
    return bool(value) if want is _ANY else bool(value == want)


def _failure(what: str, timeout_s: float, value: Any, want: Any) -> AssertionError:
    wanted = "" if want is _ANY else f", wanted {want!r}"
    return AssertionError(f"{what}: not met within {timeout_s:g} s (last: {value!r}{wanted})")


async def eventually(
    check: Callable[[], T | Awaitable[T]],
    *,
    want: Any = _ANY,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    interval_s: float = 0.02,
    what: str = "the condition",
) -> T:
    """Calls `check` (sync or async) until its value is truthy (or `== want`); that value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if _done(value, want):
            return value  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise _failure(what, timeout_s, value, want)
        await asyncio.sleep(interval_s)


def eventually_sync(
    check: Callable[[], T],
    *,
    want: Any = _ANY,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    interval_s: float = 0.05,
    what: str = "the condition",
) -> T:
    """`eventually` for synchronous tests (processes, HTTP with urllib): sleeps between calls."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if _done(value, want):
            return value
        if time.monotonic() >= deadline:
            raise _failure(what, timeout_s, value, want)
        time.sleep(interval_s)
