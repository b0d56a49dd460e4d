"""The ledger streams of one dataproxy process: many turns' begin and record over one stream.

A gateway keeps one `DataProxy.Ledger` stream open per dataproxy replica and sends every turn's
`BeginTurn`, `RecordTurn` and `ReleaseTurn` over it, each with an id; answers come back with
the id, in any order (a begin waiting while submission is paused holds up nothing else). A
message on an open stream costs a fraction of a unary RPC, and the cost is per message, not
per op: the gateway sends the ops that were ready together in one `LedgerRequests`, and the
answers that are ready when the stream can write go out together in one `LedgerResponses`
(docs/internals.md, *The turn ledger*). The weight version is pushed on every stream when it moves (id 0), so the gateway
stamps each streamed batch's tokens with the version current as it passes.

Turns admitted through a stream and not yet recorded or released are remembered; when the
stream ends (the gateway went away) their leases are released. Shutdown (`close`) refuses new
begins, waits for the admitted turns to be recorded or released (they finish on the workers
and come back over the same streams), then ends every stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from protos import dataproxy_pb2
from services.dataproxy.control import WeightVersionView
from services.dataproxy.turn_ledger import (
    Admission,
    RecordedTurn,
    TurnEnd,
    TurnLedger,
    decode_ticket,
)
from services.runtime.errors import InvalidRequest, RollgateError, Unavailable
from services.runtime.framed import Batch, Sendable, take_each
from services.runtime.grpc_server import as_rollgate_error
from services.runtime.logs import get_logger
from services.runtime.tasks import DeadlineSweep, PerLoopTurn, cancel_and_wait
from services.runtime.tracing import Span, TraceContext, Tracer

log = get_logger(__name__)

METHOD = "/rollgate.v1.DataProxy/Ledger"
# An op without a timeout gets this one (every op has a deadline).
DEFAULT_OP_TIMEOUT_S = 30.0
CLOSING = "this dataproxy is shutting down; the turn was not started, retry"
# While shutting down, a stream with nothing under way ends after this long idle.
CLOSING_IDLE_S = 0.25


class _Stream:
    """One open ledger stream: its answers and the turns admitted through it.

    The answers ready in one turn of the event loop go out as one `LedgerResponses`: written
    by a callback scheduled after them (`direct`: a framed stream's send), or queued for
    `serve` to yield (a gRPC stream's). The queue also carries the stream's end (None)."""

    def __init__(self, direct: Callable[[Sendable], None] | None = None) -> None:
        self.answers: asyncio.Queue[dataproxy_pb2.LedgerResponse | None] = asyncio.Queue()
        # lease token → ticket of turns admitted here, neither recorded nor released yet.
        self.admitted: dict[str, bytes] = {}
        # The ops under way (a task, or the future of one sent without a task) → their
        # deadlines (loop time).
        self.ops: dict[asyncio.Future[Any], float] = {}
        self.direct: PerLoopTurn[dataproxy_pb2.LedgerResponse] | None = None
        if direct is not None:
            self.direct = PerLoopTurn(lambda answers: direct(Batch(answers)))

    def put(self, answer: dataproxy_pb2.LedgerResponse) -> None:
        if self.direct is not None:
            self.direct.put(answer)
        else:
            self.answers.put_nowait(answer)


# Called with (op, gRPC status code name, seconds, error message) as each op ends: the
# process's RPC metrics count ledger ops like RPCs (method `Ledger.<op>`). Must not block.
OpHook = Callable[[str, str, float, str], None]
# Called with a failed turn's TurnFailure (from its release: the gateway called the worker, so
# no RPC of this process saw it fail). Must not block.
FailureHook = Callable[[dataproxy_pb2.TurnFailure], None]


class LedgerStreams:
    """Serves the ledger streams of this process over one TurnLedger."""

    def __init__(
        self,
        *,
        ledger: TurnLedger,
        versions: WeightVersionView,
        on_op: OpHook | None = None,
        on_failure: FailureHook | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self._ledger = ledger
        self._versions = versions
        self._on_op = on_op
        self._on_failure = on_failure
        self._tracer = tracer
        self._streams: set[_Stream] = set()
        self._closing = False
        self._drained = asyncio.Event()
        # The deadline sweep (services/runtime/tasks.py, armed while ops are under way) and
        # the ops it timed out.
        self._sweep = DeadlineSweep(self._expire)
        self._expired: set[asyncio.Future[Any]] = set()

    @property
    def unfinished(self) -> int:
        """Turns admitted through an open stream, neither recorded nor released."""
        return sum(len(s.admitted) for s in self._streams)

    async def serve(
        self,
        requests: AsyncIterator[dataproxy_pb2.LedgerRequests],
        *,
        send: Callable[[Sendable], None] | None = None,
    ) -> AsyncIterator[dataproxy_pb2.LedgerResponses]:
        """One stream's answers, until the gateway closes its side (and what it asked is
        answered) or this process shuts the stream down. Each message carries every answer
        that was ready in one turn of the loop (a gRPC stream's: when the previous one had
        gone). With `send` (a framed stream) the answers go to it instead of being yielded."""
        stream = _Stream(send)
        self._streams.add(stream)
        unsubscribe = self._versions.listen(
            lambda v: stream.put(dataproxy_pb2.LedgerResponse(weight_version=v))
        )
        # The gateway's view starts from this process's.
        stream.put(dataproxy_pb2.LedgerResponse(weight_version=self._versions.current))
        reader = asyncio.create_task(self._read(stream, requests), name="ledger-reader")
        answers = stream.answers
        try:
            # None: the stream ends (the gateway closed its side, or this process shuts down).
            while (answer := await self._next_answer(stream)) is not None:
                batch = dataproxy_pb2.LedgerResponses()
                batch.answers.append(answer)
                ended = False
                while not answers.empty():
                    more = answers.get_nowait()
                    if more is None:
                        ended = True
                        break
                    batch.answers.append(more)
                yield batch
                if ended:
                    break
            if stream.direct is not None:
                stream.direct.flush_now()  # answers still waiting go out before the end
        finally:
            unsubscribe()
            await cancel_and_wait(reader)
            # What is under way finishes (a record lands even when the gateway went away; an
            # op sent without a task may hand over to one as it ends).
            while stream.ops:
                await asyncio.wait(set(stream.ops))
            self._streams.discard(stream)
            await self._release_unfinished(stream)
            self._check_drained()

    async def _next_answer(self, stream: _Stream) -> dataproxy_pb2.LedgerResponse | None:
        """The stream's next answer; None when it ends. While this process shuts down, a
        stream idle for CLOSING_IDLE_S with nothing of its own under way ends too (one a
        gateway opened after the drain ended the others, its begins refused: else the stop
        waits it out for the grace); the gateway takes what else it has to another replica."""
        if not self._closing:
            return await stream.answers.get()
        while True:
            try:
                async with asyncio.timeout(CLOSING_IDLE_S):
                    return await stream.answers.get()
            except TimeoutError:
                if not stream.ops and not stream.admitted:
                    return None

    async def close(self, timeout_s: float) -> None:
        """Refuses new turns, waits (≤ timeout_s) until every admitted turn is recorded or
        released, then ends every stream."""
        self._closing = True
        self._check_drained()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._drained.wait()
        if self.unfinished:
            log.warning("ledger_closed_with_unfinished_turns", turns=self.unfinished)
        for stream in list(self._streams):
            stream.answers.put_nowait(None)

    def _check_drained(self) -> None:
        if self._closing and self.unfinished == 0:
            self._drained.set()

    async def _read(
        self, stream: _Stream, requests: AsyncIterator[dataproxy_pb2.LedgerRequests]
    ) -> None:
        try:
            loop = asyncio.get_running_loop()
            await take_each(requests, lambda batch: self._take(stream, batch, loop), name="ledger")
        finally:
            # The gateway closed its side (or went away): answer what it asked, then end.
            while stream.ops:
                await asyncio.wait(set(stream.ops))
            stream.answers.put_nowait(None)

    def _take(
        self,
        stream: _Stream,
        batch: dataproxy_pb2.LedgerRequests,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        """Starts each op of one message: sent at once when it can be, else in a task."""
        for request in batch.ops:
            deadline = loop.time() + (request.timeout_s or DEFAULT_OP_TIMEOUT_S)
            if not self._now(stream, request, deadline):
                self._task(stream, request, deadline)
        self._sweep.arm()

    def _task(self, stream: _Stream, request: dataproxy_pb2.LedgerRequest, deadline: float) -> None:
        """The op in a task of its own: a begin that waits out a pause holds up nothing else."""
        op = asyncio.get_running_loop().create_task(self._answer(stream, request))
        stream.ops[op] = deadline
        op.add_done_callback(stream.ops.pop)

    def _now(self, stream: _Stream, request: dataproxy_pb2.LedgerRequest, deadline: float) -> bool:
        """The common begin and record sent at once, answered from the reply's callback
        without a task (docs/internals.md, *The turn ledger*); False when the op needs its
        task from the start (a release, a traced op, this process shutting down). An op the
        reply does not settle (paused, the version moved...) continues in its task."""
        kind = request.WhichOneof("op")
        if request.traceparent or (self._tracer is not None and self._tracer.exporter):
            return False
        started = time.perf_counter()
        future: asyncio.Future[Any] | None
        if kind == "begin":
            if self._closing:
                return False
            begin = request.begin
            future = self._ledger.begin_now(begin.key_digest, session_id=begin.session_id)
        elif kind == "record":
            record = request.record
            try:
                episode = decode_ticket(record.ticket)
            except InvalidRequest:
                return False  # its task answers why
            future = self._ledger.record_now(episode, _turn_end(record))
            if future is not None:
                self._forget_lease(episode.lease_token)
        else:
            return False
        if future is None:
            return False
        stream.ops[future] = deadline
        future.add_done_callback(
            lambda done: self._answered(stream, request, kind, started, deadline, done)
        )
        return True

    def _answered(
        self,
        stream: _Stream,
        request: dataproxy_pb2.LedgerRequest,
        kind: str,
        started: float,
        deadline: float,
        done: asyncio.Future[Any],
    ) -> None:
        """An op sent without a task is settled: its answer, or its task takes over."""
        stream.ops.pop(done, None)
        answer: dataproxy_pb2.LedgerResponse
        if done.cancelled():  # the deadline sweep
            self._expired.discard(done)
            answer, code, message = self._failed(TimeoutError(), kind)
        elif (error := done.exception()) is not None:
            answer, code, message = self._failed(error, kind)
        elif (result := done.result()) is None:
            self._task(stream, request, deadline)
            return
        else:
            code, message = "OK", ""
            if kind == "begin":
                stream.admitted[result.token] = result.ticket
                answer = _admitted(result)
            else:
                answer = _recorded(result)
        answer.id = request.id
        stream.put(answer)
        if self._on_op is not None:
            self._on_op(kind, code, time.perf_counter() - started, message)
        self._check_drained()

    @staticmethod
    def _failed(err: BaseException, kind: str) -> tuple[dataproxy_pb2.LedgerResponse, str, str]:
        """A failed op's answer, its gRPC code name and message."""
        error = err if isinstance(err, RollgateError) else None
        if error is None:
            cause = err if isinstance(err, Exception) else RuntimeError(type(err).__name__)
            error = as_rollgate_error(cause, service="dataproxy", method=f"{METHOD}/{kind}")
        answer = dataproxy_pb2.LedgerResponse(error_json=error.to_payload())
        return answer, error.grpc_status.name, error.message

    def _expire(self, now: float) -> bool:
        """The deadline sweep: ops past their deadline are cancelled (each answers that it
        timed out); True while any op is under way."""
        if self._expired:  # an op that ended otherwise after all
            self._expired = {op for op in self._expired if not op.done()}
        under_way = False
        for stream in self._streams:
            for op, deadline in stream.ops.items():
                under_way = True
                if deadline <= now and op not in self._expired and op.cancel():
                    self._expired.add(op)
        return under_way

    async def _timed(
        self, stream: _Stream, request: dataproxy_pb2.LedgerRequest, kind: str
    ) -> dataproxy_pb2.LedgerResponse:
        """`_run`, with the deadline sweep's cancellation as a TimeoutError."""
        try:
            return await self._run(stream, request, kind)
        except asyncio.CancelledError:
            op = asyncio.current_task()
            if op is None or op not in self._expired:
                raise
            self._expired.discard(op)
            op.uncancel()
            raise TimeoutError from None

    async def _answer(self, stream: _Stream, request: dataproxy_pb2.LedgerRequest) -> None:
        kind = request.WhichOneof("op") or "none"
        started = time.perf_counter()
        code, message = "OK", ""
        try:
            with self._traced(request, kind) as span:
                try:
                    answer = await self._timed(stream, request, kind)
                except Exception as err:
                    if span is not None:
                        span.fail(type(err).__name__)
                    raise
        except Exception as err:
            answer, code, message = self._failed(err, kind)
        answer.id = request.id
        stream.put(answer)
        if self._on_op is not None:
            self._on_op(kind, code, time.perf_counter() - started, message)
        self._check_drained()

    def _traced(
        self, request: dataproxy_pb2.LedgerRequest, kind: str
    ) -> contextlib.AbstractContextManager[Span | None]:
        """The op's span in its turn's trace (nothing when untraced and not exporting)."""
        parent = TraceContext.parse(request.traceparent)
        tracer = self._tracer
        if tracer is None or (parent is None and tracer.exporter is None):
            return contextlib.nullcontext()
        return tracer.serve(f"rollgate.v1.DataProxy/Ledger.{kind}", parent)

    async def _run(
        self, stream: _Stream, request: dataproxy_pb2.LedgerRequest, kind: str
    ) -> dataproxy_pb2.LedgerResponse:
        if kind == "begin":
            if self._closing:
                raise Unavailable(CLOSING, code="dataproxy_stopping", retry_after_s=1.0)
            begin = request.begin
            admitted = await self._ledger.begin(
                begin.key_digest, session_id=begin.session_id, request_id=begin.request_id
            )
            stream.admitted[admitted.token] = admitted.ticket
            return _admitted(admitted)
        if kind == "record":
            record = request.record
            self._forget(record.ticket)
            recorded = await self._ledger.record(record.ticket, _turn_end(record))
            return _recorded(recorded)
        if kind == "release":
            release = request.release
            self._forget(release.ticket)
            if release.HasField("failure") and self._on_failure is not None:
                self._on_failure(release.failure)
            await self._ledger.release(release.ticket)
            return dataproxy_pb2.LedgerResponse(released=True)
        raise InvalidRequest("a ledger request needs begin, record or release")

    def _forget(self, ticket: bytes) -> None:
        """The turn is ending: no stream has to release it any more (any stream may end it)."""
        self._forget_lease(decode_ticket(ticket).lease_token)

    def _forget_lease(self, token: str) -> None:
        for stream in self._streams:
            stream.admitted.pop(token, None)

    async def _release_unfinished(self, stream: _Stream) -> None:
        for ticket in stream.admitted.values():
            with contextlib.suppress(Exception):
                await self._ledger.release(ticket)
        if stream.admitted:
            log.warning("ledger_stream_ended_with_unfinished_turns", turns=len(stream.admitted))
        stream.admitted.clear()


def _admitted(admitted: Admission) -> dataproxy_pb2.LedgerResponse:
    return dataproxy_pb2.LedgerResponse(
        admitted=dataproxy_pb2.TurnAdmitted(
            ticket=admitted.ticket,
            weight_version=admitted.weight_version,
            session_id=admitted.session_id,
        )
    )


def _recorded(recorded: RecordedTurn) -> dataproxy_pb2.LedgerResponse:
    return dataproxy_pb2.LedgerResponse(
        recorded=dataproxy_pb2.TurnRecorded(
            interaction_id=recorded.interaction_id,
            session_id=recorded.session_id,
            index=recorded.index,
        )
    )


def _turn_end(record: dataproxy_pb2.RecordTurn) -> TurnEnd:
    return TurnEnd(
        record=record.record,
        request_json=record.request_json,
        interaction_id=record.interaction_id,
        turn_type=record.turn_type or "main",
        session_done=record.session_done,
        request_id=record.request_id,
        streamed=record.streamed,
        spans=[(s.tokens, s.weight_version) for s in record.spans],
    )
