"""The gateway's side of the workers' `Turns` streams: one long-lived stream per worker, turns
by id.

Every relayed turn is a `TurnStart` on the stream to the worker the router chose instead of a
`Generate` or `Complete` call of its own (a message on an open stream costs a fraction of a
call: docs/internals.md, *What a turn costs*). Every op queued in one turn of the event loop
goes out as one `TurnOps`, and each `TurnEvent` read is handed to its turn
(`duplex.BatchedCall`: no task per message on a framed stream). A turn reads its events in
batches (all that came since it last asked: chunks that arrived together go on together).
Per-turn flow control: the worker sends at most `WINDOW_BYTES` of a turn's chunks ahead of
what its caller has taken; what the caller takes is credited back once half a window has
gone, so a slow client stalls only its own turn. A turn's caller may also take its events as
they are read (`WorkerTurn.sink`, from the stream's read callback: no wake-up of the caller's
task per event); what the sink leaves goes to `events()`, in order. A stream that breaks
fails its turns (a turn that had no event yet fails as `worker_unavailable`: the relay may
route it to another worker) and is reopened by the next turn.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

import grpc

from protos import worker_pb2, worker_pb2_grpc
from services.gateway.duplex import BatchedCall
from services.runtime.errors import (
    RollgateError,
    Unavailable,
    UpstreamError,
    UpstreamTimeout,
    from_payload,
    from_rpc_error,
)
from services.runtime.framed import TURNS_PREAMBLE, PeerStream
from services.runtime.grpc_client import ChannelPool
from services.runtime.logs import get_logger

log = get_logger(__name__)

# How far a worker may run ahead of a turn's client (bytes of chunks and delta text).
WINDOW_BYTES = 256 * 1024
# A worker that is shutting down refuses new turns with this code: not started, reroutable.
STOPPING_CODE = "worker_stopping"
UNAVAILABLE_CODE = "worker_unavailable"

# Takes one event of a turn as it is read (never its last one, never an error): True when it
# took it, False to leave it, and every event after it until `events()` took them, to
# `events()`. Called from the stream's read callback: it must not block.
EventSink = Callable[[worker_pb2.TurnEvent], bool]


def _unreachable() -> RollgateError:
    return Unavailable(
        "the worker is unreachable; retry shortly", code=UNAVAILABLE_CODE, retry_after_s=1.0
    )


def _no_record() -> RollgateError:
    return UpstreamError("the worker ended the turn without a token record")


def _error_of(event: worker_pb2.TurnEvent) -> RollgateError:
    return from_payload(event.error_json) or UpstreamError("the worker failed the turn")


def _is_last(event: worker_pb2.TurnEvent) -> bool:
    kind = event.WhichOneof("event")
    return kind != "generated" or event.generated.HasField("record")


class WorkerTurn:
    """One turn on a worker's stream: its events, in batches, as they come."""

    __slots__ = (
        "_credited",
        "_error",
        "_inbox",
        "_stream",
        "_taken",
        "_timer",
        "_waiter",
        "ended",
        "id",
        "received",
        "sink",
    )

    def __init__(self, stream: _WorkerStream, turn_id: int, timeout_s: float) -> None:
        self._stream = stream
        self.id = turn_id
        self._inbox: list[worker_pb2.TurnEvent] = []
        self._waiter: asyncio.Future[None] | None = None
        self._error: RollgateError | None = None
        # Bytes the caller has taken (credited back in half-windows) and what went back.
        self._taken = 0
        self._credited = 0
        # True once an answer came (not an error): the worker has the turn, it is not routed
        # elsewhere.
        self.received = False
        # True once its last event came, it failed, or it was cancelled.
        self.ended = False
        self._timer = stream.loop.call_later(timeout_s, self._expire)
        # Set by the caller once it takes events as they come (EventSink).
        self.sink: EventSink | None = None

    async def events(self) -> list[worker_pb2.TurnEvent]:
        """Every event that came since the last call (waits for the first); raises the turn's
        RollgateError after the events that came before it."""
        self._credit()
        while not self._inbox:
            if self._error is not None:
                raise self._error
            self._waiter = self._stream.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        events = self._inbox
        taken = 0
        for index, event in enumerate(events):
            if event.WhichOneof("event") == "error_json":
                self._error = _error_of(event)
                events, self._inbox = events[:index], []
                if not events:
                    raise self._error
                break
            taken += event.size
        else:
            self._inbox = []
        self._taken += taken
        return events

    def _credit(self) -> None:
        # What the caller took last time has been handed on (it asks again only then).
        owed = self._taken - self._credited
        if owed >= WINDOW_BYTES // 2 and not self.ended:
            self._credited = self._taken
            self._stream.send(worker_pb2.TurnOp(id=self.id, credit_bytes=owed))

    def cancel(self) -> None:
        """The caller is done with the turn: when it has not ended, the worker stops it."""
        self._timer.cancel()
        if not self.ended:
            self.ended = True
            self._stream.cancel(self.id)

    def deliver(self, event: worker_pb2.TurnEvent, *, last: bool) -> None:
        """An event of this turn came (`last`: the turn's last one)."""
        if event.WhichOneof("event") != "error_json":
            self.received = True
            # Events the sink left wait in the inbox: those after them wait too (order).
            if not last and self.sink is not None and not self._inbox and self._sunk(event):
                return
        if last:
            self.ended = True
            self._timer.cancel()
        self._inbox.append(event)
        self._wake()

    def _sunk(self, event: worker_pb2.TurnEvent) -> bool:
        """Whether the sink took `event` (then it counts as taken, and is credited back)."""
        assert self.sink is not None
        try:
            taken = self.sink(event)
        except Exception as err:
            # A bug of the sink's: the turn goes on through events(), the stream's others too.
            log.error("turn_sink_failed", turn_id=self.id, error=type(err).__name__)
            self.sink = None
            return False
        if taken:
            self._taken += event.size
            self._credit()
        return taken

    def fail(self, error: RollgateError) -> None:
        """The turn cannot go on (its stream broke, its deadline passed)."""
        if self._error is None:
            self._error = error
        self.ended = True
        self._timer.cancel()
        self._wake()

    def _expire(self) -> None:
        if not self.ended:
            self.fail(UpstreamTimeout("the worker did not answer in time", code="worker_timeout"))
            self._stream.cancel(self.id)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class _WorkerStream(BatchedCall[worker_pb2.TurnOp]):
    """One open `Worker.Turns` call: ops queued and written together, events by turn id.

    A stopping stream (its worker said it is shutting down) takes no new turns.
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        address: str,
        *,
        framed: bool,
        on_open: Callable[[str, str], None] | None = None,
    ) -> None:
        self._turns: dict[int, WorkerTurn] = {}
        stub = worker_pb2_grpc.WorkerStub(channel)
        self.call = PeerStream(
            open_grpc=stub.Turns,
            endpoint=stub.TurnsEndpoint if framed else None,
            address=address,
            preamble=TURNS_PREAMBLE,
            parse=worker_pb2.TurnEvents.FromString,
            peer="worker",
            on_open=on_open,
        )
        super().__init__(self.call, name="worker-turns")

    @property
    def usable(self) -> bool:
        return self.alive and not self.stopping and not self._closing

    def start(self, op: worker_pb2.TurnOp, timeout_s: float) -> WorkerTurn:
        """Queues the turn's start (`op`); its events go to the WorkerTurn."""
        turn = WorkerTurn(self, op.id, timeout_s)
        self._turns[op.id] = turn
        self.send(op)
        return turn

    def send(self, op: worker_pb2.TurnOp) -> None:
        if self.alive:
            self._queue(op)

    def cancel(self, turn_id: int) -> None:
        """Stops a turn: never sent when its start is still queued, else a cancel op."""
        self._turns.pop(turn_id, None)
        queued = len(self._outbox)
        self._outbox = [op for op in self._outbox if op.id != turn_id]
        if len(self._outbox) == queued:
            self.send(worker_pb2.TurnOp(id=turn_id, cancel=True))

    def _batch(self, ops: list[worker_pb2.TurnOp]) -> worker_pb2.TurnOps:
        return worker_pb2.TurnOps(ops=ops)

    def _write_failed(self, err: Exception) -> None:
        self._fail(from_rpc_error(err, hop="worker") if _rpc(err) else _unreachable())

    def _on_message(self, message: worker_pb2.TurnEvents) -> None:
        for event in message.events:
            turn = self._turns.get(event.id)
            if turn is None:
                continue  # cancelled meanwhile
            last = _is_last(event)
            if last:
                del self._turns[event.id]
                if event.WhichOneof("event") == "error_json" and not turn.received:
                    self.stopping = self.stopping or _error_of(event).code == STOPPING_CODE
            turn.deliver(event, last=last)

    def _ended(self, error: grpc.aio.AioRpcError | None) -> None:
        self._fail(from_rpc_error(error, hop="worker") if error is not None else None)

    def _fail(self, error: RollgateError | None) -> None:
        """The stream ended or broke: each turn on it fails (one without any event yet as
        unreachable, so the relay may route it elsewhere)."""
        self.alive = False
        self._outbox = []
        turns, self._turns = self._turns, {}
        for turn in turns.values():
            if turn.received:
                turn.fail(error or _no_record())
            else:
                turn.fail(error or _unreachable())


def _rpc(err: Exception) -> bool:
    return isinstance(err, grpc.aio.AioRpcError)


class WorkerTurns:
    """Turns over one `Turns` stream per worker address, on the workers' channels."""

    def __init__(
        self,
        channels: ChannelPool,
        *,
        framed: bool = True,
        on_open: Callable[[str, str], None] | None = None,
    ) -> None:
        self._channels = channels
        # Framed streams where the workers offer them (services/runtime/framed.py); each
        # stream's (peer, transport) goes to `on_open` as it opens.
        self._framed = framed
        self._on_open = on_open
        self._streams: dict[str, _WorkerStream] = {}
        self._ids = itertools.count(1)

    def start(
        self,
        address: str,
        request: worker_pb2.GenerateRequest,
        *,
        stream: bool,
        timeout_s: float,
        traceparent: str = "",
    ) -> WorkerTurn:
        """Starts a turn on the worker at `address` (its stream opened when there is none)."""
        worker = self._streams.get(address)
        if worker is None or not worker.usable:
            worker = self._streams[address] = _WorkerStream(
                self._channels.get(address), address, framed=self._framed, on_open=self._on_open
            )
        # Built in place: a message given to a constructor is copied (the request, then the
        # start), and the request carries the whole body.
        op = worker_pb2.TurnOp(id=next(self._ids))
        start = op.start
        start.request.CopyFrom(request)
        start.stream = stream
        start.timeout_s = timeout_s
        start.traceparent = traceparent
        start.window_bytes = WINDOW_BYTES
        return worker.start(op, timeout_s)

    async def close(self) -> None:
        """Ends every stream (gateway shutdown, after its in-flight turns)."""
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            await stream.close()
