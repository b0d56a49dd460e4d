"""The turn ledger's scripts on one dedicated, pipelined Redis connection.

`PipelinedScripts` has the `evalsha` / `eval` of a Redis client (what `LuaScript.run` calls),
but a call only queues its command: the commands queued in one turn of the event loop go out in
one socket write, without waiting for the replies of those sent before (Redis answers in
order, so each reply goes to the oldest caller still waiting). That skips what redis-py does
per command on a pooled client — checking a connection out and back in under its lock, a
health check, a retry wrapper, a task for the write's timeout, a wake-up per reply — which was
most of the dataproxy's CPU per ledger op (docs/internals.md, *The turn ledger*).

Each call still gets its own answer: a script's error (NOSCRIPT included, so `LuaScript.run`
falls back to EVAL, queued in turn) is that call's exception only. The connection is opened on
first use with the client's settings (URL, password, database, TLS, RESP version, timeouts).
A reply that does not come within the client's socket timeout fails every call waiting on the
connection (`redis.exceptions.TimeoutError`, never retried, as `open_redis` decides); a lost
connection is opened again and the calls sent on it are sent again, up to `retries` times
(scripts are idempotent by design, as for the pooled client); a connection that cannot be
opened (after the client's own reconnect retries) fails the calls waiting for it. A
caller that gives up (its timeout, its cancellation) leaves the others alone: a command not
yet sent is dropped, a reply that comes for it is read and ignored.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

# A command whose connection was lost is sent again on a new one this many times.
RETRIES = 3


class _Call:
    __slots__ = ("answer", "command", "tries")

    def __init__(self, command: tuple[Any, ...], answer: asyncio.Future[Any]) -> None:
        self.command = command
        self.answer = answer
        self.tries = 0


class PipelinedScripts:
    """EVALSHA / EVAL on one connection of a client's settings, pipelined."""

    def __init__(self, redis: aioredis.Redis, *, retries: int = RETRIES) -> None:
        self._pool = redis.connection_pool
        self._retries = retries
        # Connected and past its handshake: commands are written to it directly.
        self._connection: AbstractConnection | None = None
        # Queued in this turn of the loop (or while the connection opens), not sent yet.
        self._queued: list[_Call] = []
        # Sent, in the order Redis answers them.
        self._sent: collections.deque[_Call] = collections.deque()
        # Connects and reads replies while anything is outstanding; ends when nothing is.
        self._worker: asyncio.Task[None] | None = None

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> asyncio.Future[Any]:
        """EVALSHA, sent with everything else queued in this turn of the loop."""
        return self._queue(("EVALSHA", sha, numkeys, *keys_and_args))

    def eval(self, script: str, numkeys: int, *keys_and_args: Any) -> asyncio.Future[Any]:
        """EVAL (a script Redis does not have cached), sent like EVALSHA."""
        return self._queue(("EVAL", script, numkeys, *keys_and_args))

    async def aclose(self) -> None:
        """Ends the connection (calls still waiting get ConnectionError)."""
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
            self._worker = None
        closed = RedisConnectionError("the Redis connection was closed")
        for call in (*self._sent, *self._queued):
            if not call.answer.done():
                call.answer.set_exception(closed)
        self._sent.clear()
        self._queued = []
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.disconnect()

    def _queue(self, command: tuple[Any, ...]) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Any] = loop.create_future()
        self._queued.append(_Call(command, answer))
        if len(self._queued) == 1:
            # After every callback already scheduled: the other ops of the same message.
            loop.call_soon(self._flush)
        return answer

    def _flush(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(RedisConnectionError):
                # A connection Redis closed while idle refuses the write: the calls stay
                # queued, and the worker finds it lost and sends them on a new one.
                self._send(self._connection)
        if self._queued or self._sent:
            self._ensure_worker()

    def _send(self, connection: AbstractConnection) -> None:
        """Writes what is queued; on a connection that cannot take it, RedisConnectionError
        with every call still queued (none is ever dropped unanswered)."""
        calls = [c for c in self._queued if not c.answer.done()]
        if not calls:
            self._queued = []
            return
        writer = connection._writer
        if writer is None or writer.transport.is_closing():
            raise RedisConnectionError("the Redis connection was lost")
        try:
            writer.writelines(connection.pack_commands(c.command for c in calls))
        except (OSError, RuntimeError) as err:  # uvloop: a closed transport raises
            raise RedisConnectionError("the Redis connection was lost") from err
        self._queued = []
        self._sent.extend(calls)

    def _ensure_worker(self) -> None:
        if self._worker is None or self._worker.done():
            self._worker = asyncio.ensure_future(self._work())

    async def _work(self) -> None:
        while self._sent or self._queued:
            try:
                connection = self._connection
                if connection is None:
                    connection = self._pool.connection_class(**self._pool.connection_kwargs)
                    try:
                        # Retries as the client's settings say (open_redis: reconnects).
                        await connection.connect()  # type: ignore[no-untyped-call]
                    except Exception as err:
                        await self._lost(err, retry=False)
                        continue
                    self._connection = connection
                    self._send(connection)  # what waited for it (else `_flush` sends)
                    continue
                # With nothing sent yet (a `_flush` is due, or it could not write to this
                # connection: the read then finds it lost) this waits for the reply to come.
                await self._read_one(connection)
            except RedisConnectionError as err:
                await self._lost(err, retry=True)
            except Exception as err:  # a timeout, a protocol error: nothing is retried
                await self._lost(err, retry=False)

    async def _read_one(self, connection: AbstractConnection) -> None:
        try:
            reply = await connection.read_response()
        except ResponseError as err:
            reply = err
        call = self._sent.popleft()
        if call.answer.done():
            return
        if isinstance(reply, Exception):
            call.answer.set_exception(reply)
        else:
            call.answer.set_result(reply)

    async def _lost(self, err: Exception, *, retry: bool) -> None:
        """The connection failed: it is dropped, and each call sent or waiting on it is sent
        again on the next (`retry`, up to the retries) or fails with `err`."""
        connection, self._connection = self._connection, None
        again: list[_Call] = []
        for call in (*self._sent, *self._queued):
            if call.answer.done():
                continue
            call.tries += 1
            if retry and call.tries <= self._retries:
                again.append(call)
            else:
                call.answer.set_exception(err)
        self._sent.clear()
        self._queued = again
        if connection is not None:
            await connection.disconnect(nowait=True)
