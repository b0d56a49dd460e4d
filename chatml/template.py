"""The built-in chat template (Qwen2.5/Qwen3 ChatML) and the parser of its raw output.

Used where rollgate itself must turn messages into prompt text: SGLang's native `/generate`
path (input_ids) and, approximately, the prompt ids of an `openai` upstream with a local
tokenizer. Pure: no I/O.
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

_TOOLS_PREAMBLE = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def content_text(content: Any) -> str:
    """A message's content as text (array content: its text parts joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _tool_call_text(call: Any) -> str:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return ""
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        with contextlib.suppress(orjson.JSONDecodeError):
            arguments = orjson.loads(arguments)
    payload = orjson.dumps({"name": function.get("name", ""), "arguments": arguments}).decode()
    return f"\n<tool_call>\n{payload}\n</tool_call>"


def render_chatml(messages: Sequence[Any], tools: Sequence[Any] | None = None) -> str:
    """The prompt text, ending with the assistant header (add_generation_prompt)."""
    out: list[str] = []
    items = [m for m in messages if isinstance(m, dict)]
    system = ""
    if items and items[0].get("role") in ("system", "developer"):
        system = content_text(items[0].get("content"))
        items = items[1:]
    if tools:
        lines = "".join("\n" + orjson.dumps(t).decode() for t in tools)
        system = (system or "You are a helpful assistant.") + _TOOLS_PREAMBLE + lines
        system += _TOOLS_FOOTER
    if system:
        out.append(f"<|im_start|>system\n{system}<|im_end|>\n")
    previous_role = ""
    for i, message in enumerate(items):
        role = str(message.get("role", "user"))
        text = content_text(message.get("content"))
        if role == "tool":
            if previous_role != "tool":
                out.append("<|im_start|>user")
            out.append(f"\n<tool_response>\n{text}\n</tool_response>")
            next_role = items[i + 1].get("role") if i + 1 < len(items) else None
            if next_role != "tool":
                out.append("<|im_end|>\n")
        elif role == "assistant":
            calls = message.get("tool_calls") or []
            body = text + "".join(_tool_call_text(c) for c in calls)
            out.append(f"<|im_start|>assistant\n{body}<|im_end|>\n")
        else:
            role = "system" if role == "developer" else role
            out.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
        previous_role = role
    out.append("<|im_start|>assistant\n")
    return "".join(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class ParsedOutput:
    """Raw model output split into reasoning, content and tool calls."""

    reasoning: str
    content: str
    tool_calls: list[dict[str, Any]]


def parse_output(text: str) -> ParsedOutput:
    """Splits `<think>…</think>` reasoning and `<tool_call>{json}</tool_call>` blocks off."""
    reasoning = ""
    if "</think>" in text:
        head, _, text = text.partition("</think>")
        reasoning = head.replace("<think>", "").strip()
    text = text.replace("<|im_end|>", "").replace("<|endoftext|>", "")
    calls: list[dict[str, Any]] = []
    for block in _TOOL_CALL.findall(text):
        try:
            parsed = orjson.loads(block)
        except orjson.JSONDecodeError:
            continue
        if isinstance(parsed, dict) and isinstance(parsed.get("name"), str):
            calls.append(
                {
                    "id": f"call_{uuid.uuid4().hex[:16]}",
                    "type": "function",
                    "function": {
                        "name": parsed["name"],
                        "arguments": orjson.dumps(parsed.get("arguments", {})).decode(),
                    },
                }
            )
    content = _TOOL_CALL.sub("", text).strip() if calls else text.lstrip("\n")
    return ParsedOutput(reasoning=reasoning, content=content, tool_calls=calls)
