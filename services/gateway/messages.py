"""Anthropic Messages (`POST /v1/messages`) on the turn relay, recorded like a chat turn.

The request is translated to the upstream's chat format (services/gateway/messages_translate.py)
and relayed as one chat turn, recorded under the `msg_…` id the client sees. A streamed answer
becomes Anthropic's events as the chunks arrive; errors on these paths take Anthropic's shape.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

from services.gateway import chat
from services.gateway.auth import require_session_key
from services.gateway.backends import RELAY, SETTINGS
from services.gateway.header_mode import TurnTags, turn_tags
from services.gateway.http_errors import JSON_CONTENT_TYPE, json_response
from services.gateway.messages_translate import (
    MessagesCall,
    MessageStream,
    error_body,
    error_event,
    is_messages_path,
    message_from_completion,
    new_message_id,
    parse_request,
)
from services.gateway.relay import Chunks, Done, TurnSpec, split_body
from services.gateway.url_sessions import ATTEMPT_PREFIX, SESSION_PREFIX
from services.runtime.errors import NotFound, RollgateError
from services.runtime.keys import key_digest
from services.runtime.logs import get_logger

log = get_logger(__name__)

COUNT_TOKENS_NOT_SERVED = (
    "rollgate does not serve /v1/messages/count_tokens: it relays and records turns, it does "
    "not count tokens ahead of them. Count with the model's tokenizer (a vLLM upstream itself "
    "serves POST /tokenize and /v1/messages/count_tokens), or read usage.input_tokens of the "
    "/v1/messages answer"
)


def _spec(request: web.Request, key: str, call: MessagesCall, message_id: str) -> TurnSpec:
    body = call.chat | (
        {"stream": True, "stream_options": {"include_usage": True}}
        if call.stream
        else {"stream": False}
    )
    request_json, params_json = split_body(body)
    return TurnSpec(
        digest=key_digest(key),
        model=call.model,
        request_json=request_json,
        params_json=params_json,
        request_id=chat.request_id_of(request),
        deadline=time.monotonic() + request.app[SETTINGS].request_timeout_s,
        # The interaction is the message the client saw: set_reward takes its msg_… id.
        interaction_id=message_id,
        tags=turn_tags(request.headers, TurnTags()),
    )


async def _complete(request: web.Request, spec: TurnSpec) -> dict[str, Any]:
    """The chat completion of a non-streamed turn, once it is recorded."""
    body, _ = await request.app[RELAY].complete(spec)
    completion: dict[str, Any] = orjson.loads(body)
    return completion


def _parsed(payloads: list[bytes]) -> list[Any]:
    return [orjson.loads(p) for p in payloads if p.strip() != b"[DONE]"]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Batch:
    """Parsed chat chunks that arrived together."""

    chunks: list[Any]
    # The prompt's length in tokens when known (else 0).
    prompt_tokens: int = 0
    # The recorded model (only on the last batch, which comes with the record).
    model: str = ""


def _prompt_tokens(usage: dict[str, Any]) -> int:
    value = usage.get("prompt_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


async def _chunks(request: web.Request, spec: TurnSpec) -> AsyncGenerator[_Batch, None]:
    """The chat chunks of a streamed turn as batches arrive; the last batch (the chunks that
    came with the end) once the turn is recorded. Nothing is yielded before the relay's first
    event, so an early failure is raised before anything reaches the client."""
    events = request.app[RELAY].stream(spec)
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, Chunks):
                yield _Batch(chunks=_parsed(event.payloads), prompt_tokens=event.prompt_tokens)
            elif isinstance(event, Done):
                yield _Batch(
                    chunks=_parsed(event.tail),
                    prompt_tokens=_prompt_tokens(event.usage),
                    model=event.model,
                )
                return


async def create_message(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages (`x-api-key` or `Authorization: Bearer`; `anthropic-version` and
    `anthropic-beta` are accepted and not needed)."""
    settings = request.app[SETTINGS]
    key = require_session_key(request.headers, settings.admin_key)
    call = parse_request(await request.read())
    message_id = new_message_id()
    spec = _spec(request, key, call, message_id)
    if not call.stream:
        completion = await _complete(request, spec)
        return json_response(
            message_from_completion(
                completion,
                message_id=message_id,
                model=call.model,
                stop_sequences=call.stop_sequences,
            )
        )
    stream = MessageStream(
        message_id=message_id, model=call.model, stop_sequences=call.stop_sequences
    )
    batches = _chunks(request, spec)
    # Read before any header is sent: a failure before the first token is a plain JSON error.
    first = await anext(batches, None)
    response = web.StreamResponse(headers=chat.SSE_HEADERS)
    try:
        await response.prepare(request)
        # message_start names the served model and the prompt's length, from the first batch.
        events = stream.start(
            first.chunks if first else (),
            model=first.model if first else "",
            input_tokens=first.prompt_tokens if first else 0,
        )
        await response.write(b"".join(events))
        while (batch := await anext(batches, None)) is not None:
            events = []
            for chunk in batch.chunks:
                events += stream.feed(chunk)
            await response.write(b"".join(events))
        await response.write(b"".join(stream.finish()))
    except RollgateError as err:
        log.warning("message_stream_failed", code=err.code, message=err.message)
        await response.write(error_event(err.http_status, err.message, err.code))
    except ConnectionResetError:
        log.info("client_disconnected", message_id=message_id)
    finally:
        await batches.aclose()
    return response


@web.middleware
async def anthropic_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Errors on the Messages paths in Anthropic's shape (`{"type": "error", "error": {type,
    message, code}}`), same status and headers; it wraps the error middleware, so every error an
    Anthropic client can meet there (auth, routing, body limits, the relay) is covered."""
    response = await handler(request)
    # The raw path: decoded, an escaped `/` in a session id (`..%2F..`) would hide the route.
    if response.status < 400 or not is_messages_path(request.raw_path.partition("?")[0]):
        return response
    if not isinstance(response, web.Response) or response.content_type != JSON_CONTENT_TYPE:
        return response
    try:
        body: Any = orjson.loads(response.body) if isinstance(response.body, bytes) else None
    except orjson.JSONDecodeError:
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    error = error if isinstance(error, dict) else {}
    message, code = error.get("message"), error.get("code")
    response.body = orjson.dumps(
        error_body(
            response.status,
            message if isinstance(message, str) else response.reason,
            code if isinstance(code, str) else "",
        )
    )
    return response


async def count_tokens(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages/count_tokens: not served, with a 404 that says so and what to do."""
    raise NotFound(COUNT_TOKENS_NOT_SERVED, code="count_tokens_not_served")


def mount(app: web.Application) -> None:
    """Adds POST /v1/messages to `app` (its error shape comes from `anthropic_errors`), and
    the count_tokens 404 at the top level and under the session prefixes."""
    app.router.add_post("/v1/messages", create_message)
    # Not a session-key route: the 404 needs no key, and says the same under every prefix.
    for prefix in ("", SESSION_PREFIX, ATTEMPT_PREFIX):
        app.router.add_post(prefix + "/v1/messages/count_tokens", count_tokens)
