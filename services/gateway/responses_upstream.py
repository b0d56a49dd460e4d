"""One upstream chat call for the Responses and WebSocket bridges, on the chat path's relay.

Every call goes through `DataProxy.Chat` exactly like `/v1/chat/completions` (same routing,
same reroute, same recording), always streaming with usage; the chunks are parsed into deltas
here, and the last item is the accumulated completion with the interaction id it was
recorded under.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import orjson
from aiohttp import web

from protos import dataproxy_pb2
from services.gateway import chat
from services.gateway.header_mode import TurnTags
from services.runtime.errors import InternalError, from_rpc_error


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallDelta:
    """A fragment of one tool call (id and name only on its first fragment)."""

    index: int
    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Delta:
    """What one upstream chunk added."""

    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCall:
    """A complete tool call."""

    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Completion:
    """The whole answer, once the dataproxy recorded the turn."""

    content: str
    reasoning: str
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str
    usage: dict[str, Any]
    model: str
    interaction_id: str
    session_id: str

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


@dataclass(slots=True)
class _PartialCall:
    call_id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class ChunkAccumulator:
    """Parses chat-completion chunks into deltas and remembers the whole answer."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, _PartialCall] = {}
        self.finish_reason = ""
        self.usage: dict[str, Any] = {}
        self.model = ""

    def feed(self, chunk: Any) -> Delta | None:
        """The delta of one chunk (None when it adds no text or call fragment)."""
        if not isinstance(chunk, dict):
            return None
        if isinstance(chunk.get("model"), str) and chunk["model"]:
            self.model = chunk["model"]
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return None
        choice = choices[0]
        if isinstance(choice.get("finish_reason"), str):
            self.finish_reason = choice["finish_reason"]
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return None
        raw_content = delta.get("content")
        content = raw_content if isinstance(raw_content, str) else ""
        reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
        reasoning = reasoning if isinstance(reasoning, str) else ""
        calls = tuple(self._feed_calls(delta.get("tool_calls")))
        self.content.append(content)
        self.reasoning.append(reasoning)
        if not (content or reasoning or calls):
            return None
        return Delta(content=content, reasoning=reasoning, tool_calls=calls)

    def _feed_calls(self, raw: Any) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        for fragment in raw if isinstance(raw, list) else ():
            if not isinstance(fragment, dict):
                continue
            index = fragment.get("index")
            index = index if isinstance(index, int) else len(self.calls)
            partial = self.calls.setdefault(index, _PartialCall())
            function = fragment.get("function")
            function = function if isinstance(function, dict) else {}
            if isinstance(fragment.get("id"), str) and fragment["id"]:
                partial.call_id = fragment["id"]
            if isinstance(function.get("name"), str) and function["name"]:
                partial.name = function["name"]
            arguments = function.get("arguments")
            arguments = arguments if isinstance(arguments, str) else ""
            partial.arguments.append(arguments)
            out.append(
                ToolCallDelta(
                    index=index, call_id=partial.call_id, name=partial.name, arguments=arguments
                )
            )
        return out

    def completion(self, *, interaction_id: str, session_id: str, model: str) -> Completion:
        """The accumulated answer."""
        calls = tuple(
            ToolCall(
                call_id=partial.call_id or f"call_{interaction_id}_{index}",
                name=partial.name,
                arguments="".join(partial.arguments),
            )
            for index, partial in sorted(self.calls.items())
        )
        return Completion(
            content="".join(self.content),
            reasoning="".join(self.reasoning),
            tool_calls=calls,
            finish_reason=self.finish_reason or "stop",
            usage=self.usage,
            model=self.model or model,
            interaction_id=interaction_id,
            session_id=session_id,
        )


async def stream_chat(
    request: web.Request,
    *,
    digest: str,
    body: dict[str, Any],
    request_id: str,
    timeout_s: float,
    interaction_id: str = "",
    tags: TurnTags | None = None,
    on_routed: Callable[[str], None] | None = None,
) -> AsyncGenerator[Delta | Completion, None]:
    """Deltas as the upstream sends them, then the Completion (after the turn is recorded).

    `interaction_id` names the recorded interaction (else the completion id); `tags` are the
    call's session headers (header-mode keys); `on_routed` gets the address of the worker
    running the call once its stream is open.
    """
    model = str(body.get("model") or "")
    upstream_body = body | {"stream": True, "stream_options": {"include_usage": True}}
    turn = chat.Turn(
        digest=digest,
        model=model,
        body=orjson.dumps(upstream_body),
        request_id=request_id,
        deadline=time.monotonic() + timeout_s,
        interaction_id=interaction_id,
        tags=tags or TurnTags(),
    )
    # The chat path's own relay: routing, the one reroute, DataProxy.Chat and its recording.
    relay = chat.Relay(request, turn)
    call, message = await chat.open_stream(relay)
    if on_routed is not None:
        on_routed(relay.worker_address)
    accumulator = ChunkAccumulator()
    try:
        while True:
            kind = message.WhichOneof("kind")
            if kind == "chunks":
                for raw in message.chunks.chunks:
                    if raw.strip() == b"[DONE]":
                        continue
                    delta = accumulator.feed(orjson.loads(raw))
                    if delta is not None:
                        yield delta
            elif kind == "done":
                yield accumulator.completion(
                    interaction_id=message.done.interaction_id,
                    session_id=message.done.session_id,
                    model=model,
                )
                return
            try:
                received = await call.read()
            except grpc.aio.AioRpcError as err:
                raise from_rpc_error(err, hop="dataproxy") from None
            if received is grpc.aio.EOF:
                raise InternalError("the stream ended before the turn was recorded")
            assert isinstance(received, dataproxy_pb2.ChatResponse)
            message = received
    finally:
        # A no-op once complete; stops the upstream generation when the caller gave up.
        call.cancel()
