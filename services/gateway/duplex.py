"""One open bidirectional call that many turns share: ops queued and written together.

The turn ledger (`ledger.py`) and the worker streams (`worker_calls.py`) both keep one long-lived
call per peer: callers queue ops, and everything queued in one turn of the event loop goes out
as one message (a message costs the same whatever it carries). What differs is the message and
what an answer or a failure does: `_batch`, `_on_message`, `_write_failed` and `_fail`.

On a framed stream (services/runtime/framed.py, the usual case) no task runs per message: the
ops queued in a turn of the loop are written by one callback scheduled after them, straight to
the connection, and each message read is handed to `_on_message` from the connection's read
callback. A writer task takes over when that cannot be done at once — the stream still opening,
the peer behind (its side of the connection full), the gRPC stream (one write in flight per
call) — and a reader task reads the gRPC stream; on a framed one it only waits for the end.
"""

from __future__ import annotations

import asyncio
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf.message import Message

from services.runtime.framed import Batch, FramedCall, PeerStream
from services.runtime.tasks import cancel_and_wait

Op = TypeVar("Op", bound=Message)


class BatchedCall(Generic[Op]):
    def __init__(self, call: PeerStream, *, name: str) -> None:
        self._call = call
        self._outbox: list[Op] = []
        self._queued = asyncio.Event()
        self._closing = False
        self.alive = True
        # The peer said it is shutting down: new work goes elsewhere (what it started still
        # comes here).
        self.stopping = False
        # The framed call once open: ops are written to it from `_flush`.
        self._direct: FramedCall[Any] | None = None
        self._flush_due = False
        # The writer task holds a batch it has not handed to the call yet (a direct write
        # then would overtake it).
        self._writing = False
        # The end of our side is written: nothing more goes out.
        self._eof = False
        # Its tasks' loop (asyncio.get_running_loop costs a getpid system call each time).
        self.loop = asyncio.get_running_loop()
        self._writer = asyncio.create_task(self._write(), name=f"{name}-writer")
        self._reader = asyncio.create_task(self._reading(), name=f"{name}-reader")

    def _batch(self, ops: list[Op]) -> Any:
        raise NotImplementedError

    def _on_message(self, message: Any) -> None:
        """One message from the peer (must not raise)."""
        raise NotImplementedError

    def _write_failed(self, err: Exception) -> None:
        raise NotImplementedError

    def _ended(self, error: grpc.aio.AioRpcError | None) -> None:
        """The call is over: ended by the peer (`error` None) or broken."""
        raise NotImplementedError

    async def _reading(self) -> None:
        error: grpc.aio.AioRpcError | None = None
        try:
            framed = await self._call.framed()
            if framed is not None:
                ended: asyncio.Future[None] = self.loop.create_future()

                def end() -> None:
                    if not ended.done():
                        ended.set_result(None)

                framed.listen(self._on_message, end)
                self._direct = framed
                if self._outbox:
                    self._schedule_flush()
                await ended
                error = framed.ended_by()
            else:
                while (message := await self._call.read()) is not grpc.aio.EOF:
                    self._on_message(message)
        except grpc.aio.AioRpcError as err:
            error = err
        finally:
            self._direct = None
            # The call is over (ended or broken): nothing more goes out, so the writer stops
            # too (else it waited forever and was destroyed pending with the stream).
            self._writer.cancel()
            self._ended(error)

    def _queue(self, op: Op) -> None:
        self._outbox.append(op)
        if self._direct is not None:
            self._schedule_flush()
        else:
            self._queued.set()

    def _schedule_flush(self) -> None:
        if not self._flush_due:
            self._flush_due = True
            # After every callback already scheduled: the other ops of this turn of the loop.
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        direct = self._direct
        if not self._outbox or not self.alive or self._eof:
            return
        if direct is None or self._writing or not direct.writable:
            self._queued.set()  # the writer task waits until it can go
            return
        ops, self._outbox = self._outbox, []
        try:
            direct.send_now(Batch(ops))
        except Exception as err:  # a message too large, a connection that just broke
            self._write_failed(err)

    async def _write(self) -> None:
        try:
            while True:
                if not self._outbox:
                    if self._closing:
                        self._eof = True
                        await self._call.done_writing()
                        return
                    self._queued.clear()
                    await self._queued.wait()
                    continue
                ops, self._outbox = self._outbox, []
                self._writing = True
                try:
                    await self._call.write(self._batch(ops))
                finally:
                    self._writing = False
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
