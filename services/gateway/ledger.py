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
cheaper per message), else its gRPC `Ledger` call. An admission that arrives after its begin's
caller gave up (cancelled, or past its deadline) is released at once (`_release_abandoned`).
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
# Releasing the lease of a turn that ends without a record (or of an admission whose caller
# is gone) is one small op, answered at once.
RELEASE_TIMEOUT_S = 5.0


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

    def _expire(self, now: float) -> bool:
        """The deadline sweep: ops past their deadline fail as timed out; True while any op
        waits."""
        for answer, deadline in self._pending.values():
            if deadline <= now and not answer.done():
                answer.set_exception(
                    UpstreamTimeout(
                        "the dataproxy did not answer in time", code="dataproxy_timeout"
                    )
                )
        return bool(self._pending)

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
            if pending is not None and not pending[0].done():
                pending[0].set_result(answer)
            elif answer.WhichOneof("result") == "admitted":
                self._release_abandoned(answer.admitted.ticket)

    def _release_abandoned(self, ticket: bytes) -> None:
        """An admission nobody waits for any more (its caller was cancelled, or gave up at its
        deadline, after the begin was sent): its lease is released at once, not left to hold
        a place in flight — and a trainer's pause — until it expires. The release's own
        answer is not waited for."""
        log.info("ledger_abandoned_admission_released")
        request = dataproxy_pb2.LedgerRequest(
            id=self._ledger.next_id(),
            timeout_s=RELEASE_TIMEOUT_S,
            release=dataproxy_pb2.ReleaseTurn(ticket=ticket),
        )
        self._queue(request)

    def _ended(self, error: grpc.aio.AioRpcError | None) -> None:
        self._fail(_error_of(error) if error is not None else _lost())

    def _fail(self, error: RollgateError) -> None:
        """The stream broke: every op waiting on it fails (its caller retries on a new one)."""
        self.alive = False
        self._outbox = []
        for waiter, _ in self._pending.values():
            if not waiter.done():
                waiter.set_exception(_StreamLost(error))


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

    def next_id(self) -> int:
        """A fresh op id (ids are unique per client, over all its streams)."""
        return next(self._ids)

    @property
    def weight_version(self) -> int:
        """The highest weight version any dataproxy announced (streamed tokens carry it)."""
        return self._weight_version

    def saw_version(self, version: int) -> None:
        """A dataproxy announced `version` (versions only move forward)."""
        self._weight_version = max(self._weight_version, version)

    async def begin(
        self, *, route_key: str, digest: str, session_id: str, request_id: str, timeout_s: float
    ) -> Admitted:
        """Admission of a turn (waits while submission is paused, up to the dataproxy's wait)."""
        request = dataproxy_pb2.LedgerRequest()
        op = request.begin
        op.key_digest = digest
        op.session_id = session_id
        op.request_id = request_id
        answer, replica = await self._ask(
            route_key,
            request,
            timeout_s=timeout_s,
            attempts=BEGIN_ATTEMPTS,
        )
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
    ) -> Recorded:
        """Appends the turn to its episode; `spans` are a streamed turn's (tokens, version)."""
        # Built in place: a message given to a constructor is copied (the record with its
        # token ids, then the whole op).
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
        answer, _ = await self._ask(
            route_key,
            request,
            timeout_s=timeout_s,
            attempts=RECORD_ATTEMPTS,
            replica=self._admitted_by.pop(ticket, None),
        )
        recorded = _result(answer, "recorded").recorded
        return Recorded(interaction_id=recorded.interaction_id, session_id=recorded.session_id)

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
    ) -> tuple[dataproxy_pb2.LedgerResponse, int]:
        """The answer to `request` and the replica that gave it; `replica` is tried first."""
        request.timeout_s = timeout_s
        trace = tracing.current()
        if trace is not None:
            request.traceparent = trace.header()
        begin = request.WhichOneof("op") == "begin"
        tried: set[int] = set()
        index = self._choose(route_key, begin=begin, tried=tried) if replica is None else replica
        for attempt in range(attempts):
            last = attempt + 1 == attempts
            if index is None:  # a single replica, or every one stopping: a fresh stream
                index = self._home(route_key)
            request.id = self.next_id()
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
                tried.add(index)
                elsewhere = self._choose(route_key, begin=True, tried=tried)
                if last or elsewhere is None:
                    return answer, index
                # Not started (nothing reached a worker): another replica takes it.
                log.warning("ledger_begin_refused_retrying_elsewhere", replica=index)
                index = elsewhere
                continue
            tried.add(index)
            index = self._choose(route_key, begin=begin, tried=tried)
        raise AssertionError("unreachable")


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
