"""One open bidirectional call that many turns share: ops queued and written together.

The turn ledger (`ledger.py`) and the worker streams (`worker_calls.py`) both keep one long-lived
call per peer: callers queue ops, one writer task sends everything queued as one message
(grpc.aio allows one write in flight per call, and a message costs the same whatever it
carries), one reader task hands the answers on. What differs is the message and what an answer
or a failure does: `_batch`, `_read`, `_write_failed` and `_fail`.
"""

from __future__ import annotations

import asyncio
from typing import Any, Generic, TypeVar

from services.runtime.tasks import cancel_and_wait

Op = TypeVar("Op")


class BatchedCall(Generic[Op]):
    def __init__(self, call: Any, *, name: str) -> None:
        self._call = call
        self._outbox: list[Op] = []
        self._queued = asyncio.Event()
        self._closing = False
        self.alive = True
        # The peer said it is shutting down: new work goes elsewhere (what it started still
        # comes here).
        self.stopping = False
        self._writer = asyncio.create_task(self._write(), name=f"{name}-writer")
        self._reader = asyncio.create_task(self._reading(), name=f"{name}-reader")

    def _batch(self, ops: list[Op]) -> Any:
        raise NotImplementedError

    async def _read(self) -> None:
        raise NotImplementedError

    def _write_failed(self, err: Exception) -> None:
        raise NotImplementedError

    async def _reading(self) -> None:
        try:
            await self._read()
        finally:
            # The call is over (ended or broken): nothing more goes out, so the writer stops
            # too (else it waited forever and was destroyed pending with the stream).
            self._writer.cancel()

    def _queue(self, op: Op) -> None:
        self._outbox.append(op)
        self._queued.set()

    async def _write(self) -> None:
        try:
            while True:
                if not self._outbox:
                    if self._closing:
                        await self._call.done_writing()
                        return
                    self._queued.clear()
                    await self._queued.wait()
                    continue
                ops, self._outbox = self._outbox, []
                await self._call.write(self._batch(ops))
        except Exception as err:  # any broken write fails what waits on the call
            self._write_failed(err)

    async def close(self) -> None:
        """Half-closes the call (after what is queued is written), then stops reading."""
        self._closing = True
        self._queued.set()
        if self.alive:
            # Each ends on its own: the writer after what is queued, the reader at the peer's
            # end (which stops the writer: waited for, a cancelled writer is no error here).
            await asyncio.wait((self._writer, self._reader), timeout=1.0)
        self._call.cancel()
        await cancel_and_wait(self._writer)
        await cancel_and_wait(self._reader)
