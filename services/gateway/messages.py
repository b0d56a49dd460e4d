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

from services.gateway import chat
from services.gateway.auth import require_session_key
from services.gateway.backends import RELAY, SETTINGS
from services.gateway.header_mode import TurnTags, turn_tags
from services.gateway.http_errors import json_response
from services.gateway.messages_translate import (
    MESSAGES_PATH,
    MessagesCall,
    MessageStream,
    error_body,
    error_event,
    message_from_completion,
    new_message_id,
    parse_request,
)
from services.gateway.protocols import Protocol, Route, Twins
from services.gateway.relay import Chunks, Done, Push, TurnSpec, split_body
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
    body = await request.app[RELAY].answer(spec)
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


async def _chunks(
    request: web.Request, spec: TurnSpec, push: Push | None = None
) -> AsyncGenerator[_Batch, None]:
    """The chat chunks of a streamed turn as batches arrive; the last batch (the chunks that
    came with the end) once the turn is recorded. Nothing is yielded before the relay's first
    event, so an early failure is raised before anything reaches the client. With `push`,
    the batches the relay pushes after the first are not yielded (TurnRelay.stream)."""
    events = request.app[RELAY].stream(spec, push=push)
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
    pusher = chat.Pusher()
    # A batch of chat chunks as Anthropic's events, written as the worker's stream reads it.
    push = pusher.pushing(
        Chunks,
        lambda chunks: b"".join(
            event for chunk in _parsed(chunks.payloads) for event in stream.feed(chunk)
        ),
    )
    batches = _chunks(request, spec, push)
    # Read before any header is sent: a failure before the first token is a plain JSON error.
    first = await anext(batches, None)
    response = chat.EventStream()
    try:
        await response.prepare(request)
        # message_start names the served model and the prompt's length, from the first batch.
        events = stream.start(
            first.chunks if first else (),
            model=first.model if first else "",
            input_tokens=first.prompt_tokens if first else 0,
        )
        await response.write(b"".join(events))
        pusher.ready(request, response)  # the relay pushes from the second batch on
        while (batch := await anext(batches, None)) is not None:
            events = []
            for chunk in batch.chunks:
                events += stream.feed(chunk)
            await response.write(b"".join(events))
        # The last events and the end of the body in one write.
        await response.write_eof(b"".join(stream.finish()))
    except RollgateError as err:
        log.warning("message_stream_failed", code=err.code, message=err.message)
        await response.write_eof(error_event(err.http_status, err.message, err.code))
    except ConnectionResetError:
        log.info("client_disconnected", message_id=message_id)
    finally:
        await batches.aclose()
    return response


async def count_tokens(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages/count_tokens: not served, with a 404 that says so and what to do."""
    raise NotFound(COUNT_TOKENS_NOT_SERVED, code="count_tokens_not_served")


PROTOCOL = Protocol(
    name="messages",
    routes=(
        Route(method="POST", path="/v1/messages", handler=create_message),
        # Not a session-key route: the 404 needs no key, and says the same under every prefix.
        Route(
            method="POST", path="/v1/messages/count_tokens", handler=count_tokens, twins=Twins.SAME
        ),
    ),
    # Anthropic's shape on these paths, for every error (auth, routing, limits, the relay).
    error_paths=MESSAGES_PATH,
    error_body=error_body,
)
