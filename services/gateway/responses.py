"""Open Responses (`POST /v1/responses`, `/responses`, `GET /v1/responses/{id}`) over chat.

A response is one upstream chat call on the chat path (recorded like any interaction of the
key's current episode). `previous_response_id` chains are kept by the dataproxy's
Conversations service: the chain's items are read in one call and the new response is stored
in one call (see services/dataproxy/conversations.py).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from aiohttp import web

from services.gateway.auth import require_session_key
from services.gateway.backends import RELAY, SETTINGS
from services.gateway.chat import SSE_DONE, EventStream, Pusher
from services.gateway.header_mode import TurnTags, turn_tags
from services.gateway.http_errors import json_response
from services.gateway.protocols import Protocol, Route, openai_paths
from services.gateway.relay import Delta, Done, Event, bridge_spec
from services.gateway.responses_store import CONVERSATIONS, conversations_ctx
from services.gateway.responses_translate import (
    ItemIds,
    ResponsesCall,
    chat_body,
    function_call_item,
    message_item,
    new_id,
    parse_request,
    reasoning_item,
    response_object,
    status_of,
    usage,
)
from services.runtime.errors import NotFound, RollgateError, check_identifier
from services.runtime.keys import key_digest
from services.runtime.logs import get_logger

log = get_logger(__name__)

INTERACTION_HEADER = "X-Rollgate-Interaction-Id"


class ResponseBuilder:
    """Turns upstream deltas into Responses stream events and the final response object."""

    def __init__(self, call: ResponsesCall, *, response_id: str) -> None:
        self.call = call
        self.response_id = response_id
        self.created_at = int(time.time())
        self.ids = ItemIds.new()
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []
        self._text: list[str] = []
        self._text_index: int | None = None
        self._reasoning: list[str] = []
        self._reasoning_index: int | None = None
        # tool-call index → (output index, fragments of its arguments)
        self._calls: dict[int, tuple[int, list[str]]] = {}
        self._open_calls: list[int] = []

    def event(self, kind: str, **payload: Any) -> bytes:
        """One SSE event: `event:` equals the JSON `type`; sequence numbers rise by one."""
        data = {"type": kind, "sequence_number": self.sequence_number, **payload}
        self.sequence_number += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def snapshot(self, status: str, **extra: Any) -> dict[str, Any]:
        """The response object as it stands."""
        return response_object(
            self.call,
            response_id=self.response_id,
            created_at=self.created_at,
            status=status,
            output=self.output,
            **extra,
        )

    def start(self) -> list[bytes]:
        """`response.created` and `response.in_progress`."""
        pending = self.snapshot("in_progress")
        return [
            self.event("response.created", response=pending),
            self.event("response.in_progress", response=pending),
        ]

    def _add(self, item: dict[str, Any]) -> tuple[int, bytes]:
        index = len(self.output)
        self.output.append(item)
        return index, self.event("response.output_item.added", output_index=index, item=item)

    def _close_reasoning(self) -> list[bytes]:
        if self._reasoning_index is None:
            return []
        index, text = self._reasoning_index, "".join(self._reasoning)
        self._reasoning_index = None
        self.output[index] = reasoning_item(self.ids, text, "completed")
        common = {"item_id": self.ids.reasoning, "output_index": index, "content_index": 0}
        return [
            self.event("response.reasoning_text.done", text=text, **common),
            self.event("response.output_item.done", output_index=index, item=self.output[index]),
        ]

    def _close_text(self, status: str = "completed") -> list[bytes]:
        if self._text_index is None:
            return []
        index, text = self._text_index, "".join(self._text)
        self._text_index = None
        self.output[index] = message_item(self.ids, text, status)
        part = self.output[index]["content"][0]
        common = {"item_id": self.ids.message, "output_index": index, "content_index": 0}
        return [
            self.event("response.output_text.done", text=text, logprobs=[], **common),
            self.event("response.content_part.done", part=part, **common),
            self.event("response.output_item.done", output_index=index, item=self.output[index]),
        ]

    def _close_calls(self, status: str = "completed") -> list[bytes]:
        events = []
        for tool_index in self._open_calls:
            index, fragments = self._calls[tool_index]
            item = self.output[index] | {"arguments": "".join(fragments), "status": status}
            self.output[index] = item
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
            )
            events.append(self.event("response.output_item.done", output_index=index, item=item))
        self._open_calls = []
        return events

    def _open_text(self) -> list[bytes]:
        if self._text_index is not None:
            return []
        index, added = self._add(message_item(self.ids, "", "in_progress") | {"content": []})
        self._text_index = index
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        common = {"item_id": self.ids.message, "output_index": index, "content_index": 0}
        return [added, self.event("response.content_part.added", part=part, **common)]

    def delta(self, delta: Delta) -> list[bytes]:
        """The events of one upstream delta."""
        events: list[bytes] = []
        if delta.reasoning:
            if self._reasoning_index is None:
                index, added = self._add(reasoning_item(self.ids, "", "in_progress"))
                self._reasoning_index = index
                events.append(added)
            self._reasoning.append(delta.reasoning)
            events.append(
                self.event(
                    "response.reasoning_text.delta",
                    item_id=self.ids.reasoning,
                    output_index=self._reasoning_index,
                    content_index=0,
                    delta=delta.reasoning,
                )
            )
        if delta.content:
            events += self._close_reasoning() + self._open_text()
            self._text.append(delta.content)
            events.append(
                self.event(
                    "response.output_text.delta",
                    item_id=self.ids.message,
                    output_index=self._text_index,
                    content_index=0,
                    delta=delta.content,
                    logprobs=[],
                )
            )
        for fragment in delta.tool_calls:
            events += self._close_reasoning() + self._close_text()
            if fragment.index not in self._calls:
                item = function_call_item(
                    new_id("fc"), fragment.call_id, fragment.name, "", "in_progress"
                )
                index, added = self._add(item)
                self._calls[fragment.index] = (index, [])
                self._open_calls.append(fragment.index)
                events.append(added)
            index, fragments = self._calls[fragment.index]
            if fragment.arguments:
                fragments.append(fragment.arguments)
                events.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=self.output[index]["id"],
                        output_index=index,
                        delta=fragment.arguments,
                    )
                )
        return events

    def finish(self, done: Done) -> tuple[dict[str, Any], list[bytes]]:
        """The final response and the events that close every open item and the response
        (after the deltas that came with the end)."""
        status, incomplete = status_of(done.finish_reason)
        item_status = "incomplete" if status == "incomplete" else "completed"
        events = self.delta(done.tail_delta) if done.tail_delta is not None else []
        events += self._close_reasoning()
        events += self._close_text(item_status if not self._open_calls else "completed")
        events += self._close_calls(item_status)
        if not self.output:
            # An empty answer is still one (empty) assistant message.
            events += self._open_text() + self._close_text(item_status)
        for index, call in enumerate(done.tool_calls):
            if index in self._calls:
                out_index = self._calls[index][0]
                self.output[out_index]["call_id"] = call.call_id
                self.output[out_index]["name"] = call.name
        final = self.snapshot(status, usage_json=usage(done.usage), incomplete_details=incomplete)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return final, [*events, self.event(kind, response=final)]

    def fail(self, err: RollgateError) -> list[bytes]:
        """`error` then `response.failed`."""
        error = {"type": err.error_type, "code": err.code, "message": err.message, "param": None}
        failed = self.snapshot("failed", error={"code": err.code, "message": err.message})
        return [
            self.event("error", code=err.code, message=err.message, param=None, error=error),
            self.event("response.failed", response=failed),
        ]


async def _prepare_turn(request: web.Request) -> tuple[str, ResponsesCall, dict[str, Any]]:
    settings = request.app[SETTINGS]
    digest = key_digest(require_session_key(request.headers, settings.admin_key))
    call = parse_request(await request.read())
    prior: list[dict[str, Any]] = []
    if call.previous_response_id:
        _, chain = await request.app[CONVERSATIONS].get_response(
            digest, call.previous_response_id, include_chain=True
        )
        prior = [orjson.loads(item) for item in chain]
    return digest, call, chat_body(call, prior)


async def _store(
    request: web.Request, digest: str, call: ResponsesCall, final: dict[str, Any]
) -> None:
    if not call.store:
        return
    await request.app[CONVERSATIONS].put_response(
        digest,
        response_id=final["id"],
        previous_response_id=call.previous_response_id,
        items=[orjson.dumps(item) for item in call.input_items + final["output"]],
        response_json=orjson.dumps(final),
    )


async def create_response(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses and /responses."""
    digest, call, body = await _prepare_turn(request)
    builder = ResponseBuilder(call, response_id=new_id("resp"))
    spec = bridge_spec(
        digest=digest,
        body=body,
        request_id=uuid.uuid4().hex,
        timeout_s=request.app[SETTINGS].request_timeout_s,
        # The interaction is the response the client saw: set_reward takes its resp_… id.
        interaction_id=builder.response_id,
        # Header-mode keys: X-Session-Id (or a /sessions/<id>/ path) names the episode.
        tags=turn_tags(request.headers, TurnTags()),
    )
    pusher = Pusher()
    upstream = request.app[RELAY].stream(
        spec,
        push=pusher.pushing(Delta, lambda delta: b"".join(builder.delta(delta)))
        if call.stream
        else None,
    )
    async with contextlib.aclosing(upstream) as items:
        if call.stream:
            return await _stream(request, digest, builder, items, pusher)
        done: Done | None = None
        async for item in items:
            if isinstance(item, Delta):
                builder.delta(item)
            elif isinstance(item, Done):
                done = item
    assert done is not None
    final, _ = builder.finish(done)
    await _store(request, digest, call, final)
    response = json_response(final)
    response.headers[INTERACTION_HEADER] = done.interaction_id
    return response


async def _stream(
    request: web.Request,
    digest: str,
    builder: ResponseBuilder,
    items: AsyncIterator[Event],
    pusher: Pusher,
) -> web.StreamResponse:
    # The first item comes before any header: an early failure is a plain JSON error.
    first = await anext(items)
    response = EventStream()
    await response.prepare(request)
    await response.write(b"".join(builder.start()))
    pusher.ready(request, response)  # the relay pushes from the second batch on
    item: Event = first
    try:
        while not isinstance(item, Done):
            if isinstance(item, Delta):
                await response.write(b"".join(builder.delta(item)))
            item = await anext(items)
        final, events = builder.finish(item)
        await _store(request, digest, builder.call, final)
        # The last events, [DONE] and the end of the body in one write.
        await response.write_eof(b"".join(events) + SSE_DONE)
    except RollgateError as err:
        log.warning("response_stream_failed", code=err.code, message=err.message)
        await response.write_eof(b"".join(builder.fail(err)) + SSE_DONE)
    except ConnectionResetError:
        log.info("client_disconnected", response_id=builder.response_id)
    return response


async def get_response(request: web.Request) -> web.Response:
    """GET /v1/responses/{id}: a stored response of this key."""
    settings = request.app[SETTINGS]
    digest = key_digest(require_session_key(request.headers, settings.admin_key))
    response_id = check_identifier(request.match_info["response_id"], "the response id")
    try:
        raw, _ = await request.app[CONVERSATIONS].get_response(
            digest, response_id, include_chain=False
        )
    except NotFound as err:
        raise NotFound(err.message, code="response_not_found") from None
    return web.Response(body=raw, content_type="application/json")


def _setup(app: web.Application) -> None:
    """The Conversations channel the handlers use."""
    if conversations_ctx not in app.cleanup_ctx:
        app.cleanup_ctx.append(conversations_ctx)


PROTOCOL = Protocol(
    name="responses",
    routes=tuple(
        route
        for post, get in zip(
            openai_paths("/responses"), openai_paths("/responses/{response_id}"), strict=True
        )
        for route in (
            Route(method="POST", path=post, handler=create_response),
            Route(method="GET", path=get, handler=get_response),
        )
    ),
    setup=_setup,
)
