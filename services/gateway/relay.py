"""The one relay of a turn, shared by chat completions, Responses and the WebSocket bridge.

A turn: `BeginTurn` on the ledger (admission, the in-flight lease, the weight version; a key
refused here never reaches the router, so it leaves no affinity) → route (cached) → the turn
on the `Worker.Turns` stream to the worker the router chose (`worker_calls.py`) →
the chunks to the caller as they arrive (all that came together as one event; after the
first, written from the worker stream's read callback where the caller pushes), their output
tokens stamped with the weight version current as they pass → `RecordTurn` on the ledger →
the caller's end (`Done`: the recorded assistant message, usage and finish reason, nothing
re-accumulated here). The end is never given before the record is written: an answered turn
is a recorded turn.

The caller's task waits only where it must: once its route is cached and its ledger stream
open, the begin goes out at once and the turn is started on its worker from the ledger's read
callback as the admission is read (`_start`), and the record goes out from the worker stream's
read callback as the last event is read (`_hook`); the caller wakes at the first events and
once the record is answered. Whatever is not usual there (no open stream, a stream that broke,
a stopping dataproxy) goes on in the caller's task, with the attempts left.

The body is parsed once, by the protocol handler; the relay sends the worker the recorded
part (`{"tools"?, "messages"}`, which the worker forwards without parsing it) and the other
fields, and the dataproxy the same recorded part with the worker's record.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from protos import common_pb2, worker_pb2
from services.gateway.header_mode import TurnTags
from services.gateway.json_body import dump_json
from services.gateway.ledger import (
    BEGIN_ATTEMPTS,
    RECORD_ATTEMPTS,
    Admitted,
    LedgerClient,
    Recorded,
    Unanswered,
)
from services.gateway.routing import RouteCache, WorkerChoice, choose_worker
from services.gateway.turn_metrics import TurnClock, TurnMetrics
from services.gateway.worker_calls import (
    STOPPING_CODE,
    UNAVAILABLE_CODE,
    EventSink,
    LastHook,
    WorkerTurn,
    WorkerTurns,
)
from services.runtime import tracing
from services.runtime.errors import (
    InternalError,
    RollgateError,
    UpstreamTimeout,
    check_identifier,
)
from services.runtime.grpc_client import ChannelPool
from services.runtime.logs import get_logger

if TYPE_CHECKING:
    from protos.router_pb2_grpc import RouterAsyncStub

log = get_logger(__name__)

# A worker that could not be reached (or is shutting down) before the turn's first event: the
# turn goes to another worker, once.
WORKER_UNAVAILABLE_CODE = UNAVAILABLE_CODE
_REROUTED = frozenset({UNAVAILABLE_CODE, STOPPING_CODE})
# Releasing the lease of a turn that ends without a record is one small ledger op.
RELEASE_TIMEOUT_S = 5.0
# A record that failed with these never reached the dataproxy (which releases the lease of a
# record it refused): the relay releases it.
_UNANSWERED = frozenset({"dataproxy_unavailable", "dataproxy_timeout", "gateway_timeout"})
# The fields of a body that make up its recorded part, forwarded and recorded as one blob.
RECORDED_FIELDS = ("tools", "messages")


def split_body(body: Mapping[str, Any]) -> tuple[bytes, bytes]:
    """The recorded part `{"tools"?, "messages"}` (tools first: the next turn's request then
    extends this one's bytes, and the dataproxy stores the shared prefix once) and the other
    fields, each as JSON; InvalidRequest when the body is nested too deep (each part is as
    deep as the body's deepest field in it: a body read with `check_depth=False` is checked
    here, by the encoding the relay needs anyway)."""
    recorded: dict[str, Any] = {"tools": body["tools"]} if "tools" in body else {}
    recorded["messages"] = body["messages"]
    params = {k: v for k, v in body.items() if k not in RECORDED_FIELDS}
    return dump_json(recorded), dump_json(params)


@dataclass(slots=True, kw_only=True)  # not frozen: built every turn (half the cost)
class TurnSpec:
    """One turn as a protocol handler hands it to the relay."""

    digest: str
    model: str
    # {"tools"?, "messages"} and the other fields of the chat body (`split_body`).
    request_json: bytes
    params_json: bytes
    request_id: str
    # time.monotonic() by which the whole turn must be done.
    deadline: float
    # Record the turn under this id (the id the client saw); empty: the completion id.
    interaction_id: str = ""
    # OpenClaw-RL's session headers (services/gateway/header_mode.py), on every path.
    tags: TurnTags = field(default_factory=TurnTags)
    # Streaming: text deltas instead of chat chunks (the Responses and WebSocket bridges).
    deltas_only: bool = False

    def __post_init__(self) -> None:
        # Every protocol's turn passes here: the model is bounded once for all of them.
        check_identifier(self.model, "`model`")

    @property
    def route_key(self) -> str:
        """What worker affinity follows: the key, or the key's named session."""
        return f"{self.digest}/{self.tags.session_id}" if self.tags.session_id else self.digest

    def remaining_s(self) -> float:
        """The budget left, or UpstreamTimeout when it is spent."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise UpstreamTimeout("the request ran out of time", code="gateway_timeout")
        return remaining


def bridge_spec(
    *,
    digest: str,
    body: Mapping[str, Any],
    request_id: str,
    timeout_s: float,
    interaction_id: str,
    tags: TurnTags,
) -> TurnSpec:
    """A streamed turn of the Responses or WebSocket bridge: a chat body they built, text
    deltas back, recorded under the id the client saw (`resp_…`, the runId)."""
    request_json, params_json = split_body({**body, "stream": True})
    return TurnSpec(
        digest=digest,
        model=str(body.get("model") or ""),
        request_json=request_json,
        params_json=params_json,
        request_id=request_id,
        deadline=time.monotonic() + timeout_s,
        interaction_id=interaction_id,
        tags=tags,
        deltas_only=True,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallDelta:
    """A fragment of one tool call (id and name only on its first fragment)."""

    index: int
    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Delta:
    """What one batch of chunks added to the answer."""

    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass(slots=True, kw_only=True)  # not frozen: built every turn (half the cost)
class Chunks:
    """Chat chunks that arrived together, each one SSE `data:` payload."""

    payloads: list[bytes]
    # The prompt's length in tokens once the upstream has told it (else 0).
    prompt_tokens: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCall:
    """A complete tool call of the recorded answer."""

    call_id: str
    name: str
    arguments: str


@dataclass(slots=True, kw_only=True)  # not frozen: built every turn (half the cost)
class Done:
    """The turn is recorded: what was recorded, and the answer's last chunks or delta (the
    ones that arrived with the end travel with it, one write with the end)."""

    interaction_id: str
    session_id: str
    # The recorded assistant message and usage as the worker sent them (JSON objects): read
    # when asked for (`message`, `usage`), which chat's relay never does.
    message_json: bytes
    usage_json: bytes
    finish_reason: str
    model: str
    tail: list[bytes] = field(default_factory=list)
    tail_delta: Delta | None = None
    _message: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)
    _usage: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def message(self) -> dict[str, Any]:
        """The recorded assistant message {role, content, reasoning_content?, tool_calls?}."""
        if self._message is None:
            self._message = _json_object(self.message_json)
        return self._message

    @property
    def usage(self) -> dict[str, Any]:
        """The recorded usage ({} when the upstream sent none)."""
        if self._usage is None:
            self._usage = _json_object(self.usage_json)
        return self._usage

    @property
    def content(self) -> str:
        """The answer's text."""
        return str(self.message.get("content") or "")

    @property
    def reasoning(self) -> str:
        """The answer's reasoning text."""
        return str(self.message.get("reasoning_content") or "")

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        """The answer's tool calls (an id made up from the interaction when none was sent)."""
        calls = []
        for index, call in enumerate(self.message.get("tool_calls") or ()):
            function = call.get("function") if isinstance(call, dict) else None
            function = function if isinstance(function, dict) else {}
            calls.append(
                ToolCall(
                    call_id=str(call.get("id") or f"call_{self.interaction_id}_{index}"),
                    name=str(function.get("name") or ""),
                    arguments=str(function.get("arguments") or ""),
                )
            )
        return tuple(calls)

    def assistant_message(self) -> dict[str, Any]:
        """The chat assistant message of this answer (as it goes into a history)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in self.tool_calls
            ]
        return message


Event = Chunks | Delta | Done


class _VersionSpans:
    """(tokens, version) of a streamed turn's batches, in order, as they pass the gateway."""

    def __init__(self, *, ledger: LedgerClient, admitted: int) -> None:
        self._ledger = ledger
        self._admitted = admitted
        self.spans: list[tuple[int, int]] = []

    def add(self, tokens: int) -> None:
        """Stamps `tokens` with the current version (never older than the admission one)."""
        self._stamp(self.spans, tokens)

    def plus(self, tokens: int) -> list[tuple[int, int]]:
        """A copy of the spans with `tokens` more, stamped as `add` would."""
        spans = list(self.spans)
        self._stamp(spans, tokens)
        return spans

    def _stamp(self, spans: list[tuple[int, int]], tokens: int) -> None:
        if tokens <= 0:
            return
        version = max(self._ledger.weight_version, self._admitted)
        if spans and spans[-1][1] == version:
            spans[-1] = (spans[-1][0] + tokens, version)
        else:
            spans.append((tokens, version))


# Writes what one batch brought (Chunks, or a Delta for `deltas_only`) to the client at once
# (no await): True when written, False when it cannot now (the client is behind or gone; the
# relay then yields it, and what follows it, as events).
Push = Callable[[Chunks | Delta], bool]


def _pushing(push: Push, spans: _VersionSpans, clock: TurnClock, *, deltas: bool) -> EventSink:
    """A turn's sink (worker_calls.EventSink) that hands each batch to `push` as the event the
    relay would have yielded, with what the relay's loop does per batch: its tokens stamped
    with the current version, the first output token timed."""

    def sink(event: worker_pb2.TurnEvent) -> bool:
        batch = event.generated.chunks
        if deltas:
            if batch.HasField("delta") and not push(_delta(batch.delta)):
                return False
        elif batch.chunks and not push(
            Chunks(payloads=list(batch.chunks), prompt_tokens=batch.prompt_tokens)
        ):
            return False
        spans.add(batch.output_tokens)
        if batch.output_tokens:
            clock.output()
        return True

    return sink


def _delta(message: worker_pb2.Delta) -> Delta:
    return Delta(
        content=message.content,
        reasoning=message.reasoning,
        tool_calls=tuple(
            ToolCallDelta(index=f.index, call_id=f.id, name=f.name, arguments=f.arguments)
            for f in message.tool_calls
        ),
    )


def _json_object(raw: bytes) -> dict[str, Any]:
    with contextlib.suppress(orjson.JSONDecodeError):
        value = orjson.loads(raw) if raw else {}
        if isinstance(value, dict):
            return value
    return {}


@dataclass(slots=True)
class _Turn:
    """What the relay knows of a turn as it goes: filled in by the caller's task and by the
    read callbacks that start the turn on its worker and send its record."""

    clock: TurnClock
    admitted: Admitted | None = None
    turn: WorkerTurn | None = None
    # A streamed turn's (tokens, version), from its admission on.
    spans: _VersionSpans | None = None
    # What a begin sent at once got when it started no turn.
    begun: RollgateError | Unanswered | None = None
    # The answer to the record sent as the last event was read (`TurnRelay._hook`), once
    # it was sent.
    recording: asyncio.Future[Recorded | RollgateError | Unanswered] | None = None


class Routes(Protocol):
    """Which worker serves a turn."""

    def cached(self, route_key: str, model: str) -> WorkerChoice | None:
        """The worker known for (route key, model) without asking anyone, if any."""
        ...

    async def choose(
        self, route_key: str, model: str, *, timeout_s: float, avoid_worker_id: str = ""
    ) -> WorkerChoice:
        """The worker for (route key, model), avoiding `avoid_worker_id`."""
        ...

    def forget(self, route_key: str, model: str) -> None:
        """Drops a remembered choice (its worker could not be reached)."""


class RouterRoutes:
    """The router's answers, cached per (route key, model) for a few seconds."""

    def __init__(self, router: RouterAsyncStub, cache: RouteCache) -> None:
        self._router = router
        self._cache = cache

    def cached(self, route_key: str, model: str) -> WorkerChoice | None:
        """The cached choice, if any."""
        return self._cache.get(route_key, model)

    async def choose(
        self, route_key: str, model: str, *, timeout_s: float, avoid_worker_id: str = ""
    ) -> WorkerChoice:
        """From the cache, else from `Router.Route`."""
        return await choose_worker(
            self._router,
            self._cache,
            digest=route_key,
            model=model,
            timeout_s=timeout_s,
            avoid_worker_id=avoid_worker_id,
        )

    def forget(self, route_key: str, model: str) -> None:
        """Drops the cached choice."""
        self._cache.drop(route_key, model)


class TurnRelay:
    """Routes, admits, calls the worker, relays, records; one per gateway process."""

    def __init__(
        self,
        *,
        routes: Routes,
        ledger: LedgerClient,
        workers: ChannelPool,
        rpc_timeout_s: float,
        metrics: TurnMetrics | None = None,
        framed_streams: bool = True,
    ) -> None:
        self._routes = routes
        self._ledger = ledger
        # One Turns stream per worker, on the pool's channels (framed where offered).
        self._workers = WorkerTurns(
            workers,
            framed=framed_streams,
            on_open=metrics.stream_opened if metrics is not None else None,
        )
        self._rpc_timeout_s = rpc_timeout_s
        self._metrics = metrics
        # Releases of admissions that came after their caller gave up (`_release_later`).
        self._releasing: set[asyncio.Task[None]] = set()
        # The loop, once known (asyncio.get_running_loop costs a getpid system call).
        self._loop: asyncio.AbstractEventLoop | None = None

    def _future(self) -> asyncio.Future[Any]:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop.create_future()

    async def close(self) -> None:
        """Ends the workers' streams (gateway shutdown, after its in-flight turns)."""
        await self._workers.close()

    async def stream(
        self,
        spec: TurnSpec,
        *,
        on_routed: Callable[[str], None] | None = None,
        push: Push | None = None,
    ) -> AsyncGenerator[Event, None]:
        """Chunks (or deltas) as the worker sends them, then Done once the turn is recorded;
        raises RollgateError. `on_routed` gets the worker's address once its stream is open
        (where an abort of the turn goes). With `push`, the batches after the first one
        yielded go to it as they are read, from the worker stream's read callback, as the
        Chunks or Delta this generator would yield, instead of waking its caller per batch;
        what it refuses is yielded, in order, and Done as always."""
        state = _Turn(TurnClock(self._metrics, stream=True))
        recording = ended = False  # ended: the dataproxy answered the record (lease released)
        failure: RollgateError | None = None
        clock = state.clock
        try:
            turn, events, choice = await self._start(spec, state, stream=True)
            if on_routed is not None:
                on_routed(choice.address)
            spans = state.spans
            assert spans is not None
            # Chunks that came together go on together (one event, one client write); those
            # that came with the record go with the end, unless nothing was sent before them
            # (the first token is never held back).
            sent = False
            record: worker_pb2.GenerateResponse | None = None
            while record is None:
                payloads: list[bytes] = []
                deltas: list[Delta] = []
                prompt_tokens = 0
                # Every event taken is counted before anything is yielded (a caller may wait
                # at a yield): the record sent as the last event is read (`_hook`) has them all.
                for event in events:
                    message = event.generated
                    if message.HasField("record"):
                        record = message
                        break
                    batch = message.chunks
                    spans.add(batch.output_tokens)
                    if batch.output_tokens:
                        clock.output()
                    if spec.deltas_only:
                        if batch.HasField("delta"):
                            deltas.append(_delta(batch.delta))
                    elif batch.chunks:
                        payloads.extend(batch.chunks)
                        prompt_tokens = batch.prompt_tokens
                for delta in deltas:
                    sent = True
                    yield delta
                if payloads and (record is None or not sent):
                    sent = True
                    yield Chunks(payloads=payloads, prompt_tokens=prompt_tokens)
                    payloads = []
                if record is None:
                    if push is not None and sent and turn.sink is None:
                        turn.sink = _pushing(push, spans, clock, deltas=spec.deltas_only)
                    events = await turn.events()
            tail = record.chunks
            spans.add(tail.output_tokens)
            if tail.output_tokens:
                clock.output()
            recording = True
            recorded = await self._recorded(spec, state, record.record, spans.spans)
            ended = True
            clock.recorded(record.record)
            yield self._done(
                spec,
                recorded,
                record.record,
                tail=[] if spec.deltas_only else [*payloads, *tail.chunks],
                tail_delta=_delta(tail.delta) if tail.HasField("delta") else None,
            )
        except RollgateError as err:
            ended = ended or (recording and err.code not in _UNANSWERED)
            failure = err
            clock.failed(err)
            raise
        finally:
            await self._end(spec, state, ended=ended, recording=recording, failure=failure)

    async def complete(self, spec: TurnSpec) -> tuple[bytes, Done]:
        """One non-streaming turn: the body for the client and Done, after the record."""
        answer, recorded = await self._complete(spec)
        return answer.body_json, self._done(spec, recorded, answer.record)

    async def answer(self, spec: TurnSpec) -> bytes:
        """One non-streaming turn: the body for the client (the worker's chat completion),
        after the record; `complete` without Done, which a protocol answering with that body
        needs none of."""
        answer, _ = await self._complete(spec)
        return answer.body_json

    async def _complete(self, spec: TurnSpec) -> tuple[worker_pb2.CompleteResponse, Recorded]:
        state = _Turn(TurnClock(self._metrics, stream=False))
        recording = ended = False
        failure: RollgateError | None = None
        try:
            _, events, _ = await self._start(spec, state, stream=False)
            answer = events[0].completed
            recording = True
            recorded = await self._recorded(spec, state, answer.record, None)
            ended = True
            state.clock.recorded(answer.record)
            return answer, recorded
        except RollgateError as err:
            ended = ended or (recording and err.code not in _UNANSWERED)
            failure = err
            state.clock.failed(err)
            raise
        finally:
            await self._end(spec, state, ended=ended, recording=recording, failure=failure)

    async def _end(
        self,
        spec: TurnSpec,
        state: _Turn,
        *,
        ended: bool,
        recording: bool,
        failure: RollgateError | None,
    ) -> None:
        """What a turn leaves behind when it is over: its generation stopped (the caller gave
        up or the turn failed), its lease released unless its record was answered."""
        if state.turn is not None:
            state.turn.cancel()
        if state.admitted is not None and not ended:
            if recording or state.recording is not None:
                failed_call = "Ledger.record"
            else:
                failed_call = "Worker.Generate" if state.spans is not None else "Worker.Complete"
            await self._release(spec, state.admitted, failure, failed_call)

    async def _start(
        self, spec: TurnSpec, state: _Turn, *, stream: bool
    ) -> tuple[WorkerTurn, list[worker_pb2.TurnEvent], WorkerChoice]:
        """Admits the turn, starts it on its worker and waits for its first events.

        Admission first: a key that is unknown, revoked or between episodes is refused before
        the router places it, so it leaves no affinity behind. When the turn's worker is known
        (its route cached) and its ledger stream open, the begin goes out at once and the turn
        is started from the ledger's read callback as the admission is read: the caller wakes
        once, at the worker's first events, not also at the admission."""
        trace = tracing.current()
        traceparent = trace.header() if trace is not None else ""
        attempts, tried = BEGIN_ATTEMPTS, None
        cached = self._routes.cached(spec.route_key, spec.model)
        if cached is not None:
            woken: asyncio.Future[None] = self._future()

            def admitted(outcome: Admitted | RollgateError | Unanswered) -> None:
                assert cached is not None
                if woken.done():  # its caller gave up waiting (cancelled)
                    if isinstance(outcome, Admitted):
                        self._release_later(spec, outcome)
                    return
                try:
                    if isinstance(outcome, Admitted):
                        state.admitted = outcome
                        self._start_turn(spec, state, cached, stream=stream, trace=traceparent)
                        assert state.turn is not None
                        state.turn.notify(woken)
                        return
                    state.begun = outcome
                except Exception as err:  # a bug: the caller fails the turn, not wait forever
                    log.error("turn_start_failed", error=type(err).__name__)
                    state.begun = InternalError(
                        "the gateway could not start the turn; see its logs", code="turn_start"
                    )
                woken.set_result(None)

            if self._ledger.begin_now(
                route_key=spec.route_key,
                digest=spec.digest,
                session_id=spec.tags.session_id,
                request_id=spec.request_id,
                timeout_s=spec.remaining_s(),
                then=admitted,
            ):
                await woken
                begun = state.begun
                if begun is None:
                    assert state.turn is not None
                    return await self._open(
                        spec, state, cached, stream=stream, trace=traceparent, turn=state.turn
                    )
                if not isinstance(begun, Unanswered):
                    raise begun
                attempts, tried = BEGIN_ATTEMPTS - 1, begun.replica
        state.admitted = await self._ledger.begin(
            route_key=spec.route_key,
            digest=spec.digest,
            session_id=spec.tags.session_id,
            request_id=spec.request_id,
            timeout_s=spec.remaining_s(),
            attempts=attempts,
            tried=tried,
        )
        choice = await self._route(spec)
        return await self._open(spec, state, choice, stream=stream, trace=traceparent)

    def _release_later(self, spec: TurnSpec, admitted: Admitted) -> None:
        """Releases an admission that came after its caller gave up (from a read callback)."""
        task = asyncio.create_task(self._release(spec, admitted, None, "Ledger.begin"))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _route(self, spec: TurnSpec, avoid_worker_id: str = "") -> WorkerChoice:
        return await self._routes.choose(
            spec.route_key,
            spec.model,
            timeout_s=min(self._rpc_timeout_s, spec.remaining_s()),
            avoid_worker_id=avoid_worker_id,
        )

    async def _reroute(self, spec: TurnSpec, choice: WorkerChoice) -> WorkerChoice:
        """Another worker than `choice`, which could not be reached."""
        self._routes.forget(spec.route_key, spec.model)
        log.warning("worker_unreachable_rerouting", worker_id=choice.worker_id)
        return await self._route(spec, avoid_worker_id=choice.worker_id)

    def _generate_request(self, spec: TurnSpec, admitted: Admitted) -> worker_pb2.GenerateRequest:
        return worker_pb2.GenerateRequest(
            request_json=spec.request_json,
            params_json=spec.params_json,
            weight_version=admitted.weight_version,
            request_id=spec.request_id,
            deltas_only=spec.deltas_only,
        )

    async def _open(
        self,
        spec: TurnSpec,
        state: _Turn,
        choice: WorkerChoice,
        *,
        stream: bool,
        trace: str,
        turn: WorkerTurn | None = None,
    ) -> tuple[WorkerTurn, list[worker_pb2.TurnEvent], WorkerChoice]:
        """Waits for the first events of the turn (started on `choice`'s stream unless
        `turn` is), routed to another worker once when that one cannot be reached, before
        anything reaches the client."""
        rerouted = False
        while True:
            if turn is None:
                turn = self._start_turn(spec, state, choice, stream=stream, trace=trace)
            try:
                return turn, await turn.events(), choice
            except RollgateError as error:
                if rerouted or turn.received or error.code not in _REROUTED:
                    raise
                rerouted = True
                choice = await self._reroute(spec, choice)
            finally:
                if not turn.received:
                    turn.cancel()
            turn = None

    def _start_turn(
        self, spec: TurnSpec, state: _Turn, choice: WorkerChoice, *, stream: bool, trace: str
    ) -> WorkerTurn:
        """Starts the turn on `choice`'s stream (no wait), its record sent as its last event
        is read (`_hook`)."""
        admitted = state.admitted
        assert admitted is not None
        if stream and state.spans is None:
            state.spans = _VersionSpans(ledger=self._ledger, admitted=admitted.weight_version)
        turn = state.turn = self._workers.start(
            choice.address,
            self._generate_request(spec, admitted),
            stream=stream,
            timeout_s=spec.remaining_s(),
            traceparent=trace,
        )
        turn.on_last = self._hook(spec, state, turn, trace)
        return turn

    def _hook(self, spec: TurnSpec, state: _Turn, turn: WorkerTurn, trace: str) -> LastHook:
        """The turn's last event, as it is read: its record goes to the ledger at once, and
        its caller wakes once that is answered (`_recorded` takes the answer)."""

        def on_last(event: worker_pb2.TurnEvent) -> bool:
            admitted = state.admitted
            assert admitted is not None
            spans: list[tuple[int, int]] | None = None
            if event.WhichOneof("event") == "completed":
                record = event.completed.record
            else:
                assert state.spans is not None
                record = event.generated.record
                spans = state.spans.plus(event.generated.chunks.output_tokens)
            answered: asyncio.Future[Recorded | RollgateError | Unanswered] = self._future()

            def then(outcome: Recorded | RollgateError | Unanswered) -> None:
                answered.set_result(outcome)
                turn.wake()

            if not self._ledger.record_now(
                route_key=spec.route_key,
                ticket=admitted.ticket,
                record=record,
                request_json=spec.request_json,
                interaction_id=spec.interaction_id,
                turn_type=spec.tags.turn_type,
                session_done=spec.tags.session_done,
                request_id=spec.request_id,
                spans=spans,
                timeout_s=spec.remaining_s(),
                traceparent=trace,
                then=then,
            ):
                return False
            state.recording = answered
            return True

        return on_last

    async def _recorded(
        self,
        spec: TurnSpec,
        state: _Turn,
        record: common_pb2.TurnRecord,
        spans: list[tuple[int, int]] | None,
    ) -> Recorded:
        """The turn's record: the answer to the one sent as its last event was read, else
        (not sent, or its stream broke) written now."""
        admitted = state.admitted
        assert admitted is not None
        attempts, tried = RECORD_ATTEMPTS, None
        if state.recording is not None:
            outcome = await state.recording
            if isinstance(outcome, Recorded):
                return outcome
            if isinstance(outcome, RollgateError):
                raise outcome
            attempts, tried = RECORD_ATTEMPTS - 1, outcome.replica
        return await self._ledger.record(
            route_key=spec.route_key,
            ticket=admitted.ticket,
            record=record,
            request_json=spec.request_json,
            interaction_id=spec.interaction_id,
            turn_type=spec.tags.turn_type,
            session_done=spec.tags.session_done,
            request_id=spec.request_id,
            spans=spans,
            timeout_s=spec.remaining_s(),
            attempts=attempts,
            tried=tried,
        )

    def _done(
        self,
        spec: TurnSpec,
        recorded: Recorded,
        record: common_pb2.TurnRecord,
        *,
        tail: list[bytes] | None = None,
        tail_delta: Delta | None = None,
    ) -> Done:
        return Done(
            interaction_id=recorded.interaction_id,
            session_id=recorded.session_id,
            message_json=record.assistant_message_json,
            usage_json=record.usage_json,
            finish_reason=record.finish_reason or "stop",
            model=record.upstream_model or spec.model,
            tail=tail if tail is not None else [],
            tail_delta=tail_delta,
        )

    async def _release(
        self, spec: TurnSpec, admitted: Admitted, failure: RollgateError | None, failed_call: str
    ) -> None:
        # Shielded: a cancelled turn still stops counting as in flight (else its lease expires).
        # A failure travels with the release: no dataproxy RPC saw the worker's call fail.
        with contextlib.suppress(Exception):
            await asyncio.shield(
                self._ledger.release(
                    route_key=spec.route_key,
                    ticket=admitted.ticket,
                    timeout_s=RELEASE_TIMEOUT_S,
                    failure=failure,
                    failed_call=failed_call,
                )
            )
