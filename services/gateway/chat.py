"""OpenAI chat completions: check the key, read the body once, relay the turn."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import hdrs, web

from services.gateway.auth import require_session_key
from services.gateway.backends import RELAY, SETTINGS
from services.gateway.header_mode import TurnTags, body_tags, turn_tags
from services.gateway.http_errors import JSON_CONTENT_TYPE, sse_error_event
from services.gateway.json_body import load_json
from services.gateway.protocols import Protocol, Route, openai_paths
from services.gateway.relay import Chunks, Delta, Done, Push, TurnSpec, split_body
from services.runtime.errors import InvalidRequest, RollgateError, check_identifier
from services.runtime.keys import key_digest
from services.runtime.logs import get_logger

log = get_logger(__name__)

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
SSE_DONE = b"data: [DONE]\n\n"
# Chunks are pushed to a client only while its connection holds less than this unsent (what
# aiohttp's writer lets pile up before it waits for the client).
PUSH_LIMIT_BYTES = 64 * 1024
# What one protocol pushes: chat chunks, or deltas.
E = TypeVar("E", Chunks, Delta)


class EventStream(web.StreamResponse):
    """An SSE response whose headers go out with its first event, in one write: every stream
    here is prepared with its first event in hand and writes it at once. aiohttp's
    StreamResponse sends its headers alone when prepared (a `web.Response` waits for its
    body): a system call more per streamed turn, and a client that wakes for the headers and
    again for the first event."""

    _send_headers_immediately = False

    def __init__(self) -> None:
        super().__init__(headers=SSE_HEADERS)


_MAX_REQUEST_ID_LEN = 128


@dataclass(slots=True, kw_only=True)  # not frozen: built every turn (half the cost)
class ChatCall:
    """What the gateway reads from a chat-completions body; the rest passes through."""

    model: str
    stream: bool
    # OpenClaw-RL's body keys session_id / turn_type / session_done (headers are merged later).
    tags: TurnTags = field(default_factory=TurnTags)
    # The parsed body (parsed once: the relay serializes its parts for the worker).
    body: dict[str, Any] = field(default_factory=dict)


def parse_chat_body(raw: bytes) -> ChatCall:
    """Validates the fields the gateway relies on; InvalidRequest says what is wrong."""
    if not raw.strip():
        raise InvalidRequest(
            "the request body is empty: send a JSON object with model and messages"
        )
    # Its depth is checked by split_body's encoding, which every chat turn does next.
    body: Any = load_json(raw, check_depth=False)
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
    check_identifier(model, "`model`")
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequest("`stream` must be true or false")
    return ChatCall(model=model, stream=stream, tags=body_tags(body), body=body)


def request_id_of(request: web.Request) -> str:
    """The caller's X-Request-Id when it is usable, else a new one."""
    given = request.headers.get("X-Request-Id", "").strip()
    return given if 0 < len(given) <= _MAX_REQUEST_ID_LEN else os.urandom(16).hex()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions and /chat/completions."""
    settings = request.app[SETTINGS]
    key = require_session_key(request.headers, settings.admin_key)
    call = parse_chat_body(await request.read())
    request_json, params_json = split_body(call.body)
    spec = TurnSpec(
        digest=key_digest(key),
        model=call.model,
        request_json=request_json,
        params_json=params_json,
        request_id=request_id_of(request),
        deadline=time.monotonic() + settings.request_timeout_s,
        tags=turn_tags(request.headers, call.tags),
    )
    if call.stream:
        return await _stream(request, spec)
    body = await request.app[RELAY].answer(spec)
    return web.Response(body=body, content_type=JSON_CONTENT_TYPE)


def _sse(payloads: Sequence[bytes]) -> bytes:
    if not payloads:
        return b""
    return b"data: " + b"\n\ndata: ".join(payloads) + b"\n\n"


class Pusher:
    """Writes a streaming answer's later events to the client from the worker stream's read
    callback (`TurnRelay.stream(push=…)`): no wake-up of the handler per batch. Only where
    a write needs nothing from aiohttp's writer but framing: an uncompressed body, its
    headers already sent (the relay pushes only after the first batch was written), the
    client's side of the connection not behind (its transport's buffer below aiohttp's own
    drain limit) and not closing. Otherwise it refuses, and the relay yields the batch to
    the handler, whose `response.write` waits for the client or fails as it always did.
    Chat completions, Responses and Anthropic Messages push through one each."""

    __slots__ = ("_chunked", "_transport")

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._chunked = False

    def ready(self, request: web.Request, response: web.StreamResponse) -> None:
        """The response is prepared and its first events written: pushing may start."""
        if response.compression:
            return
        self._transport = request.transport
        self._chunked = response.headers.get(hdrs.TRANSFER_ENCODING, "").lower() == "chunked"

    def writable(self) -> bool:
        """Whether a write can go out now (ask before building what it writes)."""
        transport = self._transport
        return not (
            transport is None
            or transport.is_closing()
            or transport.get_write_buffer_size() >= PUSH_LIMIT_BYTES
        )

    def write(self, data: bytes) -> None:
        """Writes `data` (the response's next bytes, framed as aiohttp frames them); only
        after `writable()` said yes."""
        assert self._transport is not None
        if data:
            self._transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)

    def pushing(self, kind: type[E], render: Callable[[E], bytes]) -> Push:
        """The relay's push for a protocol: an event of `kind`, rendered to the response's
        bytes and written now — rendered only once the write can go out, since rendering moves
        a protocol's stream state on; False for any other event, or when it cannot."""

        def push(event: Chunks | Delta) -> bool:
            if not isinstance(event, kind) or not self.writable():
                return False
            self.write(render(event))
            return True

        return push


async def _stream(request: web.Request, spec: TurnSpec) -> web.StreamResponse:
    pusher = Pusher()
    events = request.app[RELAY].stream(
        spec, push=pusher.pushing(Chunks, lambda chunks: _sse(chunks.payloads))
    )
    async with contextlib.aclosing(events):
        # The first event comes before any header: an early failure is a plain JSON error.
        event = await anext(events)
        response = EventStream()
        await response.prepare(request)
        pusher.ready(request, response)
        try:
            while not isinstance(event, Done):
                if isinstance(event, Chunks):
                    await response.write(_sse(event.payloads))
                event = await anext(events)
            # The last chunks, [DONE] and the end of the body in one write, once the turn is
            # recorded.
            await response.write_eof(_sse(event.tail) + SSE_DONE)
        except RollgateError as err:
            await response.write_eof(sse_error_event(err))
        except ConnectionResetError:
            log.info("client_disconnected", request_id=spec.request_id)
    return response


PROTOCOL = Protocol(
    name="chat",
    routes=tuple(
        Route(method="POST", path=path, handler=chat_completions)
        for path in openai_paths("/chat/completions")
    ),
)
