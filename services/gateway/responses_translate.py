"""Open Responses ↔ chat completions: request, items, output and usage translation (pure)."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

from services.gateway.json_body import load_json
from services.runtime.errors import InvalidRequest, check_identifier

# Sampling fields that mean the same in both APIs and pass through unchanged.
_PASS_THROUGH = (
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "parallel_tool_calls",
    "seed",
)


def new_id(prefix: str) -> str:
    """An id such as `resp_…`, `msg_…`, `fc_…`."""
    return f"{prefix}_{secrets.token_hex(16)}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponsesCall:
    """A validated Responses request: what the bridge reads; nothing else is forwarded."""

    body: dict[str, Any]
    model: str
    input_items: list[dict[str, Any]]
    instructions: str | None
    previous_response_id: str
    store: bool
    stream: bool


def _text_part(part: Any, index: int) -> dict[str, Any]:
    if not isinstance(part, dict):
        raise InvalidRequest(f"content[{index}] must be an object")
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return {"type": "text", "text": part["refusal"]}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str):
            raise InvalidRequest("input_image needs an `image_url` (a URL or a data URL)")
        return {"type": "image_url", "image_url": {"url": url}}
    raise InvalidRequest(f"content part type {kind!r} is not supported by this bridge")


def normalize_item(item: Any, index: int) -> dict[str, Any]:
    """An input item in its full form (short `{role, content}` messages get `type`)."""
    if not isinstance(item, dict):
        raise InvalidRequest(f"input[{index}] must be an object")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise InvalidRequest(
                f"input[{index}].role must be user, system, developer or assistant"
            )
        content = item.get("content")
        if not isinstance(content, (str, list)):
            raise InvalidRequest(f"input[{index}].content must be a string or a list of parts")
        return {"type": "message", "role": role, "content": content}
    if kind == "function_call":
        for name in ("call_id", "name", "arguments"):
            if not isinstance(item.get(name), str):
                raise InvalidRequest(f"input[{index}] (function_call) needs a string `{name}`")
        return {k: item[k] for k in ("type", "call_id", "name", "arguments")} | {"type": kind}
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise InvalidRequest(f"input[{index}] (function_call_output) needs a `call_id`")
        output = item.get("output")
        if not isinstance(output, (str, list)):
            raise InvalidRequest(f"input[{index}].output must be a string or a list of parts")
        return {"type": kind, "call_id": item["call_id"], "output": output}
    if kind == "reasoning":
        return {"type": kind, "summary": item.get("summary") or [], "content": item.get("content")}
    raise InvalidRequest(f"input[{index}] has an unsupported item type {kind!r}")


def parse_request(raw: bytes) -> ResponsesCall:
    """Validates a Responses body; InvalidRequest says what is wrong."""
    body: Any = load_json(raw) if raw.strip() else None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object with model and input")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("`model` is required and must be a non-empty string")
    check_identifier(model, "`model`")
    raw_input = body.get("input")
    if isinstance(raw_input, str):
        items = [{"type": "message", "role": "user", "content": raw_input}]
    elif isinstance(raw_input, list):
        items = [normalize_item(item, i) for i, item in enumerate(raw_input)]
    else:
        raise InvalidRequest("`input` must be a string or a list of items")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("`instructions` must be a string")
    previous = body.get("previous_response_id") or ""
    if not isinstance(previous, str):
        raise InvalidRequest("`previous_response_id` must be a string")
    check_identifier(previous, "`previous_response_id`")
    for flag in ("store", "stream"):
        if body.get(flag) is not None and not isinstance(body[flag], bool):
            raise InvalidRequest(f"`{flag}` must be true or false")
    limit = body.get("max_output_tokens")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise InvalidRequest("`max_output_tokens` must be a positive integer")
    return ResponsesCall(
        body=body,
        model=model,
        input_items=items,
        instructions=instructions,
        previous_response_id=previous,
        store=body.get("store") is not False,
        stream=bool(body.get("stream")),
    )


def _message_content(content: Any) -> Any:
    if isinstance(content, str):
        return content
    parts = [_text_part(part, i) for i, part in enumerate(content)]
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _output_text(output: Any) -> str:
    if isinstance(output, str):
        return output
    return "".join(str(part.get("text", "")) for part in output if isinstance(part, dict))


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages for items: consecutive function calls join one assistant message."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type")
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _message_content(item["content"])})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant":
                last["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": _output_text(item["output"]),
                }
            )
        # Reasoning items are not sent back upstream: chat templates drop earlier thinking.
    return messages


def _chat_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise InvalidRequest("`tools` must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidRequest(f"tools[{i}]: only function tools are supported by this bridge")
        if not isinstance(tool.get("name"), str):
            raise InvalidRequest(f"tools[{i}] needs a string `name`")
        function = {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool
        }
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise InvalidRequest("`tool_choice` must be none, auto, required or {type: function, name}")


def chat_body(call: ResponsesCall, prior_items: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat-completions body: this request's instructions, the chain, then the input."""
    body = call.body
    messages = []
    if call.instructions:
        messages.append({"role": "system", "content": call.instructions})
    messages += chat_messages(prior_items + call.input_items)
    if not messages:
        raise InvalidRequest("nothing to answer: `input` is empty")
    out: dict[str, Any] = {"model": call.model, "messages": messages}
    for name in _PASS_THROUGH:
        if body.get(name) is not None:
            out[name] = body[name]
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        out["tools"] = _chat_tools(body["tools"])
    if body.get("tool_choice") is not None:
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    if isinstance(body.get("top_logprobs"), int) and body["top_logprobs"] > 0:
        out["logprobs"] = True
        out["top_logprobs"] = body["top_logprobs"]
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and isinstance(reasoning.get("effort"), str):
        out["reasoning_effort"] = reasoning["effort"]
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = {k: v for k, v in fmt.items() if k != "type"}
        out["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        out["response_format"] = {"type": "json_object"}
    return out


def usage(raw: dict[str, Any]) -> dict[str, Any]:
    """Chat usage in the Responses shape (zeros when absent)."""
    prompt = int(raw.get("prompt_tokens") or 0)
    completion = int(raw.get("completion_tokens") or 0)
    prompt_details = raw.get("prompt_tokens_details") or {}
    completion_details = raw.get("completion_tokens_details") or {}
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": int(prompt_details.get("cached_tokens") or 0)},
        "output_tokens": completion,
        "output_tokens_details": {
            "reasoning_tokens": int(completion_details.get("reasoning_tokens") or 0)
        },
        "total_tokens": int(raw.get("total_tokens") or prompt + completion),
    }


@dataclass(frozen=True, slots=True, kw_only=True)
class ItemIds:
    """The ids the output items get (fixed before streaming starts)."""

    reasoning: str
    message: str

    @classmethod
    def new(cls) -> ItemIds:
        """Fresh ids."""
        return cls(reasoning=new_id("rs"), message=new_id("msg"))


def reasoning_item(ids: ItemIds, text: str, status: str) -> dict[str, Any]:
    """A reasoning output item."""
    return {
        "type": "reasoning",
        "id": ids.reasoning,
        "status": status,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def message_item(ids: ItemIds, text: str, status: str) -> dict[str, Any]:
    """An assistant message output item."""
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "type": "message",
        "id": ids.message,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    """A function-call output item."""
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def status_of(finish_reason: str) -> tuple[str, dict[str, str] | None]:
    """The response status and incomplete_details for a chat finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def response_object(
    call: ResponsesCall,
    *,
    response_id: str,
    created_at: int,
    status: str,
    output: list[dict[str, Any]],
    usage_json: dict[str, Any] | None = None,
    incomplete_details: dict[str, str] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ResponseResource the client gets (and that is stored)."""
    body = call.body
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        "status": status,
        "incomplete_details": incomplete_details,
        "model": call.model,
        "previous_response_id": call.previous_response_id or None,
        "instructions": call.instructions,
        "output": output,
        "error": error,
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "truncation": "disabled",
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "text": body.get("text") or {"format": {"type": "text"}},
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "presence_penalty": body.get("presence_penalty", 0.0),
        "frequency_penalty": body.get("frequency_penalty", 0.0),
        "top_logprobs": body.get("top_logprobs", 0),
        "reasoning": body.get("reasoning"),
        "usage": usage_json,
        "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": body.get("max_tool_calls"),
        "store": call.store,
        "background": False,
        "service_tier": "default",
        "metadata": body.get("metadata") or {},
        "safety_identifier": body.get("safety_identifier"),
        "prompt_cache_key": body.get("prompt_cache_key"),
        "user": body.get("user"),
    }
