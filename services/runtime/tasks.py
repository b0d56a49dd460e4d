"""Stopping the background tasks a service owns."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancels `task` and waits until it has finished unwinding."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
