"""Anthropic Messages ↔ chat completions: request, answer, stream events, errors (pure).

The request becomes the chat body the upstream is sent (and that is recorded); the answer comes
back either as a whole chat completion (`message_from_completion`) or as chat chunks that
`MessageStream` turns into Anthropic's server-sent events as they arrive.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from services.gateway.json_body import load_json
from services.runtime.errors import InvalidRequest, bounded

_STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}
# Anthropic's error type for each HTTP status rollgate answers with.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
# What a tool message's content starts with when its tool_result said `is_error: true`.
TOOL_ERROR_PREFIX = "Error: "
# /v1/messages and what lies under it, at the top level or under a session path: the paths
# whose errors take Anthropic's shape (messages.PROTOCOL).
MESSAGES_PATH = re.compile(r"(/sessions/[^/]*|/rollout/[^/]*/attempt/[^/]*)?/v1/messages(/.*)?")


def new_message_id() -> str:
    """An id of the form Anthropic uses: `msg_` + 24 random hex digits (96 bits)."""
    return "msg_" + secrets.token_hex(12)


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status (`api_error` for other 5xx)."""
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(status: int, message: str, code: str = "") -> dict[str, Any]:
    """Anthropic's error body; rollgate's own error code rides along in `error.code` (clients
    ignore fields they do not know, and the code is what docs and logs name)."""
    error = {"type": error_type(status), "message": message}
    if code:
        error["code"] = code
    return {"type": "error", "error": error}


def sse_event(kind: str, data: dict[str, Any]) -> bytes:
    """One server-sent event: `event:` equals the JSON `type`."""
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def error_event(status: int, message: str, code: str = "") -> bytes:
    """The `error` event that ends a stream which failed after it started."""
    return sse_event("error", error_body(status, message, code))


@dataclass(frozen=True, slots=True, kw_only=True)
class MessagesCall:
    """A validated Messages request and the chat body it becomes."""

    model: str
    stream: bool
    # The chat-completions body (no `stream`: the caller sets how it is relayed).
    chat: dict[str, Any]
    stop_sequences: tuple[str, ...] = ()


def _bad(message: str) -> InvalidRequest:
    return InvalidRequest(message, code="invalid_request")


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _bad(f"{where}: a text block needs a string `text`")
    return text


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    if not isinstance(source, dict):
        raise _bad(f"{where}: an image block needs a `source`")
    if source.get("type") == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not isinstance(data, str):
            raise _bad(f"{where}: a base64 image source needs `media_type` and `data` strings")
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise _bad(f"{where}: image sources must be base64 or url")


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """Content as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content blocks")
    for index, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise _bad(f"{where}.content[{index}] must be an object with a string `type`")
    return content


def _chat_content(parts: list[dict[str, Any]]) -> Any:
    """Text-only parts joined into one string (as vLLM joins them), else the part list."""
    if all(part["type"] == "text" for part in parts):
        return "\n".join(part["text"] for part in parts)
    return parts


def _tool_result(block: dict[str, Any], where: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The tool message of a tool_result block, and the images it carried (sent after)."""
    tool_use_id = block.get("tool_use_id")
    if not isinstance(tool_use_id, str) or not tool_use_id:
        raise _bad(f"{where}: a tool_result block needs its `tool_use_id`")
    texts: list[str] = []
    images: list[dict[str, Any]] = []
    content = block.get("content", "")
    for index, part in enumerate(_blocks(content, where) if content != "" else []):
        inner = f"{where}.content[{index}]"
        if part["type"] == "text":
            texts.append(_text(part, inner))
        elif part["type"] == "image":
            images.append(_image_part(part, inner))
        else:
            raise _bad(
                f"{inner}: a tool result may hold text and image blocks, not {part['type']!r}"
            )
    text = "\n".join(texts)
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise _bad(f"{where}: a tool_result block's `is_error` must be true or false")
    if is_error:
        # Chat tool messages have no error flag: the model reads it in the content.
        text = f"{TOOL_ERROR_PREFIX}{text}" if text else TOOL_ERROR_PREFIX.rstrip(": ")
    return {"role": "tool", "tool_call_id": tool_use_id, "content": text}, images


def _user_messages(content: Any, where: str) -> list[dict[str, Any]]:
    """A user turn: its tool results first (as chat tool messages), then the rest."""
    tools: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for index, block in enumerate(_blocks(content, where)):
        inner = f"{where}.content[{index}]"
        kind = block["type"]
        if kind == "tool_result":
            message, images = _tool_result(block, inner)
            tools.append(message)
            parts += images
        elif kind == "text":
            parts.append({"type": "text", "text": _text(block, inner)})
        elif kind == "image":
            parts.append(_image_part(block, inner))
        else:
            raise _bad(f"{inner}: content block type {kind!r} is not supported in user turns")
    if parts or not tools:
        return [*tools, {"role": "user", "content": _chat_content(parts)}]
    return tools


def _assistant_message(content: Any, where: str) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for index, block in enumerate(_blocks(content, where)):
        inner = f"{where}.content[{index}]"
        kind = block["type"]
        if kind == "text":
            texts.append(_text(block, inner))
        elif kind == "tool_use":
            tool_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(tool_id, str) or not isinstance(name, str):
                raise _bad(f"{inner}: a tool_use block needs string `id` and `name`")
            if not isinstance(arguments, dict):
                raise _bad(f"{inner}: a tool_use block's `input` must be an object")
            function = {"name": name, "arguments": orjson.dumps(arguments).decode()}
            calls.append({"id": tool_id, "type": "function", "function": function})
        elif kind not in ("thinking", "redacted_thinking"):
            # Earlier thinking is not sent back: chat templates drop it (as Responses does).
            raise _bad(f"{inner}: content block type {kind!r} is not supported in assistant turns")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""
    return message


def _system_text(system: Any) -> str:
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise _bad("`system` must be a string or a list of text blocks")
    texts = []
    for index, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise _bad(f"system[{index}] must be a text block")
        texts.append(_text(block, f"system[{index}]"))
    return "\n".join(texts)


def _chat_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _bad("`tools` must be a list")
    out = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise _bad(f"tools[{index}] must be an object")
        if tool.get("type") not in (None, "custom"):
            raise _bad(
                f"tools[{index}] is a server tool ({bounded(str(tool['type']), 60)!r}): only "
                "custom tools (name, description, input_schema) reach the model here"
            )
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise _bad(f"tools[{index}] needs a string `name`")
        if not isinstance(schema, dict):
            raise _bad(f"tools[{index}] needs an `input_schema` object")
        function: dict[str, Any] = {"name": name, "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any, out: dict[str, Any]) -> None:
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise _bad("`tool_choice` must be {type: auto | any | tool | none} (tool with a `name`)")
    kind = choice["type"]
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _bad("`tool_choice` of type tool needs the tool's `name`")
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    if choice.get("disable_parallel_tool_use") is True and kind != "none":
        out["parallel_tool_calls"] = False


def _positive_int(body: dict[str, Any], name: str) -> int:
    value = body.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _bad(f"`{name}` is required and must be a positive integer")
    return value


def parse_request(raw: bytes) -> MessagesCall:
    """Validates a Messages body and builds its chat body; InvalidRequest says what is wrong."""
    # The one JSON reader for client bodies (invalid JSON, nesting over 128 levels: 400).
    body: Any = load_json(raw) if raw.strip() else None
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object with model, max_tokens and messages")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("`model` is required and must be a non-empty string")
    max_tokens = _positive_int(body, "max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("`stream` must be true or false")
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise _bad("`messages` must be a non-empty list of {role, content} objects")
    messages: list[dict[str, Any]] = []
    if body.get("system") is not None:
        system = _system_text(body["system"])
        if system:
            messages.append({"role": "system", "content": system})
    for index, message in enumerate(raw_messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise _bad(f"{where} must be an object whose `role` is user or assistant")
        if message["role"] == "user":
            messages += _user_messages(message.get("content"), where)
        else:
            messages.append(_assistant_message(message.get("content"), where))
    chat: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens}
    stops = body.get("stop_sequences")
    if stops is not None and (
        not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)
    ):
        raise _bad("`stop_sequences` must be a list of strings")
    for name in ("temperature", "top_p", "top_k"):
        value = body.get(name)
        if value is not None:
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise _bad(f"`{name}` must be a number")
            chat[name] = value
    if stops:
        chat["stop"] = stops
    if body.get("tools"):
        chat["tools"] = _chat_tools(body["tools"])
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], chat)
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
        chat["user"] = metadata["user_id"]
    return MessagesCall(model=model, stream=stream, chat=chat, stop_sequences=tuple(stops or ()))


def _parse_input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as the object Anthropic's `input` is ({} when not an object)."""
    try:
        parsed = orjson.loads(arguments) if arguments.strip() else {}
    except orjson.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def stop_reason(
    finish_reason: str, matched: Any, stop_sequences: tuple[str, ...], *, tool_used: bool = False
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a chat finish reason, the upstream's matched stop
    (vLLM's `stop_reason`, SGLang's `matched_stop`) and whether the answer has a tool_use."""
    if finish_reason == "stop" and isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    if finish_reason == "stop" and tool_used:
        # A forced (named) tool call ends with "stop", not "tool_calls", on vLLM and OpenAI;
        # Anthropic says tool_use whenever the answer calls a tool.
        return "tool_use", None
    return _STOP_REASONS.get(finish_reason, "end_turn"), None


def _uses_tool(content: list[dict[str, Any]]) -> bool:
    return any(block["type"] == "tool_use" for block in content)


def usage(raw: Any) -> dict[str, int]:
    """Chat usage in Anthropic's shape (cached prompt tokens are not counted as input)."""
    raw = raw if isinstance(raw, dict) else {}
    prompt = int(raw.get("prompt_tokens") or 0)
    details = raw.get("prompt_tokens_details")
    cached = int((details or {}).get("cached_tokens") or 0) if isinstance(details, dict) else 0
    return {
        "input_tokens": max(0, prompt - cached),
        "output_tokens": int(raw.get("completion_tokens") or 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _matched_stop(choice: dict[str, Any]) -> Any:
    return choice.get("stop_reason", choice.get("matched_stop"))


def message_object(
    *,
    message_id: str,
    model: str,
    content: list[dict[str, Any]],
    stop: tuple[str | None, str | None],
    usage_json: dict[str, int],
) -> dict[str, Any]:
    """The Message the client gets."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": usage_json,
    }


def message_from_completion(
    completion: Any, *, message_id: str, model: str, stop_sequences: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The Message for a whole (non-streamed) chat completion."""
    choices = completion.get("choices") if isinstance(completion, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else {}
    choice = choice if isinstance(choice, dict) else {}
    message = choice.get("message")
    message = message if isinstance(message, dict) else {}
    content: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if isinstance(message.get("content"), str) and message["content"]:
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        arguments = function.get("arguments")
        content.append(
            {
                "type": "tool_use",
                "id": str(call.get("id") or "toolu_" + secrets.token_hex(12)),
                "name": str(function.get("name") or ""),
                "input": _parse_input(arguments if isinstance(arguments, str) else ""),
            }
        )
    finish = choice.get("finish_reason")
    upstream_model = completion.get("model") if isinstance(completion, dict) else None
    return message_object(
        message_id=message_id,
        model=upstream_model if isinstance(upstream_model, str) and upstream_model else model,
        content=content,
        stop=stop_reason(
            finish if isinstance(finish, str) else "stop",
            _matched_stop(choice),
            stop_sequences,
            tool_used=_uses_tool(content),
        ),
        usage_json=usage(completion.get("usage") if isinstance(completion, dict) else None),
    )


@dataclass(slots=True)
class _Block:
    """A content block being streamed."""

    index: int
    kind: str
    # tool_use: the chat tool-call index it comes from.
    tool_index: int = -1
    parts: list[str] = field(default_factory=list)
    tool_id: str = ""
    name: str = ""


class MessageStream:
    """Turns chat-completion chunks into Anthropic stream events, block by block."""

    def __init__(
        self, *, message_id: str, model: str, stop_sequences: tuple[str, ...] = ()
    ) -> None:
        self.message_id = message_id
        self.model = model
        self.stop_sequences = stop_sequences
        self.blocks: list[_Block] = []
        self._open: _Block | None = None
        self._tools: dict[int, _Block] = {}
        self.finish_reason = ""
        self.matched_stop: Any = None
        self.usage_raw: dict[str, Any] = {}

    def start(
        self, first: Sequence[Any] = (), *, model: str = "", input_tokens: int = 0
    ) -> list[bytes]:
        """`message_start`, a ping, then the events of the first batch of chunks.

        The message names the served model (`model`, else the first chunk's, as the record
        does) and the prompt's length when it is known; the rest of the usage is known only
        at the end (message_delta carries all of it)."""
        named = [
            c["model"] for c in first if isinstance(c, dict) and isinstance(c.get("model"), str)
        ]
        self.model = model or next((name for name in named if name), self.model)
        pending = message_object(
            message_id=self.message_id,
            model=self.model,
            content=[],
            stop=(None, None),
            usage_json=usage({"prompt_tokens": input_tokens}),
        )
        events = [
            sse_event("message_start", {"type": "message_start", "message": pending}),
            sse_event("ping", {"type": "ping"}),
        ]
        for chunk in first:
            events += self.feed(chunk)
        return events

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        index, self._open = self._open.index, None
        return [sse_event("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _begin(self, block: _Block, content_block: dict[str, Any]) -> list[bytes]:
        events = self._close()
        self.blocks.append(block)
        self._open = block
        start = {
            "type": "content_block_start",
            "index": block.index,
            "content_block": content_block,
        }
        return [*events, sse_event("content_block_start", start)]

    def _delta(self, block: _Block, delta: dict[str, Any]) -> bytes:
        return sse_event(
            "content_block_delta",
            {"type": "content_block_delta", "index": block.index, "delta": delta},
        )

    def _stream_text(self, kind: str, text: str) -> list[bytes]:
        events: list[bytes] = []
        block = self._open
        if block is None or block.kind != kind:
            block = _Block(index=len(self.blocks), kind=kind)
            start: dict[str, Any] = (
                {"type": "text", "text": ""}
                if kind == "text"
                else {"type": "thinking", "thinking": "", "signature": ""}
            )
            events += self._begin(block, start)
        block.parts.append(text)
        delta = (
            {"type": "text_delta", "text": text}
            if kind == "text"
            else {"type": "thinking_delta", "thinking": text}
        )
        return [*events, self._delta(block, delta)]

    def _stream_tool(self, fragment: dict[str, Any], position: int) -> list[bytes]:
        raw_index = fragment.get("index")
        tool_index = raw_index if isinstance(raw_index, int) else position
        function = fragment.get("function")
        function = function if isinstance(function, dict) else {}
        arguments = function.get("arguments")
        arguments = arguments if isinstance(arguments, str) else ""
        events: list[bytes] = []
        block = self._tools.get(tool_index)
        if block is None:
            call_id, name = fragment.get("id"), function.get("name")
            block = _Block(
                index=len(self.blocks),
                kind="tool_use",
                tool_index=tool_index,
                tool_id=call_id
                if isinstance(call_id, str) and call_id
                else "toolu_" + secrets.token_hex(12),
                name=name if isinstance(name, str) else "",
            )
            self._tools[tool_index] = block
            start = {"type": "tool_use", "id": block.tool_id, "name": block.name, "input": {}}
            events += self._begin(block, start)
        if arguments:
            block.parts.append(arguments)
            events.append(
                self._delta(block, {"type": "input_json_delta", "partial_json": arguments})
            )
        return events

    def feed(self, chunk: Any) -> list[bytes]:
        """The events of one chat chunk (none for chunks that add nothing)."""
        if not isinstance(chunk, dict):
            return []
        if isinstance(chunk.get("model"), str) and chunk["model"]:
            self.model = chunk["model"]
        if isinstance(chunk.get("usage"), dict):
            self.usage_raw = chunk["usage"]
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return []
        choice = choices[0]
        if isinstance(choice.get("finish_reason"), str):
            self.finish_reason = choice["finish_reason"]
            self.matched_stop = _matched_stop(choice)
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return []
        events: list[bytes] = []
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            events += self._stream_text("thinking", reasoning)
        if isinstance(delta.get("content"), str) and delta["content"]:
            events += self._stream_text("text", delta["content"])
        fragments = delta.get("tool_calls")
        for position, fragment in enumerate(fragments if isinstance(fragments, list) else ()):
            if isinstance(fragment, dict):
                events += self._stream_tool(fragment, position)
        return events

    def stop(self) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of the answer so far."""
        return stop_reason(
            self.finish_reason or "stop",
            self.matched_stop,
            self.stop_sequences,
            tool_used=any(block.kind == "tool_use" for block in self.blocks),
        )

    def finish(self) -> list[bytes]:
        """Closes the open block; `message_delta` (stop reason, usage) and `message_stop`."""
        reason, sequence = self.stop()
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage(self.usage_raw),
        }
        return [
            *self._close(),
            sse_event("message_delta", delta),
            sse_event("message_stop", {"type": "message_stop"}),
        ]

    def message(self) -> dict[str, Any]:
        """The whole Message as streamed so far (what an SDK's accumulator builds)."""
        content: list[dict[str, Any]] = []
        for block in self.blocks:
            text = "".join(block.parts)
            if block.kind == "text":
                content.append({"type": "text", "text": text})
            elif block.kind == "thinking":
                content.append({"type": "thinking", "thinking": text, "signature": ""})
            else:
                content.append(
                    {
                        "type": "tool_use",
                        "id": block.tool_id,
                        "name": block.name,
                        "input": _parse_input(text),
                    }
                )
        return message_object(
            message_id=self.message_id,
            model=self.model,
            content=content,
            stop=self.stop(),
            usage_json=usage(self.usage_raw),
        )
