"""OpenAI chat completions: check the key, read the body once, route, relay the dataproxy."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc
import orjson
from aiohttp import web

from protos import dataproxy_pb2
from services.gateway.auth import require_session_key
from services.gateway.backends import BACKENDS, SETTINGS
from services.gateway.header_mode import TurnTags, body_tags, turn_tags
from services.gateway.http_errors import JSON_CONTENT_TYPE, sse_error_event
from services.gateway.routing import RouteCache, WorkerChoice, choose_worker
from services.runtime.errors import (
    InternalError,
    InvalidRequest,
    RollgateError,
    UpstreamTimeout,
    from_rpc_error,
)
from services.runtime.keys import key_digest
from services.runtime.logs import get_logger

if TYPE_CHECKING:
    from protos.dataproxy_pb2_grpc import DataProxyAsyncStub

log = get_logger(__name__)

ROUTE_CACHE = web.AppKey("route_cache", RouteCache)

# The dataproxy's code for "the worker the router chose could not be reached".
WORKER_UNAVAILABLE_CODE = "worker_unavailable"
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
SSE_DONE = b"data: [DONE]\n\n"
_MAX_REQUEST_ID_LEN = 128


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatCall:
    """What the gateway reads from a chat-completions body; the rest passes through."""

    model: str
    stream: bool
    # OpenClaw-RL's body keys session_id / turn_type / session_done (headers are merged later).
    tags: TurnTags = field(default_factory=TurnTags)


@dataclass(frozen=True, slots=True, kw_only=True)
class Turn:
    """One chat turn on its way to the dataproxy."""

    digest: str
    model: str
    body: bytes
    request_id: str
    # time.monotonic() by which the whole turn must be done.
    deadline: float
    # Record the turn under this id (the id the client saw); empty: the completion id.
    interaction_id: str = ""
    # OpenClaw-RL's session headers (services/gateway/header_mode.py).
    tags: TurnTags = field(default_factory=TurnTags)

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


def parse_chat_body(raw: bytes) -> ChatCall:
    """Validates the fields the gateway relies on; InvalidRequest says what is wrong."""
    if not raw.strip():
        raise InvalidRequest(
            "the request body is empty: send a JSON object with model and messages"
        )
    try:
        body: Any = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        raise InvalidRequest(f"the request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("`messages` must be a non-empty list of message objects")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages[{index}] must be an object with a string `role`")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("`model` is required and must be a non-empty string")
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequest("`stream` must be true or false")
    return ChatCall(model=model, stream=stream, tags=body_tags(body))


def _request_id(request: web.Request) -> str:
    given = request.headers.get("X-Request-Id", "").strip()
    return given if 0 < len(given) <= _MAX_REQUEST_ID_LEN else uuid.uuid4().hex


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions and /chat/completions."""
    settings = request.app[SETTINGS]
    key = require_session_key(request.headers, settings.admin_key)
    raw = await request.read()
    call = parse_chat_body(raw)
    turn = Turn(
        digest=key_digest(key),
        model=call.model,
        body=raw,
        request_id=_request_id(request),
        deadline=time.monotonic() + settings.request_timeout_s,
        tags=turn_tags(request.headers, call.tags),
    )
    if call.stream:
        return await _stream(request, turn)
    return await _complete(request, turn)


class Relay:
    """Routes a turn and retries once on another worker when the chosen one is unreachable."""

    def __init__(self, request: web.Request, turn: Turn) -> None:
        self.turn = turn
        self.backends = request.app[BACKENDS]
        self.cache = request.app[ROUTE_CACHE]
        self.rpc_timeout_s = request.app[SETTINGS].rpc_timeout_s
        self.avoid_worker_id = ""
        self.rerouted = False
        # The worker of the latest route (where an abort of the turn must go).
        self.worker_address = ""

    @property
    def dataproxy(self) -> DataProxyAsyncStub:
        return self.backends.dataproxy

    async def route(self) -> tuple[WorkerChoice, dataproxy_pb2.ChatRequest]:
        """The worker for this attempt and the request to send through the dataproxy."""
        turn = self.turn
        choice = await choose_worker(
            self.backends.router,
            self.cache,
            digest=turn.route_key,
            model=turn.model,
            timeout_s=min(self.rpc_timeout_s, turn.remaining_s()),
            avoid_worker_id=self.avoid_worker_id,
        )
        request = dataproxy_pb2.ChatRequest(
            key_digest=turn.digest,
            worker_address=choice.address,
            body_json=turn.body,
            request_id=turn.request_id,
            interaction_id=turn.interaction_id,
            session_id=turn.tags.session_id,
            turn_type=turn.tags.turn_type,
            session_done=turn.tags.session_done,
        )
        self.worker_address = choice.address
        return choice, request

    def retry_elsewhere(self, error: RollgateError, choice: WorkerChoice) -> bool:
        """True (once) when `error` says the worker was unreachable: the next route avoids it."""
        if error.code != WORKER_UNAVAILABLE_CODE or self.rerouted:
            return False
        self.cache.drop(self.turn.route_key, self.turn.model)
        self.avoid_worker_id = choice.worker_id
        self.rerouted = True
        log.warning("worker_unreachable_rerouting", worker_id=choice.worker_id)
        return True


async def _complete(request: web.Request, turn: Turn) -> web.Response:
    relay = Relay(request, turn)
    while True:
        choice, chat_request = await relay.route()
        try:
            response = await relay.dataproxy.Complete(chat_request, timeout=turn.remaining_s())
        except grpc.aio.AioRpcError as err:
            error = from_rpc_error(err, hop="dataproxy")
            if relay.retry_elsewhere(error, choice):
                continue
            raise error from None
        return web.Response(body=response.body_json, content_type=JSON_CONTENT_TYPE)


_Call: TypeAlias = grpc.aio.UnaryStreamCall[dataproxy_pb2.ChatRequest, dataproxy_pb2.ChatResponse]


async def open_stream(relay: Relay) -> tuple[_Call, dataproxy_pb2.ChatResponse]:
    """Starts `DataProxy.Chat` and reads its first message, before any header is sent."""
    while True:
        choice, chat_request = await relay.route()
        call = relay.dataproxy.Chat(chat_request, timeout=relay.turn.remaining_s())
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as err:
            error = from_rpc_error(err, hop="dataproxy")
            if relay.retry_elsewhere(error, choice):
                continue
            raise error from None
        except BaseException:
            call.cancel()
            raise
        if first is grpc.aio.EOF:
            raise InternalError("the dataproxy ended the stream without an answer")
        assert isinstance(first, dataproxy_pb2.ChatResponse)
        return call, first


async def _stream(request: web.Request, turn: Turn) -> web.StreamResponse:
    call, message = await open_stream(Relay(request, turn))
    response = web.StreamResponse(headers=SSE_HEADERS)
    try:
        await response.prepare(request)
        await _relay_events(response, call, message)
        await response.write_eof()
    except ConnectionResetError:
        log.info("client_disconnected", request_id=turn.request_id)
    finally:
        # A no-op when the stream is complete; stops the turn when the client went away.
        call.cancel()
    return response


async def _relay_events(
    response: web.StreamResponse, call: _Call, message: dataproxy_pb2.ChatResponse
) -> None:
    """Writes each chunk batch as SSE events; `[DONE]` once the turn is recorded."""
    while True:
        kind = message.WhichOneof("kind")
        if kind == "chunks":
            await response.write(b"".join(b"data: " + c + b"\n\n" for c in message.chunks.chunks))
        elif kind == "done":
            await response.write(SSE_DONE)
            return
        try:
            received = await call.read()
        except grpc.aio.AioRpcError as err:
            await response.write(sse_error_event(from_rpc_error(err, hop="dataproxy")))
            return
        if received is grpc.aio.EOF:
            error = InternalError("the stream ended before the turn was recorded")
            await response.write(sse_error_event(error))
            return
        assert isinstance(received, dataproxy_pb2.ChatResponse)
        message = received
