"""The turn ledger's scripts on one dedicated, pipelined Redis connection.

`PipelinedScripts` has the `evalsha` / `eval` of a Redis client (what `LuaScript.run` calls),
but a call only queues its command: the commands queued in one turn of the event loop go out in
one socket write, without waiting for the replies of those sent before (Redis answers in
order, so each reply goes to the oldest caller still waiting). That skips what redis-py does
per command on a pooled client — checking a connection out and back in under its lock, a
health check, a retry wrapper, a task for the write's timeout, a wake-up per reply — which was
most of the dataproxy's CPU per ledger op (docs/internals.md, *The turn ledger*). Commands are
packed in C (`hiredis.pack_command`) and replies parsed in C as they arrive
(`hiredis.Reader`, fed by the connection's protocol): no task reads the connection, a reply
resolves its caller's future straight from the loop's read callback.

Each call still gets its own answer: a script's error (NOSCRIPT included, so `LuaScript.run`
falls back to EVAL, queued in turn) is that call's exception only. The connection is opened on
first use with the client's settings (URL, password, database, TLS, RESP version, timeouts:
redis-py's own connection makes it and runs the handshake, then hands its transport over).
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
from collections.abc import Callable
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis._parsers.base import BaseParser
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse
from redis.exceptions import TimeoutError as RedisTimeoutError

# What `isinstance` takes: the errors a call with `then` answers None for (`or_none`).
ErrorTypes = type[BaseException] | tuple[type[BaseException], ...]

# A command whose connection was lost is sent again on a new one this many times.
RETRIES = 3
# With no socket timeout configured, a reply still must come within this long.
DEFAULT_REPLY_TIMEOUT_S = 30.0


class _Call:
    __slots__ = ("answer", "command", "or_none", "then", "tries")

    def __init__(
        self,
        command: tuple[Any, ...],
        answer: asyncio.Future[Any],
        then: Callable[[Any], Any] | None,
        or_none: ErrorTypes,
    ) -> None:
        self.command = command
        self.answer = answer
        self.then = then
        self.or_none = or_none
        self.tries = 0

    def settle(self, reply: Any) -> None:
        """The reply came: the answer is `then(reply)` (the reply itself without `then`)."""
        if isinstance(reply, Exception):
            self.fail(reply)
        elif self.then is None:
            self.answer.set_result(reply)
        else:
            try:
                self.answer.set_result(self.then(reply))
            except Exception as err:
                self.answer.set_exception(err)

    def fail(self, error: Exception) -> None:
        """The call failed: None when the caller takes `or_none` errors as "not at once"."""
        if self.then is not None and isinstance(error, self.or_none):
            self.answer.set_result(None)
        else:
            self.answer.set_exception(error)


def _pack(connection: AbstractConnection | None, commands: list[tuple[Any, ...]]) -> list[bytes]:
    """The commands in RESP, packed in C by hiredis (a script call with a dozen arguments took
    redis-py's Python encoder ~10 µs, hiredis ~1.6 µs); what hiredis refuses (a memoryview,
    say) is packed by redis-py as before. hiredis writes str as UTF-8 and a float as its
    repr, as redis-py's encoder does with the default encoding."""
    try:
        return [hiredis.pack_command(command) for command in commands]
    except TypeError:
        if connection is None:
            raise
        return list(connection.pack_commands(commands))


class _Replies(asyncio.Protocol):
    """The connection's protocol once its handshake is done: replies, parsed as they come."""

    def __init__(self, owner: PipelinedScripts, *, encoding: str | None) -> None:
        self._owner = owner
        kwargs: dict[str, Any] = {"encoding": encoding} if encoding else {}
        self._reader = hiredis.Reader(
            protocolError=InvalidResponse, replyError=BaseParser.parse_error, **kwargs
        )

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        owner = self._owner
        try:
            while (reply := reader.gets()) is not False:
                owner._answer(reply)
        except InvalidResponse as err:  # not RESP: the connection cannot be trusted
            owner._drop(self, RedisConnectionError(f"Redis sent what is not RESP: {err}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._owner._drop(self, RedisConnectionError("the Redis connection was lost"))


class PipelinedScripts:
    """EVALSHA / EVAL on one connection of a client's settings, pipelined."""

    def __init__(self, redis: aioredis.Redis, *, retries: int = RETRIES) -> None:
        self._pool = redis.connection_pool
        self._retries = retries
        timeout = self._pool.connection_kwargs.get("socket_timeout")
        self._reply_timeout_s = float(timeout) if timeout else DEFAULT_REPLY_TIMEOUT_S
        # Connected and past its handshake: commands are written to its transport directly.
        self._connection: AbstractConnection | None = None
        self._transport: asyncio.WriteTransport | None = None
        self._protocol: _Replies | None = None
        self._writer: asyncio.StreamWriter | None = None
        # Queued in this turn of the loop (or while the connection opens), not sent yet.
        self._queued: list[_Call] = []
        # Sent, in the order Redis answers them.
        self._sent: collections.deque[_Call] = collections.deque()
        # Opens the connection when calls wait and there is none; ends once one is open.
        self._opening: asyncio.Task[None] | None = None
        # The reply deadline: armed while anything is sent and unanswered.
        self._timer: asyncio.TimerHandle | None = None
        self._progress = 0.0
        # Socket writes of commands so far (what the tests count).
        self.writes = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def evalsha(
        self,
        sha: str,
        numkeys: int,
        *keys_and_args: Any,
        then: Callable[[Any], Any] | None = None,
        or_none: ErrorTypes = (),
    ) -> asyncio.Future[Any]:
        """EVALSHA, sent with everything else queued in this turn of the loop. With `then`,
        the future's result is `then(reply)`, computed as the reply is read (no second future
        and callback), or None when the call fails with an `or_none` error; an error of
        `then` is the future's."""
        return self._queue(("EVALSHA", sha, numkeys, *keys_and_args), then, or_none)

    def eval(self, script: str, numkeys: int, *keys_and_args: Any) -> asyncio.Future[Any]:
        """EVAL (a script Redis does not have cached), sent like EVALSHA."""
        return self._queue(("EVAL", script, numkeys, *keys_and_args), None, ())

    async def aclose(self) -> None:
        """Ends the connection (calls still waiting get ConnectionError)."""
        if self._opening is not None:
            self._opening.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._opening
            self._opening = None
        closed = RedisConnectionError("the Redis connection was closed")
        self._fail_all(closed)
        transport, self._transport, self._protocol = self._transport, None, None
        self._connection = None
        if transport is not None:
            transport.close()
        self._writer = None

    def _queue(
        self,
        command: tuple[Any, ...],
        then: Callable[[Any], Any] | None,
        or_none: ErrorTypes,
    ) -> asyncio.Future[Any]:
        loop = self._loop
        if loop is None:
            # The connection, its timer and its callbacks belong to the loop of the first
            # call (asyncio.get_running_loop costs a getpid system call each time).
            loop = self._loop = asyncio.get_running_loop()
        answer: asyncio.Future[Any] = loop.create_future()
        self._queued.append(_Call(command, answer, then, or_none))
        if len(self._queued) == 1:
            # After every callback already scheduled: the other ops of the same message.
            loop.call_soon(self._flush)
        return answer

    def _flush(self) -> None:
        if self._transport is not None:
            self._send()
        elif self._queued:
            self._open()

    def _send(self) -> None:
        """Writes what is queued on the open connection (a transport that cannot take it is
        dropped: the calls are sent again on a new connection)."""
        calls = [c for c in self._queued if not c.answer.done()]
        self._queued = []
        transport = self._transport
        if not calls or transport is None:
            return
        self._sent.extend(calls)
        try:
            if transport.is_closing():
                raise RuntimeError("closed")
            transport.writelines(_pack(self._connection, [c.command for c in calls]))
        except (OSError, RuntimeError):  # uvloop: a closed transport raises
            self._drop(self._protocol, RedisConnectionError("the Redis connection was lost"))
            return
        self.writes += 1
        if self._timer is None:
            self._progress = self._time()
            self._arm(self._reply_timeout_s)

    def _answer(self, reply: Any) -> None:
        if not self._sent:
            return  # a reply nothing waits for (cannot happen on a healthy connection)
        call = self._sent.popleft()
        self._progress = self._time()
        if not call.answer.done():
            call.settle(reply)

    # The reply deadline

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop or asyncio.get_running_loop()

    def _time(self) -> float:
        return self._running_loop().time()

    def _arm(self, after_s: float) -> None:
        self._timer = self._running_loop().call_later(after_s, self._check_deadline)

    def _check_deadline(self) -> None:
        self._timer = None
        if not self._sent:
            return
        waited = self._time() - self._progress
        if waited < self._reply_timeout_s:
            self._arm(self._reply_timeout_s - waited)
            return
        # No reply in time: everything sent on the connection fails (not retried), and the
        # connection goes (a late reply would answer the wrong caller).
        error = RedisTimeoutError("Timeout reading from Redis")
        sent, self._sent = list(self._sent), collections.deque()
        for call in sent:
            if not call.answer.done():
                call.fail(error)
        self._drop(self._protocol, RedisConnectionError("the Redis connection timed out"))

    # The connection

    def _open(self) -> None:
        if self._opening is None or self._opening.done():
            self._opening = asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        connection = self._pool.connection_class(**self._pool.connection_kwargs)
        try:
            # Retries as the client's settings say (open_redis: reconnects).
            await connection.connect()  # type: ignore[no-untyped-call]
            writer = connection._writer
            if writer is None:
                raise RedisConnectionError("the Redis connection closed as it opened")
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await connection.disconnect(nowait=True)
            raise
        except Exception as err:
            # Nothing could be sent: every call waiting fails with why.
            self._fail_all(err if isinstance(err, RedisConnectionError) else _wrapped(err))
            with contextlib.suppress(Exception):
                await connection.disconnect(nowait=True)
            return
        transport = writer.transport
        encoder = connection.encoder
        protocol = _Replies(self, encoding=encoder.encoding if encoder.decode_responses else None)
        transport.set_protocol(protocol)
        # The transport is ours now: redis-py's connection keeps only its settings (it packs
        # what hiredis refuses) and does not close what it no longer reads. Its stream writer
        # is held until the transport closes (collected, it would close the transport).
        connection._reader = connection._writer = None
        self._writer = writer
        self._connection, self._transport, self._protocol = connection, transport, protocol
        self._send()

    def _drop(self, protocol: _Replies | None, error: Exception) -> None:
        """The connection of `protocol` failed: it goes, and each call sent on it or waiting
        is sent again on a new one (up to the retries) or fails with `error`."""
        if protocol is None or protocol is not self._protocol:
            return  # an older connection's news
        transport = self._transport
        self._connection, self._transport, self._protocol = None, None, None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        again: list[_Call] = []
        for call in (*self._sent, *self._queued):
            if call.answer.done():
                continue
            call.tries += 1
            if call.tries <= self._retries:
                again.append(call)
            else:
                call.fail(error)
        self._sent.clear()
        self._queued = again
        if transport is not None:
            transport.abort()
        self._writer = None
        if again:
            self._open()

    def _fail_all(self, error: Exception) -> None:
        for call in (*self._sent, *self._queued):
            if not call.answer.done():
                call.fail(error)
        self._sent.clear()
        self._queued = []
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _wrapped(err: Exception) -> RedisConnectionError:
    wrapped = RedisConnectionError(f"cannot connect to Redis ({type(err).__name__})")
    wrapped.__cause__ = err
    return wrapped
