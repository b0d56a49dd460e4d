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
from services.gateway.ledger import RELEASE_TIMEOUT_S, Admitted, LedgerClient, Recorded
from services.gateway.routing import RouteCache, WorkerChoice, choose_worker
from services.gateway.turn_metrics import TurnClock, TurnMetrics
from services.gateway.worker_calls import (
    STOPPING_CODE,
    UNAVAILABLE_CODE,
    EventSink,
    WorkerTurn,
    WorkerTurns,
)
from services.runtime import tracing
from services.runtime.errors import (
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
        if tokens <= 0:
            return
        version = max(self._ledger.weight_version, self._admitted)
        if self.spans and self.spans[-1][1] == version:
            self.spans[-1] = (self.spans[-1][0] + tokens, version)
        else:
            self.spans.append((tokens, version))


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


class Routes(Protocol):
    """Which worker serves a turn."""

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
        admitted: Admitted | None = None
        recording = ended = False  # ended: the dataproxy answered the record (lease released)
        failure: RollgateError | None = None
        turn: WorkerTurn | None = None
        clock = TurnClock(self._metrics, stream=True)
        try:
            # Admission first: a key that is unknown, revoked or between episodes is refused
            # before the router places it, so it leaves no affinity behind.
            admitted = await self._begin(spec)
            choice = await self._route(spec)
            turn, events, choice = await self._open(spec, admitted, choice, stream=True)
            if on_routed is not None:
                on_routed(choice.address)
            spans = _VersionSpans(ledger=self._ledger, admitted=admitted.weight_version)
            # Chunks that came together go on together (one event, one client write); those
            # that came with the record go with the end, unless nothing was sent before them
            # (the first token is never held back).
            sent = False
            record: worker_pb2.GenerateResponse | None = None
            while record is None:
                payloads: list[bytes] = []
                prompt_tokens = 0
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
                            sent = True
                            yield _delta(batch.delta)
                    elif batch.chunks:
                        payloads.extend(batch.chunks)
                        prompt_tokens = batch.prompt_tokens
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
            recorded = await self._record(spec, admitted, record.record, spans.spans)
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
            if turn is not None:
                # Stops the generation when the caller gave up or the turn failed.
                turn.cancel()
            if admitted is not None and not ended:
                failed_call = "Ledger.record" if recording else "Worker.Generate"
                await self._release(spec, admitted, failure, failed_call)

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
        admitted: Admitted | None = None
        recording = ended = False
        failure: RollgateError | None = None
        turn: WorkerTurn | None = None
        clock = TurnClock(self._metrics, stream=False)
        try:
            admitted = await self._begin(spec)
            choice = await self._route(spec)
            turn, events, _ = await self._open(spec, admitted, choice, stream=False)
            answer = events[0].completed
            recording = True
            recorded = await self._record(spec, admitted, answer.record, None)
            ended = True
            clock.recorded(answer.record)
            return answer, recorded
        except RollgateError as err:
            ended = ended or (recording and err.code not in _UNANSWERED)
            failure = err
            clock.failed(err)
            raise
        finally:
            if turn is not None:
                turn.cancel()
            if admitted is not None and not ended:
                failed_call = "Ledger.record" if recording else "Worker.Complete"
                await self._release(spec, admitted, failure, failed_call)

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

    async def _begin(self, spec: TurnSpec) -> Admitted:
        return await self._ledger.begin(
            route_key=spec.route_key,
            digest=spec.digest,
            session_id=spec.tags.session_id,
            request_id=spec.request_id,
            timeout_s=spec.remaining_s(),
        )

    def _generate_request(self, spec: TurnSpec, admitted: Admitted) -> worker_pb2.GenerateRequest:
        return worker_pb2.GenerateRequest(
            request_json=spec.request_json,
            params_json=spec.params_json,
            weight_version=admitted.weight_version,
            request_id=spec.request_id,
            deltas_only=spec.deltas_only,
        )

    async def _open(
        self, spec: TurnSpec, admitted: Admitted, choice: WorkerChoice, *, stream: bool
    ) -> tuple[WorkerTurn, list[worker_pb2.TurnEvent], WorkerChoice]:
        """Starts the turn on its worker's stream and waits for its first events (routed to
        another worker once when that one cannot be reached), before anything reaches the
        client."""
        request = self._generate_request(spec, admitted)
        trace = tracing.current()
        rerouted = False
        while True:
            turn = self._workers.start(
                choice.address,
                request,
                stream=stream,
                timeout_s=spec.remaining_s(),
                traceparent=trace.header() if trace is not None else "",
            )
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

    async def _record(
        self,
        spec: TurnSpec,
        admitted: Admitted,
        record: common_pb2.TurnRecord,
        spans: list[tuple[int, int]] | None,
    ) -> Recorded:
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
