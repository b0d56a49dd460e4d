"""A realistic ~48 KB agent system prompt and tool list, like the real OpenClaw sends."""

from __future__ import annotations

import ast
import json
import logging
import pathlib
import shutil
import subprocess
import zlib
from typing import Any

# Prose from the standard library's own docstrings (read from source, so `-OO` does not
# matter): English technical text that compresses like a real agent prompt, not a repeat.
_SOURCES = (subprocess, shutil, pathlib, json, logging)


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


def system_prompt(size: int = 48 * 1024) -> str:
    """An OpenClaw-like system prompt of exactly `size` characters."""
    parts = [
        "<!-- openclaw:attempt:STABLE -->\nYou are a personal assistant running inside OpenClaw.",
        "## Tooling\nTools are policy-filtered. Prefer reading files before editing them.",
    ]
    for number, doc in enumerate(_docstrings()):
        parts.append(f"## Reference {number}\n{doc}")
        if sum(len(p) + 2 for p in parts) >= size:
            break
    text = "\n\n".join(parts)
    assert len(text) >= size, "not enough standard-library prose for the prompt"
    return text[:size]


def tools() -> list[dict[str, Any]]:
    """Twelve function tools with JSON-schema parameters, as OpenClaw declares them."""
    names = [
        "apply_patch",
        "edit",
        "exec",
        "ls",
        "openclaw",
        "process",
        "read",
        "sessions_yield",
        "tool_call",
        "tool_describe",
        "tool_search",
        "write",
    ]
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": f"The {name} tool: see the Tooling section for when to use it.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": "Workspace-relative path."},
                        "args": {"type": "array", "items": {"type": "string"}},
                    },
                    "required": ["path"],
                },
            },
        }
        for name in names
    ]


def prompt_ids(text: str) -> list[int]:
    """Token ids like a real tokenizer's for `text`: one id per ~4 characters, vocab-sized."""
    return [zlib.crc32(text[i : i + 4].encode()) % 151_000 for i in range(0, len(text), 4)]
