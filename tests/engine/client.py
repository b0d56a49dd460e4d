"""What a client sees of one chat completion (streamed or not), and the published record."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

from rollgate.stack import Stack
from rollgate.trajectory import Interaction
from tests.engine.conftest import http_call
from tests.harness.processes import published_interactions


@dataclass(slots=True, kw_only=True)
class Seen:
    """One choice as the client received it."""

    content: str = ""
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    logprobs: list[float] = field(default_factory=list)
    # The logprob entries' `token` and `bytes`, as sent.
    tokens: list[str] = field(default_factory=list)
    token_bytes: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[dict[str, Any]]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Any = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    model: str = ""
    completion_id: str = ""


def _add_logprobs(seen: Seen, logprobs: Any) -> None:
    for entry in (logprobs or {}).get("content") or []:
        seen.logprobs.append(float(entry["logprob"]))
        seen.tokens.append(entry["token"])
        seen.token_bytes.append(list(entry.get("bytes") or []))
        seen.top_logprobs.append(list(entry.get("top_logprobs") or []))


def from_completion(body: dict[str, Any]) -> dict[int, Seen]:
    """Every choice of a non-streamed answer, by index."""
    out: dict[int, Seen] = {}
    for choice in body["choices"]:
        message = choice["message"]
        seen = Seen(
            content=message.get("content") or "",
            token_ids=choice.get("token_ids"),
            prompt_token_ids=body.get("prompt_token_ids"),
            finish_reason=choice.get("finish_reason"),
            stop_reason=choice.get("stop_reason"),
            tool_calls=list(message.get("tool_calls") or []),
            model=body.get("model", ""),
            completion_id=body.get("id", ""),
        )
        _add_logprobs(seen, choice.get("logprobs"))
        out[choice["index"]] = seen
    return out


def from_stream(raw: bytes) -> tuple[dict[int, Seen], list[dict[str, Any]]]:
    """Every choice of an SSE answer, by index, and the chunks (the [DONE] line must end it)."""
    lines = [line for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert lines and lines[-1] == "data: [DONE]", raw[-300:]
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    out: dict[int, Seen] = {}
    calls: dict[int, dict[int, dict[str, Any]]] = {}
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            index = choice["index"]
            seen = out.setdefault(
                index, Seen(model=chunk.get("model", ""), completion_id=chunk.get("id", ""))
            )
            if seen.prompt_token_ids is None and "prompt_token_ids" in chunk:
                seen.prompt_token_ids = chunk["prompt_token_ids"]
            delta = choice.get("delta") or {}
            seen.content += delta.get("content") or ""
            for fragment in delta.get("tool_calls") or []:
                call = calls.setdefault(index, {}).setdefault(
                    fragment.get("index", 0),
                    {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
                )
                call["id"] = call["id"] or fragment.get("id") or ""
                function = fragment.get("function") or {}
                call["function"]["name"] = call["function"]["name"] or function.get("name") or ""
                call["function"]["arguments"] += function.get("arguments") or ""
            if "token_ids" in choice:
                seen.token_ids = (seen.token_ids or []) + list(choice["token_ids"])
            _add_logprobs(seen, choice.get("logprobs"))
            if choice.get("finish_reason"):
                seen.finish_reason = choice["finish_reason"]
                seen.stop_reason = choice.get("stop_reason")
    for index, by_position in calls.items():
        out[index].tool_calls = [by_position[i] for i in sorted(by_position)]
    return out, chunks


def chat(url: str, body: dict[str, Any], key: str = "") -> dict[int, Seen]:
    """POSTs a chat completion and reads every choice (streamed when body says so)."""
    status, raw = http_call(url, body, key)
    assert status == 200, raw[:2000]
    if body.get("stream"):
        return from_stream(raw)[0]
    return from_completion(json.loads(raw))


def as_float32(values: list[float]) -> list[float]:
    """The values as the trajectory stores them (float32)."""
    return [struct.unpack("<f", struct.pack("<f", v))[0] for v in values]


def start_session(stack: Stack, task_id: str) -> str:
    """A fresh session key."""
    status, raw = http_call(
        stack.gateway_url + "/rl/start_session", {"task_id": task_id}, stack.config.admin_key
    )
    assert status == 200, raw
    key: str = json.loads(raw)["api_key"]
    return key


def end_and_read(stack: Stack, key: str) -> list[Interaction]:
    """Ends the key's episode and returns its published interactions, in order."""
    status, raw = http_call(stack.gateway_url + "/rl/end_session", {}, key)
    assert status == 200, raw
    trajectory_id = json.loads(raw)["trajectory_id"]
    return published_interactions(stack, trajectory_id)
