"""The gateway's side of the turn ledger: long-lived streams to the dataproxy, ops by id.

Every relayed turn sends a `BeginTurn` before it calls the worker and a `RecordTurn` (or a
`ReleaseTurn`) when the worker is done, as messages on a `DataProxy.Ledger` stream that many
turns share; each op waits for its answer (matched by id) with its own deadline. One stream
per dataproxy replica (`Replica`: an address of the target, on its own channel); a session's
ops go to the same replica, so the one that recorded its previous turn usually records the
next (it stores only what the turn adds), and a turn's record goes where its begin was admitted.
A stream that breaks fails the ops waiting on it and is reopened by the next op; an op whose
stream broke is retried on another replica's stream (a fresh one with a single replica): a begin
once, a record twice (appending is idempotent by interaction id). A begin that a stopping
dataproxy refused (`dataproxy_stopping`: not started) is retried once on another replica, and
that replica's stream takes no begins until it ends, so a rolling restart of dataproxies
is invisible to clients when the target lists more than one. Each stream is the replica's framed
one when it offers it (services/runtime/framed.py: the same messages on a plain connection,
cheaper per message), else its gRPC `Ledger` call.

`begin_now` and `record_now` send an op at once on an open stream and hand its answer to a
callback, from the stream's read callback, instead of a task waiting for it (the relay starts
the worker, or wakes its caller, right there); an op whose stream broke, or a begin a stopping
dataproxy refused, gets `Unanswered`, and `begin` / `record` take it on with the attempts left.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from protos import common_pb2, dataproxy_pb2
from services.gateway.duplex import BatchedCall
from services.runtime import tracing
from services.runtime.errors import (
    InternalError,
    RollgateError,
    Unavailable,
    UpstreamTimeout,
    from_payload,
    from_rpc_error,
)
from services.runtime.framed import LEDGER_PREAMBLE, PeerStream
from services.runtime.logs import get_logger
from services.runtime.tasks import DeadlineSweep

if TYPE_CHECKING:
    from protos.dataproxy_pb2_grpc import DataProxyAsyncStub

log = get_logger(__name__)

BEGIN_ATTEMPTS = 2
RECORD_ATTEMPTS = 3
RELEASE_ATTEMPTS = 2
# How long an op waits for a replica's channel to connect before its call is tried anyway: a
# restarted replica is reconnected within the channel's reconnect backoff (≤ 2 s).
CONNECT_WAIT_S = 5.0
READY = grpc.ChannelConnectivity.READY
# The dataproxy's answer to a begin while it shuts down (services/dataproxy/ledger_streams.py):
# the turn was not started, so another replica may take it.
STOPPING_CODE = "dataproxy_stopping"


@dataclass(frozen=True, slots=True)
class Replica:
    """One dataproxy replica: the stub its ledger streams open on, its channel (None: a
    test's stub, always taken as reachable) and its address (the host of its framed stream;
    "": the gRPC stream only)."""

    stub: DataProxyAsyncStub
    channel: grpc.aio.Channel | None = field(default=None, kw_only=True)
    address: str = field(default="", kw_only=True)

    def connected(self) -> bool:
        """Whether its channel is connected now (a connection is started when it is not)."""
        if self.channel is None:
            return True
        state = self.channel.get_state(try_to_connect=True)
        return state is READY

    async def wait_connected(self, timeout_s: float) -> None:
        """Returns when its channel is connected, or after `timeout_s` (then a call fails
        fast if it is still down)."""
        if self.channel is None:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while (state := self.channel.get_state(try_to_connect=True)) is not READY:
                    await self.channel.wait_for_state_change(state)


@dataclass(slots=True, kw_only=True)  # not frozen: built every turn (half the cost)
class Admitted:
    """An admitted turn: its ticket (opaque), weight version and session."""

    ticket: bytes
    weight_version: int
    session_id: str


@dataclass(slots=True, kw_only=True)  # not frozen: built every turn (half the cost)
class Recorded:
    """A recorded turn: the interaction id it was recorded under, and its session."""

    interaction_id: str
    session_id: str


class Unanswered:
    """What an op sent at once (`begin_now`, `record_now`) gets when its stream broke or its
    dataproxy refused it as stopping: not answered; the op's coroutine (`begin`, `record`)
    takes it from there, with one attempt fewer and that replica (`replica`) tried."""

    __slots__ = ("replica",)

    def __init__(self, replica: int) -> None:
        self.replica = replica


# Where the answer of an op sent at once goes, from the stream's read callback (or its
# deadline sweep, or its end): the answer, or why there is none.
Settle = Callable[["dataproxy_pb2.LedgerResponse | RollgateError | _StreamLost"], None]


class _StreamLost(Exception):
    """The stream an op was sent on broke before its answer came."""

    def __init__(self, error: RollgateError) -> None:
        super().__init__(error.message)
        self.error = error


class _Stream(BatchedCall[dataproxy_pb2.LedgerRequest]):
    """One open `DataProxy.Ledger` call: ops queued and written together, answers by id.

    `ask` queues its op; everything queued in one turn of the event loop goes out as one
    `LedgerRequests` (`duplex.BatchedCall`).
    A stopping stream (its dataproxy refused a begin as it shuts down) takes no more begins;
    records and releases of the turns it admitted still come here, its drain waits for them.
    """

    def __init__(
        self,
        replica: Replica,
        ledger: LedgerClient,
        *,
        framed: bool,
        on_open: Callable[[str, str], None] | None,
    ) -> None:
        self._ledger = ledger
        self._loop = asyncio.get_running_loop()
        # op id → the future its answer goes to, and its deadline (loop time).
        self._pending: dict[int, tuple[asyncio.Future[dataproxy_pb2.LedgerResponse], float]] = {}
        # op id → the callback its answer goes to (`ask_now`), and its deadline.
        self._answering: dict[int, tuple[Settle, float]] = {}
        # The deadline sweep (services/runtime/tasks.py), armed while ops wait.
        self._sweep = DeadlineSweep(self._expire)
        stub = replica.stub
        self.call = PeerStream(
            open_grpc=stub.Ledger,
            endpoint=stub.LedgerEndpoint if framed and replica.address else None,
            address=replica.address,
            preamble=LEDGER_PREAMBLE,
            parse=dataproxy_pb2.LedgerResponses.FromString,
            peer="dataproxy",
            on_open=on_open,
        )
        super().__init__(self.call, name="ledger")

    async def ask(
        self, request: dataproxy_pb2.LedgerRequest, timeout_s: float
    ) -> dataproxy_pb2.LedgerResponse:
        """The answer to `request`; _StreamLost when the stream broke first."""
        if not self.alive or self._closing:
            raise _StreamLost(_lost())
        loop = self._loop
        answer: asyncio.Future[dataproxy_pb2.LedgerResponse] = loop.create_future()
        self._pending[request.id] = (answer, loop.time() + timeout_s)
        self._queue(request)
        self._sweep.arm()
        try:
            return await answer
        finally:
            self._pending.pop(request.id, None)
            if self._outbox and (answer.cancelled() or answer.exception() is not None):
                # Given up (timed out, cancelled) before it was written: it is never sent.
                self._outbox = [op for op in self._outbox if op is not request]

    def ask_now(
        self, request: dataproxy_pb2.LedgerRequest, timeout_s: float, settle: Settle
    ) -> bool:
        """Queues `request` at once; its answer (or its timeout, or _StreamLost) goes to
        `settle`, called from the read callback — no task waits for it. False (nothing
        queued) when the stream is not taking ops."""
        if not self.alive or self._closing:
            return False
        self._answering[request.id] = (settle, self._loop.time() + timeout_s)
        self._queue(request)
        self._sweep.arm()
        return True

    def _expire(self, now: float) -> bool:
        """The deadline sweep: ops past their deadline fail as timed out; True while any op
        waits."""
        for answer, deadline in self._pending.values():
            if deadline <= now and not answer.done():
                answer.set_exception(_timed_out())
        late = [op for op, (_, deadline) in self._answering.items() if deadline <= now]
        for op in late:
            _settle(self._answering.pop(op)[0], _timed_out())
        return bool(self._pending or self._answering)

    def _batch(self, ops: list[dataproxy_pb2.LedgerRequest]) -> dataproxy_pb2.LedgerRequests:
        return dataproxy_pb2.LedgerRequests(ops=ops)

    def _write_failed(self, err: Exception) -> None:
        self._fail(_error_of(err))

    def _on_message(self, message: dataproxy_pb2.LedgerResponses) -> None:
        for answer in message.answers:
            if answer.id == 0:
                if answer.WhichOneof("result") == "weight_version":
                    self._ledger.saw_version(answer.weight_version)
                continue
            pending = self._pending.get(answer.id)
            if pending is not None:
                if not pending[0].done():
                    pending[0].set_result(answer)
            elif (answering := self._answering.pop(answer.id, None)) is not None:
                _settle(answering[0], answer)

    def _ended(self, error: grpc.aio.AioRpcError | None) -> None:
        self._fail(_error_of(error) if error is not None else _lost())

    def _fail(self, error: RollgateError) -> None:
        """The stream broke: every op waiting on it fails (its caller retries on a new one)."""
        self.alive = False
        self._outbox = []
        for waiter, _ in self._pending.values():
            if not waiter.done():
                waiter.set_exception(_StreamLost(error))
        answering, self._answering = self._answering, {}
        for settle, _ in answering.values():
            _settle(settle, _StreamLost(error))


def _settle(
    settle: Settle, outcome: dataproxy_pb2.LedgerResponse | RollgateError | _StreamLost
) -> None:
    # Called from a read callback, which must not raise: a failing callback is a bug of its
    # owner's (it is logged; the stream and its other ops go on).
    try:
        settle(outcome)
    except Exception as err:
        log.error("ledger_answer_callback_failed", error=type(err).__name__)


def _timed_out() -> RollgateError:
    return UpstreamTimeout("the dataproxy did not answer in time", code="dataproxy_timeout")


def _lost() -> RollgateError:
    return Unavailable(
        "the connection to the dataproxy was lost; retry", code="dataproxy_unavailable",
        retry_after_s=1.0,
    )  # fmt: skip


def _error_of(err: Exception) -> RollgateError:
    if isinstance(err, grpc.aio.AioRpcError):
        return from_rpc_error(err, hop="dataproxy")
    return _lost()


class LedgerClient:
    """Begin, record and release over one ledger stream per dataproxy replica."""

    def __init__(
        self,
        *replicas: DataProxyAsyncStub | Replica,
        framed: bool = True,
        on_open: Callable[[str, str], None] | None = None,
    ) -> None:
        if not replicas:
            raise ValueError("a ledger needs at least one dataproxy")
        self._replicas = [r if isinstance(r, Replica) else Replica(r) for r in replicas]
        # Framed streams where the replicas offer them (services/runtime/framed.py); each
        # stream's (peer, transport) goes to `on_open` as it opens.
        self._framed = framed
        self._on_open = on_open
        self._streams: list[_Stream | None] = [None] * len(self._replicas)
        # ticket → the replica that admitted it (its record and release go there first).
        self._admitted_by: dict[bytes, int] = {}
        self._ids = itertools.count(1)
        self._weight_version = 0

    @property
    def weight_version(self) -> int:
        """The highest weight version any dataproxy announced (streamed tokens carry it)."""
        return self._weight_version

    def saw_version(self, version: int) -> None:
        """A dataproxy announced `version` (versions only move forward)."""
        self._weight_version = max(self._weight_version, version)

    async def begin(
        self,
        *,
        route_key: str,
        digest: str,
        session_id: str,
        request_id: str,
        timeout_s: float,
        attempts: int = BEGIN_ATTEMPTS,
        tried: int | None = None,
    ) -> Admitted:
        """Admission of a turn (waits while submission is paused, up to the dataproxy's wait);
        `tried`: a replica that already failed it (`Unanswered`)."""
        answer, replica = await self._ask(
            route_key,
            _begin_request(digest, session_id, request_id),
            timeout_s=timeout_s,
            attempts=attempts,
            tried=tried,
        )
        return self._admitted(answer, replica)

    def begin_now(
        self,
        *,
        route_key: str,
        digest: str,
        session_id: str,
        request_id: str,
        timeout_s: float,
        then: Callable[[Admitted | RollgateError | Unanswered], None],
    ) -> bool:
        """`begin` without a task waiting: the op is queued at once on its replica's open
        stream and `then` gets, from the read callback, the Admitted, the error the dataproxy
        answered (or its timeout), or Unanswered (`begin` goes on from there). False, and
        nothing sent, when that replica's stream is not open: use `begin`."""
        index = self._choose(route_key, begin=True, tried=set())
        stream = self._streams[index] if index is not None else None
        if stream is None or not stream.alive:
            return False
        request = _begin_request(digest, session_id, request_id)
        self._stamp(request, timeout_s)
        request.id = next(self._ids)

        def settle(outcome: dataproxy_pb2.LedgerResponse | RollgateError | _StreamLost) -> None:
            assert index is not None and stream is not None
            result: Admitted | RollgateError | Unanswered
            if isinstance(outcome, _StreamLost):
                result = Unanswered(index)
            elif isinstance(outcome, RollgateError):
                result = outcome
            elif _refused_as_stopping(outcome):
                stream.stopping = True
                result = Unanswered(index)
            else:
                try:
                    result = self._admitted(outcome, index)
                except RollgateError as err:
                    result = err
            then(result)

        return stream.ask_now(request, timeout_s, settle)

    def _admitted(self, answer: dataproxy_pb2.LedgerResponse, replica: int) -> Admitted:
        admitted = _result(answer, "admitted").admitted
        self.saw_version(admitted.weight_version)
        if len(self._replicas) > 1:
            self._admitted_by[admitted.ticket] = replica
        return Admitted(
            ticket=admitted.ticket,
            weight_version=admitted.weight_version,
            session_id=admitted.session_id,
        )

    async def record(
        self,
        *,
        route_key: str,
        ticket: bytes,
        record: common_pb2.TurnRecord,
        request_json: bytes,
        interaction_id: str,
        turn_type: str,
        session_done: bool,
        request_id: str,
        spans: Sequence[tuple[int, int]] | None,
        timeout_s: float,
        attempts: int = RECORD_ATTEMPTS,
        tried: int | None = None,
    ) -> Recorded:
        """Appends the turn to its episode; `spans` are a streamed turn's (tokens, version)."""
        request = _record_request(
            ticket=ticket,
            record=record,
            request_json=request_json,
            interaction_id=interaction_id,
            turn_type=turn_type,
            session_done=session_done,
            request_id=request_id,
            spans=spans,
        )
        answer, _ = await self._ask(
            route_key,
            request,
            timeout_s=timeout_s,
            attempts=attempts,
            replica=self._admitted_by.pop(ticket, None),
            tried=tried,
        )
        return _recorded(answer)

    def record_now(
        self,
        *,
        route_key: str,
        ticket: bytes,
        record: common_pb2.TurnRecord,
        request_json: bytes,
        interaction_id: str,
        turn_type: str,
        session_done: bool,
        request_id: str,
        spans: Sequence[tuple[int, int]] | None,
        timeout_s: float,
        traceparent: str,
        then: Callable[[Recorded | RollgateError | Unanswered], None],
    ) -> bool:
        """`record` without a task waiting (from a read callback: `traceparent` is the turn's,
        given since no task's context is there): queued at once on the stream of the replica
        that admitted the turn, `then` gets the Recorded, the error, or Unanswered (`record`
        goes on from there). False, and nothing sent, when that stream is not open."""
        index = self._admitted_by.get(ticket)
        if index is None:
            index = self._choose(route_key, begin=False, tried=set())
        stream = self._streams[index] if index is not None else None
        if stream is None or not stream.alive:
            return False
        self._admitted_by.pop(ticket, None)
        request = _record_request(
            ticket=ticket,
            record=record,
            request_json=request_json,
            interaction_id=interaction_id,
            turn_type=turn_type,
            session_done=session_done,
            request_id=request_id,
            spans=spans,
        )
        self._stamp(request, timeout_s, traceparent=traceparent)
        request.id = next(self._ids)

        def settle(outcome: dataproxy_pb2.LedgerResponse | RollgateError | _StreamLost) -> None:
            assert index is not None
            result: Recorded | RollgateError | Unanswered
            if isinstance(outcome, _StreamLost):
                result = Unanswered(index)
            elif isinstance(outcome, RollgateError):
                result = outcome
            else:
                try:
                    result = _recorded(outcome)
                except RollgateError as err:
                    result = err
            then(result)

        return stream.ask_now(request, timeout_s, settle)

    async def release(
        self,
        *,
        route_key: str,
        ticket: bytes,
        timeout_s: float,
        failure: RollgateError | None = None,
        failed_call: str = "",
    ) -> None:
        """The turn ended without a record: its lease goes; `failure` (what the client was
        told, and the call that failed) goes to the console's error list."""
        release = dataproxy_pb2.ReleaseTurn(ticket=ticket)
        if failure is not None:
            release.failure.method = failed_call
            release.failure.status = failure.grpc_status.name
            release.failure.code = failure.code
            release.failure.message = failure.message
        answer, _ = await self._ask(
            route_key,
            dataproxy_pb2.LedgerRequest(release=release),
            timeout_s=timeout_s,
            attempts=RELEASE_ATTEMPTS,
            replica=self._admitted_by.pop(ticket, None),
        )
        _result(answer, "released")

    async def close(self) -> None:
        """Ends every stream (gateway shutdown, after its in-flight turns)."""
        streams = [s for s in self._streams if s is not None]
        self._streams = [None] * len(self._streams)
        for stream in streams:
            await stream.close()

    def _stream(self, replica: int) -> _Stream:
        stream = self._streams[replica]
        if stream is None or not stream.alive:
            stream = self._streams[replica] = _Stream(
                self._replicas[replica], self, framed=self._framed, on_open=self._on_open
            )
        return stream

    def _choose(self, route_key: str, *, begin: bool, tried: set[int]) -> int | None:
        """The replica for an op: the route key's own, else the next one that can take it (an
        open stream, not stopping for a begin; or a connected channel), else the first not
        ruled out; None when all are (`tried`, or stopping for a begin)."""
        if len(self._replicas) == 1:  # the usual case: nothing to choose
            return None if 0 in tried or (begin and self._is_stopping(0)) else 0
        home = self._home(route_key)
        order = [(home + step) % len(self._replicas) for step in range(len(self._replicas))]
        candidates = [
            index
            for index in order
            if index not in tried and not (begin and self._is_stopping(index))
        ]
        for index in candidates:
            if self._is_open(index) or self._replicas[index].connected():
                return index
        return candidates[0] if candidates else None

    def _home(self, route_key: str) -> int:
        return zlib.crc32(route_key.encode()) % len(self._replicas)

    def _is_open(self, replica: int) -> bool:
        stream = self._streams[replica]
        return stream is not None and stream.alive

    def _is_stopping(self, replica: int) -> bool:
        stream = self._streams[replica]
        return stream is not None and stream.alive and stream.stopping

    async def _ask(
        self,
        route_key: str,
        request: dataproxy_pb2.LedgerRequest,
        *,
        timeout_s: float,
        attempts: int,
        replica: int | None = None,
        tried: int | None = None,
    ) -> tuple[dataproxy_pb2.LedgerResponse, int]:
        """The answer to `request` and the replica that gave it; `replica` is tried first,
        `tried` (one that already failed it) last."""
        self._stamp(request, timeout_s)
        begin = request.WhichOneof("op") == "begin"
        ruled_out: set[int] = set() if tried is None else {tried}
        if replica is None:
            index = self._choose(route_key, begin=begin, tried=ruled_out)
        else:
            index = replica
        for attempt in range(attempts):
            last = attempt + 1 == attempts
            if index is None:  # a single replica, or every one stopping: a fresh stream
                index = self._home(route_key)
            request.id = next(self._ids)
            if not self._is_open(index):
                # No replica that can take it is connected: a restarted one may be in its
                # channel's reconnect backoff (a gateway just started: not connected yet).
                await self._replicas[index].wait_connected(min(CONNECT_WAIT_S, timeout_s))
            stream = self._stream(index)
            try:
                answer = await stream.ask(request, timeout_s)
            except _StreamLost as lost:
                if last:
                    raise lost.error from None
                log.warning("ledger_stream_lost_retrying", op=request.WhichOneof("op"))
            else:
                if not (begin and _refused_as_stopping(answer)):
                    return answer, index
                stream.stopping = True
                ruled_out.add(index)
                elsewhere = self._choose(route_key, begin=True, tried=ruled_out)
                if last or elsewhere is None:
                    return answer, index
                # Not started (nothing reached a worker): another replica takes it.
                log.warning("ledger_begin_refused_retrying_elsewhere", replica=index)
                index = elsewhere
                continue
            ruled_out.add(index)
            index = self._choose(route_key, begin=begin, tried=ruled_out)
        raise AssertionError("unreachable")

    def _stamp(
        self, request: dataproxy_pb2.LedgerRequest, timeout_s: float, *, traceparent: str = ""
    ) -> None:
        """An op's deadline and trace (`traceparent`, else the current task's)."""
        request.timeout_s = timeout_s
        if not traceparent:
            trace = tracing.current()
            traceparent = trace.header() if trace is not None else ""
        if traceparent:
            request.traceparent = traceparent


def _begin_request(digest: str, session_id: str, request_id: str) -> dataproxy_pb2.LedgerRequest:
    request = dataproxy_pb2.LedgerRequest()
    op = request.begin
    op.key_digest = digest
    op.session_id = session_id
    op.request_id = request_id
    return request


def _record_request(
    *,
    ticket: bytes,
    record: common_pb2.TurnRecord,
    request_json: bytes,
    interaction_id: str,
    turn_type: str,
    session_done: bool,
    request_id: str,
    spans: Sequence[tuple[int, int]] | None,
) -> dataproxy_pb2.LedgerRequest:
    # Built in place: a message given to a constructor is copied (the record with its token
    # ids, then the whole op).
    request = dataproxy_pb2.LedgerRequest()
    op = request.record
    op.ticket = ticket
    op.record.CopyFrom(record)
    op.request_json = request_json
    op.interaction_id = interaction_id
    op.turn_type = turn_type
    op.session_done = session_done
    op.request_id = request_id
    op.streamed = spans is not None
    for tokens, version in spans or ():
        op.spans.add(tokens=tokens, weight_version=version)
    return request


def _recorded(answer: dataproxy_pb2.LedgerResponse) -> Recorded:
    recorded = _result(answer, "recorded").recorded
    return Recorded(interaction_id=recorded.interaction_id, session_id=recorded.session_id)


def _refused_as_stopping(answer: dataproxy_pb2.LedgerResponse) -> bool:
    if answer.WhichOneof("result") != "error_json":
        return False
    error = from_payload(answer.error_json)
    return error is not None and error.code == STOPPING_CODE


def _result(answer: dataproxy_pb2.LedgerResponse, expected: str) -> dataproxy_pb2.LedgerResponse:
    kind = answer.WhichOneof("result")
    if kind == expected:
        return answer
    if kind == "error_json":
        raise from_payload(answer.error_json) or InternalError(
            "the dataproxy failed the turn; see its logs", code="dataproxy_failed"
        )
    raise InternalError(f"the dataproxy answered {kind} to a {expected} request")
