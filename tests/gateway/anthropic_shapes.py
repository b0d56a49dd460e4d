"""Request shapes an Anthropic client sends to POST /v1/messages (Claude Code style)."""

from __future__ import annotations

from typing import Any

# What Claude Code puts in its headers besides the key (x-api-key, or Authorization: Bearer
# with ANTHROPIC_AUTH_TOKEN); its URL is /v1/messages?beta=true.
CLAUDE_CODE_HEADERS = {
    "anthropic-version": "2023-06-01",
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
    "anthropic-dangerous-direct-browser-access": "true",
    "x-app": "cli",
    "User-Agent": "claude-cli/2.0.14 (external, cli)",
}

BASH_TOOL: dict[str, Any] = {
    "name": "Bash",
    "description": "Executes a given bash command in a persistent shell session.",
    "input_schema": {
        "type": "object",
        "properties": {
            "command": {"type": "string", "description": "The command to execute"},
            "timeout": {"type": "number", "description": "Optional timeout in milliseconds"},
        },
        "required": ["command"],
        "additionalProperties": False,
        "$schema": "http://json-schema.org/draft-07/schema#",
    },
}

SYSTEM_BLOCKS: list[dict[str, Any]] = [
    {
        "type": "text",
        "text": "You are Claude Code, Anthropic's official CLI for Claude.",
        "cache_control": {"type": "ephemeral"},
    },
    {
        "type": "text",
        "text": "You are an interactive CLI tool that helps users with software engineering tasks.",
        "cache_control": {"type": "ephemeral"},
    },
]

REMINDER = "<system-reminder>This is a reminder: the todo list is empty.</system-reminder>"


def first_turn(model: str, text: str, *, stream: bool = True) -> dict[str, Any]:
    """A first request: system blocks, one tool, a user turn of two text blocks."""
    return {
        "model": model,
        "max_tokens": 32000,
        "stream": stream,
        "temperature": 1,
        "system": SYSTEM_BLOCKS,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": REMINDER},
                    {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}},
                ],
            }
        ],
        "tools": [BASH_TOOL],
        "metadata": {"user_id": "user_3f2a_account__session_9c1e"},
    }


def tool_result_turn(
    model: str, text: str, tool_use: dict[str, Any], result: str, *, stream: bool = True
) -> dict[str, Any]:
    """The next request: the assistant's tool_use answered by a tool_result and a reminder."""
    body = first_turn(model, text, stream=stream)
    body["messages"] += [
        {"role": "assistant", "content": [tool_use]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": tool_use["id"], "content": result},
                {"type": "text", "text": REMINDER},
            ],
        },
    ]
    return body
