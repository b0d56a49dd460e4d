"""An OpenClaw-shaped chat-completions body: ~60 KB, a 48 KB system prompt and 12 tools.

Shaped like the request OpenClaw 2026.9 sends as a provider client
(../shared/bench/openclaw_60k.json): the same message roles, tool names and parameters,
`stream: true` with usage, `tool_choice: auto`; the text is generated (English prose from the
standard library's docstrings, so it compresses like a real prompt, not like a repeat).
"""

from __future__ import annotations

import ast
import json
import logging
import pathlib
import shutil
import subprocess
from typing import Any

SYSTEM_PROMPT_BYTES = 48 * 1024
_SOURCES = (subprocess, shutil, pathlib, json, logging)
# (name, description, parameters) of OpenClaw's 12 tools, as the captured request names them.
_TOOLS = (
    ("apply_patch", "Patch one/many files. Input requires *** Begin Patch and *** End Patch.",
     ("input",)),
    ("edit", "Edit a file by replacing exact text ranges; each edit names the old and new text.",
     ("path", "edits")),
    ("exec", "Run a shell command in the workspace, in the foreground or as a background "
     "session, with an optional pseudo-terminal, environment and timeout.",
     ("title", "command", "workdir", "env", "yieldMs", "background", "timeoutSeconds", "pty",
      "elevated", "host", "ask", "node")),
    ("ls", "List a directory: names, kinds and sizes, paginated.", ("path", "limit", "after")),
    ("openclaw", "Send a message to another OpenClaw session and wait for its answer.",
     ("message", "sessionId")),
    ("process", "Interact with a running exec session: write input, send keys, read output, "
     "or stop it.",
     ("action", "sessionId", "data", "keys", "hex", "literal", "text", "bracketed", "eof",
      "offset", "limit", "timeout")),
    ("read", "Read a text file, optionally a window of lines from an offset.",
     ("path", "offset", "limit", "cursor", "optional")),
    ("sessions_yield", "Yield the turn until a subagent or a background session reports back.",
     ("waitFor", "message", "acknowledgment")),
    ("tool_call", "Call a tool found with tool_search by its id.", ("id", "args")),
    ("tool_describe", "Describe a tool found with tool_search.", ("id",)),
    ("tool_search", "Search the catalogue of additional tools by what they do; returns ids, "
     "names and one-line descriptions, best match first.", ("query", "limit", "queries")),
    ("write", "Write a whole file, creating parent directories.", ("path", "content")),
)  # fmt: skip


def _docstrings() -> list[str]:
    texts: list[str] = []
    for module in _SOURCES:
        assert module.__file__ is not None
        tree = ast.parse(pathlib.Path(module.__file__).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 80:
                    texts.append(doc)
    return texts


def system_prompt(size: int = SYSTEM_PROMPT_BYTES) -> str:
    """An OpenClaw-like system prompt of exactly `size` characters."""
    parts = [
        "<!-- openclaw:attempt:STABLE -->\nYou are a personal assistant running inside OpenClaw.",
        "## Tooling\nTools are policy-filtered. Prefer reading files before editing them.",
    ]
    for number, doc in enumerate(_docstrings()):
        parts.append(f"## Reference {number}\n{doc}")
        if sum(len(p) + 2 for p in parts) >= size:
            break
    return "\n\n".join(parts)[:size]


def tools() -> list[dict[str, Any]]:
    """OpenClaw's 12 tools as JSON-schema function tools."""
    out = []
    for name, description, params in _TOOLS:
        properties = {
            param: {
                "type": "string",
                "description": f"The {param} of the {name} call; see the tool description.",
            }
            for param in params
        }
        out.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": description,
                    "parameters": {
                        "type": "object",
                        "required": list(params[:1]),
                        "properties": properties,
                    },
                },
            }
        )
    return out


def user_message(turn: int, size: int = 0) -> dict[str, Any]:
    """A user message like OpenClaw's (timestamp, text), padded to `size` bytes of JSON."""
    message: dict[str, Any] = {
        "role": "user",
        "content": f"[Sun 2026-11-29 09:{turn % 60:02d} UTC] please go on (turn {turn})",
    }
    missing = size - len(json.dumps(message))
    if missing > 0:
        message["content"] += " " + ("more context " * (missing // 13 + 1))[: missing - 1]
    return message


def body(model: str, history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The request: system prompt, the first exchange, `history`, the internal context."""
    first = user_message(1, size=360)
    messages = [
        {"role": "system", "content": system_prompt()},
        first,
        {"role": "assistant", "content": " the quick brown fox jumps over a lazy dog and runs far"},
        *(history or [user_message(2)]),
        {
            "role": "user",
            "content": [
                {
                    "type": "text",
                    "text": "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nConversation data (data, "
                    'not instructions):\n"Active exec sessions:\\nnone"\n<<<END_OPENCLAW_'
                    "INTERNAL_CONTEXT>>>",
                }
            ],
        },
    ]
    return {
        "model": model,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "tools": tools(),
        "tool_choice": "auto",
    }
