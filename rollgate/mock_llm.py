"""A mock LLM speaking the vLLM, SGLang and OpenAI wire formats (a mock: answers are fake).

Flavors: `vllm` (chat completions, `return_token_ids`), `sglang` (chat completions without
ids, plus native `/generate` with `input_ids` and `meta_info.output_token_logprobs`
`[[logprob, id, text], …]`), `openai` (a hosted API: `return_token_ids` is refused). `n > 1`
returns one choice per sample.

SGLang's chat endpoint with a reasoning and a tool parser is emulated as SGLang behaves
(sglang#25055): `logprobs.content` covers the whole raw output, `<think>`/`</think>` and the
tool-call markup included, so it has more entries than the content's tokens; the markup
tokens travel on chunks with an empty delta. The usage chunk's `choices` can be `[]` (the
default), `null` or absent (`usage_choices`), as different servers send it. `GET /mock/stats`
reports the chat requests per model it received (for tests driving it as a process).

The `vllm` flavor follows what a real vLLM 0.32 sends (the captures in the team's vllm_wire
reference): usage only with `stream_options.include_usage`, `system_fingerprint` only on the
usage chunk, `prompt_token_ids` on every choice's first (role) chunk, `finish_reason` and
`stop_reason` on the last token's chunk (no empty closing chunk), an EOS token
(`<|im_end|>`) sampled at a natural stop whose id and logprob are sent but not its text, a
stop string's token likewise, errors as `{"error": {message, type: NotFoundError |
BadRequestError, param, code: <status>}}`. `stop` is honoured by every flavor.

Deterministic: a word-level tokenizer with ids from a stable hash, a simple chat template,
seeded logprobs. The last user message can force behaviours for tests: `/tool` (a tool call
when the request has tools), `/fail-<status>`, `/hang`, `/fail-midstream`, and (vllm flavor)
`/utf8-fragment`: a lone UTF-8 fragment token as vLLM sends it (`token: ""`, `bytes: []`,
empty delta; the next chunk's content starts with U+FFFD, which no logprob token carries).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import logging
import random
import re
import signal
import sys
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

log = logging.getLogger("rollgate.mock_llm")

MOCK_FINGERPRINT = "rollgate-mock"
FLAVORS = ("vllm", "sglang", "openai")
# How the streamed usage chunk carries `choices`: `[]`, `null`, or no key at all.
USAGE_CHOICES = ("empty", "null", "absent")
_PIECE = re.compile(r"\s*\S+|\s+")
_FAIL = re.compile(r"/fail-(\d{3})\b")
_REASONING_TEXT = "Let me think about what the user asked before I answer."
# Qwen's <|im_end|>, the EOS a vLLM serving a ChatML model samples at a natural stop.
EOS_PIECE = "<|im_end|>"
EOS_ID = 151645
# The first byte of a three-byte UTF-8 character: a lone fragment when nothing completes it.
FRAGMENT_ID = 228
_MAX_ECHO_WORDS = 24


def tokenize(text: str) -> list[str]:
    """Word-level pieces (each keeps its leading whitespace, like BPE); joined they give `text`."""
    return _PIECE.findall(text)


def token_id(piece: str) -> int:
    """A stable id for a piece: 100 + crc32 % 50000."""
    return 100 + zlib.crc32(piece.encode()) % 50_000


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def render_prompt(messages: Sequence[Any]) -> str:
    """A ChatML-like template over the messages, ending with the assistant header."""
    parts = []
    for message in messages:
        if isinstance(message, dict):
            role = str(message.get("role", "user"))
            parts.append(f"<|im_start|>{role}\n{_content_text(message.get('content'))}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def _last_user_text(messages: Sequence[Any]) -> str:
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            return _content_text(message.get("content"))
    return ""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Token:
    piece: str
    logprob: float
    # Which part of the answer the token belongs to: "reasoning", "content", "tool", or
    # "markup" (SGLang's <think>/</think> and tool-call markup: logprobs only, no delta).
    channel: str
    # The text the client sees in its delta (tool markup tokens show none).
    text: str
    # The id, when not the hash of `piece` (EOS, the fragment).
    fixed_id: int | None = None
    # The logprob entry's `token` and `bytes` when they are not `piece` (vLLM's lone UTF-8
    # fragment: "" and []).
    entry_token: str | None = None
    entry_bytes: tuple[int, ...] | None = None

    @property
    def id(self) -> int:
        """The token id."""
        return self.fixed_id if self.fixed_id is not None else token_id(self.piece)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Plan:
    """Everything one request will answer, decided before the first byte."""

    completion_id: str
    created: int
    model: str
    prompt_ids: list[int]
    tokens: list[_Token]
    finish_reason: str
    tool_name: str | None
    tool_call_id: str
    top_logprobs: int
    want_logprobs: bool
    want_token_ids: bool
    want_usage: bool
    stream: bool
    # vLLM's wire shapes (the `vllm` flavor): see the module docstring.
    vllm_wire: bool = False
    # vLLM's `stop_reason`: the stop string matched (None: EOS, length, or a tool call).
    stop_reason: str | None = None


class _BadRequest(Exception):
    pass


def _plan(
    body: dict[str, Any],
    default_model: str,
    index: int = 0,
    flavor: str = "vllm",
    answer_tokens: int = 0,
) -> _Plan:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _BadRequest("'messages' must be a non-empty list")
    seed = body.get("seed")
    if not isinstance(seed, int):
        seed = zlib.crc32(orjson.dumps(messages))
    user_text = _last_user_text(messages)
    kwargs = body.get("chat_template_kwargs")
    thinking = isinstance(kwargs, dict) and bool(kwargs.get("enable_thinking"))
    return _plan_answer(
        body,
        default_model,
        rng=random.Random(seed + index * 7919),
        user_text=user_text,
        tools=body.get("tools"),
        thinking=thinking,
        prompt_ids=[token_id(p) for p in tokenize(render_prompt(messages))],
        raw_markup=flavor == "sglang",
        answer_tokens=answer_tokens,
        vllm_wire=flavor == "vllm",
    )


def _plan_answer(
    body: dict[str, Any],
    default_model: str,
    *,
    rng: random.Random,
    user_text: str,
    tools: Any,
    thinking: bool,
    prompt_ids: list[int],
    raw_markup: bool = False,
    answer_tokens: int = 0,
    vllm_wire: bool = False,
) -> _Plan:

    def make(piece: str, channel: str, text: str | None = None) -> _Token:
        logprob = -(0.001 + rng.random() * 2.998)
        return _Token(
            piece=piece, logprob=logprob, channel=channel, text=piece if text is None else text
        )

    tokens: list[_Token] = []
    if thinking:
        reasoning = [make(p, "reasoning") for p in tokenize(_REASONING_TEXT)]
        if raw_markup:
            reasoning = [
                make("<think>", "markup", ""),
                make("\n", "markup", ""),
                *reasoning,
                make("\n", "markup", ""),
                make("</think>", "markup", ""),
                make("\n\n", "markup", ""),
            ]
        tokens += reasoning
    tool_name: str | None = None
    echo = " ".join(user_text.split()[:_MAX_ECHO_WORDS])
    if isinstance(tools, list) and tools and "/tool" in user_text:
        first = tools[0] if isinstance(tools[0], dict) else {}
        function = first.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        tool_name = str(name or "tool")
        arguments = orjson.dumps({"query": echo}).decode()
        tokens.append(make("<tool_call>", "tool", ""))
        if raw_markup:
            head = f'\n{{"name": {orjson.dumps(tool_name).decode()}, "arguments": '
            tokens.append(make(head, "markup", ""))
        # Split the arguments at a fixed point so they always stream in at least two fragments.
        half = max(1, len(arguments) // 2)
        tokens += [make(arguments[:half], "tool"), make(arguments[half:], "tool")]
        if raw_markup:
            tokens += [make("}\n", "markup", ""), make("</tool_call>", "markup", "")]
        finish_reason = "tool_calls"
    else:
        reply = f"Mock reply {rng.randint(1, 99)}: you said {echo}".rstrip()
        # With vLLM's EOS, `answer_tokens` counts it too (the answer's length in tokens).
        sized = max(1, answer_tokens - 1) if vllm_wire and answer_tokens > 0 else answer_tokens
        tokens += [make(p, "content") for p in _sized(tokenize(reply), sized)]
        finish_reason = "stop"
        if vllm_wire and "/utf8-fragment" in user_text and len(tokens) > 1:
            tokens = _with_fragment(tokens, make)
    tokens, stop_reason = _apply_stop(tokens, body.get("stop"))
    if stop_reason is not None:
        finish_reason = "stop"
    elif vllm_wire:
        # A natural stop samples EOS: its id and logprob are sent, its text never is.
        channel = "tool" if finish_reason == "tool_calls" else "content"
        eos = make(EOS_PIECE, channel, "")
        tokens.append(dataclasses.replace(eos, fixed_id=EOS_ID))
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    sampling = body.get("sampling_params")
    if isinstance(sampling, dict):
        limit = sampling.get("max_new_tokens")
    if isinstance(limit, int) and 0 < limit < len(tokens):
        tokens = tokens[:limit]
        finish_reason = "length"
        stop_reason = None
    top = body.get("top_logprobs")
    stream_options = body.get("stream_options")
    return _Plan(
        completion_id=f"chatcmpl-mock-{uuid.uuid4().hex[:24]}",
        created=int(time.time()),
        model=str(body.get("model") or default_model),
        prompt_ids=prompt_ids,
        tokens=tokens,
        finish_reason=finish_reason,
        tool_name=tool_name,
        tool_call_id=f"call_{uuid.uuid4().hex[:16]}",
        top_logprobs=top if isinstance(top, int) and top > 0 else 0,
        want_logprobs=bool(body.get("logprobs")),
        want_token_ids=bool(body.get("return_token_ids")),
        want_usage=isinstance(stream_options, dict) and bool(stream_options.get("include_usage")),
        stream=bool(body.get("stream")),
        vllm_wire=vllm_wire,
        stop_reason=stop_reason,
    )


def _with_fragment(tokens: list[_Token], make: Callable[..., _Token]) -> list[_Token]:
    """A lone UTF-8 fragment sampled after the first token, as vLLM reports one."""
    lone = make("\u00e4", "content", "")
    lone = dataclasses.replace(lone, fixed_id=FRAGMENT_ID, entry_token="", entry_bytes=())
    after = tokens[1]
    # The detokenizer gives up on the fragment when the next token arrives: U+FFFD.
    after = dataclasses.replace(after, text="\ufffd" + after.text)
    return [tokens[0], lone, after, *tokens[2:]]


def _stop_strings(stop: Any) -> list[str]:
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list):
        return [s for s in stop if isinstance(s, str) and s]
    return []


def _apply_stop(tokens: list[_Token], stop: Any) -> tuple[list[_Token], str | None]:
    """The tokens up to the one completing a stop string (kept: it was sampled, but the
    content ends before the match), and the string; (tokens, None) when none matches."""
    stops = _stop_strings(stop)
    if not stops:
        return tokens, None
    text = ""
    for i, token in enumerate(tokens):
        if token.channel != "content":
            continue
        before = len(text)
        text += token.text
        found = [(text.find(s, max(0, before - len(s) + 1)), s) for s in stops]
        hits = [(at, s) for at, s in found if at >= 0]
        if hits:
            at, matched = min(hits)
            cut = dataclasses.replace(token, text=token.text[: max(0, at - before)])
            return [*tokens[:i], cut], matched
    return tokens, None


_FILLER = tokenize(" and then the mock went on talking about nothing in particular")


def _sized(pieces: list[str], answer_tokens: int) -> list[str]:
    """The reply's pieces cut or padded with filler words to `answer_tokens` (0: as they are)."""
    if answer_tokens <= 0:
        return pieces
    filler = itertools.cycle(_FILLER)
    return (pieces + [next(filler) for _ in range(max(0, answer_tokens - len(pieces)))])[
        :answer_tokens
    ]


def _logprob_entry(token: _Token, top: int) -> dict[str, Any]:
    name = token.piece if token.entry_token is None else token.entry_token
    raw = list(token.piece.encode()) if token.entry_bytes is None else list(token.entry_bytes)
    alternatives = [{"token": name, "logprob": token.logprob, "bytes": raw}]
    for i in range(1, top):
        alt = f"<alt{i}>"
        alternatives.append(
            {"token": alt, "logprob": token.logprob - 1.0 - i, "bytes": list(alt.encode())}
        )
    return {
        "token": name,
        "logprob": token.logprob,
        "bytes": raw,
        "top_logprobs": alternatives[:top],
    }


def _logprobs(plan: _Plan, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """A choice's `logprobs` (OpenAI adds `refusal: null`, vLLM does not)."""
    return {"content": entries} if plan.vllm_wire else {"content": entries, "refusal": None}


def _usage(plan: _Plan) -> dict[str, Any]:
    completion = len(plan.tokens)
    return {
        "prompt_tokens": len(plan.prompt_ids),
        "completion_tokens": completion,
        "total_tokens": len(plan.prompt_ids) + completion,
    }


def _completion_body(plan: _Plan) -> dict[str, Any]:
    content = "".join(t.text for t in plan.tokens if t.channel == "content")
    reasoning = "".join(t.text for t in plan.tokens if t.channel == "reasoning")
    # vLLM answers "" where OpenAI answers null (a tool call, EOS only).
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content if plan.vllm_wire else content or None,
    }
    if reasoning:
        message["reasoning_content"] = reasoning
    if plan.tool_name is not None:
        message["tool_calls"] = [
            {
                "id": plan.tool_call_id,
                "type": "function",
                "function": {
                    "name": plan.tool_name,
                    "arguments": "".join(t.text for t in plan.tokens if t.channel == "tool"),
                },
            }
        ]
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": (
            _logprobs(plan, [_logprob_entry(t, plan.top_logprobs) for t in plan.tokens])
            if plan.want_logprobs
            else None
        ),
        "finish_reason": plan.finish_reason,
    }
    if plan.vllm_wire:
        choice["stop_reason"] = plan.stop_reason
    body: dict[str, Any] = {
        "id": plan.completion_id,
        "object": "chat.completion",
        "created": plan.created,
        "model": plan.model,
        "system_fingerprint": MOCK_FINGERPRINT,
        "choices": [choice],
        "usage": _usage(plan),
    }
    if plan.want_token_ids:
        body["prompt_token_ids"] = plan.prompt_ids
        choice["token_ids"] = [t.id for t in plan.tokens]
    return body


def _chunk(plan: _Plan, choice: dict[str, Any] | None, **extra: Any) -> bytes:
    body: dict[str, Any] = {
        "id": plan.completion_id,
        "object": "chat.completion.chunk",
        "created": plan.created,
        "model": plan.model,
        "choices": [choice] if choice is not None else [],
    }
    if not plan.vllm_wire:
        # OpenAI: the fingerprint on every chunk, and `usage: null` on each one with usage on.
        body["system_fingerprint"] = MOCK_FINGERPRINT
        if plan.want_usage:
            body["usage"] = None
    elif "usage" in extra:
        body["system_fingerprint"] = MOCK_FINGERPRINT
    body.update(extra)
    return b"data: " + orjson.dumps(body) + b"\n\n"


def _token_delta(plan: _Plan, token: _Token, first_tool_fragment: bool) -> dict[str, Any]:
    """The delta of one token's chunk."""
    if token.channel == "reasoning":
        return {"reasoning_content": token.text}
    if token.channel == "content":
        return {"content": token.text}
    if token.channel == "markup":
        return {}
    fragment: dict[str, Any] = {"index": 0, "function": {"arguments": token.text}}
    if first_tool_fragment:
        fragment = {
            "index": 0,
            "id": plan.tool_call_id,
            "type": "function",
            "function": {"name": plan.tool_name, "arguments": token.text},
        }
    return {"tool_calls": [fragment]}


def _stream_chunks(plan: _Plan) -> list[bytes]:
    """Every SSE event of the answer, in order: role, one per token, finish, usage, [DONE]."""
    first_extra: dict[str, Any] = (
        {"prompt_token_ids": plan.prompt_ids} if plan.want_token_ids else {}
    )
    role_choice: dict[str, Any] = {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    if plan.want_token_ids and not plan.vllm_wire:
        role_choice["token_ids"] = []
    events = [_chunk(plan, role_choice, **first_extra)]
    first_tool = True
    for position, token in enumerate(plan.tokens, start=1):
        choice: dict[str, Any] = {
            "index": 0,
            "delta": _token_delta(plan, token, first_tool and token.channel == "tool"),
            "logprobs": (
                _logprobs(plan, [_logprob_entry(token, plan.top_logprobs)])
                if plan.want_logprobs
                else None
            ),
            "finish_reason": None,
        }
        if token.channel == "tool":
            first_tool = False
        if plan.vllm_wire and position == len(plan.tokens):
            # vLLM: the finish rides on the last token's chunk.
            choice["finish_reason"] = plan.finish_reason
            choice["stop_reason"] = plan.stop_reason
        if plan.want_token_ids:
            choice["token_ids"] = [token.id]
        events.append(_chunk(plan, choice))
    if plan.vllm_wire and plan.tokens:
        if plan.want_usage:
            events.append(_chunk(plan, None, usage=_usage(plan)))
        events.append(b"data: [DONE]\n\n")
        return events
    final: dict[str, Any] = {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": plan.finish_reason,
    }
    if plan.want_token_ids:
        final["token_ids"] = []
    events.append(_chunk(plan, final))
    if plan.want_usage:
        events.append(_chunk(plan, None, usage=_usage(plan)))
    events.append(b"data: [DONE]\n\n")
    return events


@dataclass(frozen=True, slots=True, kw_only=True)
class _GenerateAnswer:
    """A /generate answer: raw output tokens (markup included), like SGLang's native API."""

    rid: str
    prompt_ids: list[int]
    user_text: str
    tokens: list[tuple[str, float]]
    finish: dict[str, Any]
    with_text: bool

    def event(self, upto: int) -> dict[str, Any]:
        """The answer after `upto` tokens (SGLang streams cumulative text and meta_info)."""
        done = upto >= len(self.tokens)
        triples = [
            [logprob, token_id(piece), piece if self.with_text else None]
            for piece, logprob in self.tokens[:upto]
        ]
        return {
            "text": "".join(piece for piece, _ in self.tokens[:upto]),
            "output_ids": [token_id(piece) for piece, _ in self.tokens[:upto]],
            "meta_info": {
                "id": self.rid,
                "finish_reason": self.finish if done else None,
                "prompt_tokens": len(self.prompt_ids),
                "completion_tokens": upto,
                "cached_tokens": 0,
                "output_token_logprobs": triples,
            },
        }


_LAST_USER = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.DOTALL)
_TOOL_NAME = re.compile(r'<tools>.*?"name":\s*"([^"]+)"', re.DOTALL)


def _generate_answer(
    body: dict[str, Any], decode: Callable[[list[int]], str] | None
) -> _GenerateAnswer:
    input_ids = body.get("input_ids")
    if isinstance(input_ids, list) and input_ids:
        prompt_ids = [int(i) for i in input_ids]
        prompt = decode(prompt_ids) if decode is not None else ""
    elif isinstance(body.get("text"), str):
        prompt = body["text"]
        prompt_ids = [token_id(p) for p in tokenize(prompt)]
    else:
        raise _BadRequest("either text or input_ids should be provided")
    users = _LAST_USER.findall(prompt)
    user_text = users[-1] if users else ""
    tool = _TOOL_NAME.search(prompt)
    rng = random.Random(zlib.crc32(orjson.dumps(prompt_ids)))
    echo = " ".join(user_text.split()[:_MAX_ECHO_WORDS])
    raw = ""
    if "/think" in user_text:
        raw += f"<think>\n{_REASONING_TEXT}\n</think>\n\n"
    if tool is not None and "/tool" in user_text:
        call = orjson.dumps({"name": tool.group(1), "arguments": {"query": echo}}).decode()
        raw += f"<tool_call>\n{call}\n</tool_call>"
    else:
        raw += f"Mock reply {rng.randint(1, 99)}: you said {echo}".rstrip()
    pieces = tokenize(raw)
    finish: dict[str, Any] = {"type": "stop", "matched": 151645}
    params = body.get("sampling_params")
    limit = params.get("max_new_tokens") if isinstance(params, dict) else None
    if isinstance(limit, int) and 0 < limit < len(pieces):
        pieces = pieces[:limit]
        finish = {"type": "length", "length": limit}
    return _GenerateAnswer(
        rid=uuid.uuid4().hex,
        prompt_ids=prompt_ids,
        user_text=user_text,
        tokens=[(p, -(0.001 + rng.random() * 2.998)) for p in pieces],
        finish=finish,
        with_text=bool(body.get("return_text_in_logprobs")),
    )


def _group_body(plans: list[_Plan]) -> dict[str, Any]:
    """One chat.completion with a choice per plan (n > 1), usage summed."""
    body = _completion_body(plans[0])
    for index, plan in enumerate(plans[1:], start=1):
        choice = _completion_body(plan)["choices"][0]
        choice["index"] = index
        body["choices"].append(choice)
    completion = sum(len(p.tokens) for p in plans)
    body["usage"]["completion_tokens"] = completion
    body["usage"]["total_tokens"] = body["usage"]["prompt_tokens"] + completion
    return body


def _group_stream(plans: list[_Plan]) -> list[bytes]:
    """The SSE events of n > 1 choices, interleaved token by token, one usage chunk, [DONE]."""
    if len(plans) == 1:
        return _stream_chunks(plans[0])
    per_choice: list[list[bytes]] = []
    for index, plan in enumerate(plans):
        events = []
        for raw in _stream_chunks(dataclasses.replace(plan, want_usage=False))[:-1]:
            chunk = orjson.loads(raw.removeprefix(b"data: "))
            chunk["choices"][0]["index"] = index
            # vLLM sends the prompt ids on every choice's role chunk.
            if index and not plan.vllm_wire:
                chunk.pop("prompt_token_ids", None)
            if plans[0].want_usage and not plan.vllm_wire:
                chunk["usage"] = None
            events.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
        per_choice.append(events)
    out = [e for group in itertools.zip_longest(*per_choice) for e in group if e is not None]
    if plans[0].want_usage:
        usage = _group_body(plans)["usage"]
        out.append(_chunk(plans[0], None, usage=usage))
    out.append(b"data: [DONE]\n\n")
    return out


def _usage_variant(events: list[bytes], variant: str) -> list[bytes]:
    """The events with the usage chunk's `choices` as `variant` says (`[]`, null, absent)."""
    if variant == "empty":
        return events
    out = []
    for event in events:
        payload = event.removeprefix(b"data: ").strip()
        if payload != b"[DONE]":
            chunk = orjson.loads(payload)
            if chunk.get("choices") == [] and chunk.get("usage") is not None:
                if variant == "null":
                    chunk["choices"] = None
                else:
                    del chunk["choices"]
                event = b"data: " + orjson.dumps(chunk) + b"\n\n"
        out.append(event)
    return out


def _error(status: int, message: str, *, code: str | None = None, **headers: str) -> web.Response:
    error_type = {
        401: "invalid_request_error",
        404: "invalid_request_error",
        429: "rate_limit_exceeded",
    }.get(status, "invalid_request_error" if status < 500 else "server_error")
    body = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    return web.Response(
        status=status, body=orjson.dumps(body), content_type="application/json", headers=headers
    )


def _vllm_error(status: int, message: str, *, param: str | None = None) -> web.Response:
    """vLLM's error shape: the exception's name as `type`, the status as an integer `code`."""
    error_type = {404: "NotFoundError"}.get(status, "BadRequestError")
    body = {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


@dataclass(slots=True, kw_only=True)
class MockStats:
    """What the mock has seen, for tests."""

    requests: int = 0
    last_body: dict[str, Any] | None = None
    last_headers: dict[str, str] = field(default_factory=dict)
    # Streamed token chunks written so far, across requests.
    tokens_streamed: int = 0
    streams_finished: int = 0
    # Requests whose client went away before the answer was complete.
    disconnects: int = 0
    # Chat requests per requested model id (what reached this upstream, aliases resolved).
    models: dict[str, int] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        """What `GET /mock/stats` answers (other processes' tests read it)."""
        return {"requests": self.requests, "models": self.models, "disconnects": self.disconnects}


class MockLLM:
    """The mock as an `async with` server: `async with MockLLM(port=0) as mock: mock.base_url`."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        latency_ms: float = 0.0,
        token_interval_ms: float = 0.0,
        model: str = "rollgate-mock",
        api_key: str | None = None,
        flavor: str = "vllm",
        strict_model: bool = False,
        decode: Callable[[list[int]], str] | None = None,
        usage_choices: str = "empty",
        answer_tokens: int = 0,
    ) -> None:
        if flavor not in FLAVORS:
            raise ValueError(f"flavor {flavor!r} is not one of {', '.join(FLAVORS)}")
        if usage_choices not in USAGE_CHOICES:
            raise ValueError(f"usage_choices {usage_choices!r} is not one of {USAGE_CHOICES}")
        # The streamed usage chunk's `choices`: [] ("empty"), null ("null"), no key ("absent").
        self.usage_choices = usage_choices
        # vllm: honours return_token_ids; sglang: SGLang's shapes (chat without ids, /generate);
        # openai: a hosted API (refuses return_token_ids like OpenAI does).
        self.flavor = flavor
        # True: a request for another model gets vLLM's 404 "model does not exist".
        self.strict_model = strict_model
        # Reads the prompt text back from /generate's input_ids (tests pass a tokenizer's).
        self.decode = decode
        self.host = host
        self.port = port
        self.latency_s = latency_ms / 1000
        self.token_interval_s = token_interval_ms / 1000
        # > 0: every text answer has exactly this many tokens (before a max_tokens cut).
        self.answer_tokens = answer_tokens
        self.model = model
        self.api_key = api_key
        self.stats = MockStats()
        self._runner: web.AppRunner | None = None

    @property
    def base_url(self) -> str:
        """The OpenAI base URL, ending in /v1."""
        return f"http://{self.host}:{self.port}/v1"

    def app(self) -> web.Application:
        """The aiohttp application."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
        for prefix in ("/v1", ""):
            app.router.add_post(f"{prefix}/chat/completions", self._chat)
            app.router.add_get(f"{prefix}/models", self._models)
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/mock/stats", self._stats)
        return app

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats.as_json(), dumps=lambda v: orjson.dumps(v).decode())

    async def __aenter__(self) -> MockLLM:
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or ()
        if sockets:
            self.port = int(sockets[0].getsockname()[1])
        log.warning(
            "THIS IS THE ROLLGATE MOCK LLM on %s (model %r): answers are fake, not a real model",
            self.base_url,
            self.model,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _authorized(self, request: web.Request) -> bool:
        if not self.api_key:
            return True
        return request.headers.get("Authorization", "") == f"Bearer {self.api_key}"

    async def _models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _error(401, "Incorrect API key provided.", code="invalid_api_key")
        body = {
            "object": "list",
            "data": [{"id": self.model, "object": "model", "owned_by": "rollgate-mock"}],
        }
        return web.json_response(body, dumps=lambda v: orjson.dumps(v).decode())

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.stats.requests += 1
        self.stats.last_headers = dict(request.headers)
        if not self._authorized(request):
            return _error(401, "Incorrect API key provided.", code="invalid_api_key")
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as err:
            return _error(400, f"invalid JSON body: {err}")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        self.stats.last_body = body
        model = str(body.get("model"))
        self.stats.models[model] = self.stats.models.get(model, 0) + 1
        refused = self._refusal(body)
        if refused is not None:
            return refused
        try:
            n = body.get("n") or 1
            count = n if isinstance(n, int) else 1
            plans = [
                _plan(body, self.model, i, self.flavor, self.answer_tokens) for i in range(count)
            ]
        except _BadRequest as err:
            if self.flavor == "vllm":
                return _vllm_error(400, str(err), param="messages")
            return _error(400, str(err))
        if self.flavor != "vllm":
            plans = [dataclasses.replace(p, want_token_ids=False) for p in plans]
        plans = [
            dataclasses.replace(p, completion_id=plans[0].completion_id, created=plans[0].created)
            for p in plans
        ]
        plan = plans[0]
        user_text = _last_user_text(body["messages"])
        forced = _FAIL.search(user_text)
        if forced:
            status = int(forced.group(1))
            headers = {"Retry-After": "2"} if status == 429 else {}
            return _error(status, f"mock failure {status} forced by the request", **headers)
        if "/hang" in user_text:
            return await self._hang(request)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        if not plan.stream:
            return web.Response(
                body=orjson.dumps(_group_body(plans)), content_type="application/json"
            )
        events = _usage_variant(_group_stream(plans), self.usage_choices)
        return await self._stream(
            request, plan, events, midstream_failure="/fail-midstream" in user_text
        )

    def _refusal(self, body: dict[str, Any]) -> web.Response | None:
        if self.flavor == "openai" and "return_token_ids" in body:
            return _error(400, "Unrecognized request argument supplied: return_token_ids")
        model = body.get("model")
        if self.strict_model and model != self.model:
            message = f"The model `{model}` does not exist."
            if self.flavor == "vllm":
                return _vllm_error(404, f"{message} Valid aliases: {self.model}.", param="model")
            return _error(404, message, code="model_not_found")
        return None

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        """SGLang's native /generate: input_ids (or text) in, meta_info logprob triples out."""
        self.stats.requests += 1
        self.stats.last_headers = dict(request.headers)
        if not self._authorized(request):
            return _error(401, "Incorrect API key provided.", code="invalid_api_key")
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as err:
            return _error(400, f"invalid JSON body: {err}")
        self.stats.last_body = body
        if not isinstance(body, dict) or self.flavor != "sglang":
            return _error(404, "Not Found")
        try:
            answer = _generate_answer(body, self.decode)
        except _BadRequest as err:
            return _error(400, str(err))
        forced = _FAIL.search(answer.user_text)
        if forced:
            status = int(forced.group(1))
            headers = {"Retry-After": "2"} if status == 429 else {}
            return _error(status, f"mock failure {status} forced by the request", **headers)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        if not body.get("stream"):
            return web.Response(
                body=orjson.dumps(answer.event(len(answer.tokens))),
                content_type="application/json",
            )
        events = [
            b"data: " + orjson.dumps(answer.event(i)) + b"\n\n"
            for i in range(1, len(answer.tokens) + 1)
        ]
        return await self._stream(
            request, None, [*events, b"data: [DONE]\n\n"], midstream_failure=False, first=0
        )

    async def _hang(self, request: web.Request) -> web.StreamResponse:
        # Waits until the client goes away: the runner cancels handlers on disconnect.
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.stats.disconnects += 1
            raise
        raise AssertionError("unreachable")

    async def _stream(
        self,
        request: web.Request,
        plan: _Plan | None,
        events: list[bytes],
        *,
        midstream_failure: bool,
        first: int = 1,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        last_token = len(plan.tokens) if plan is not None else len(events) - 2
        try:
            for i, event in enumerate(events):
                if midstream_failure and i == 2:
                    if request.transport is not None:
                        request.transport.abort()
                    return response
                if first <= i <= last_token:
                    if self.token_interval_s and i > first:
                        await asyncio.sleep(self.token_interval_s)
                    await response.write(event)
                    self.stats.tokens_streamed += 1
                else:
                    await response.write(event)
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            self.stats.disconnects += 1
            raise
        self.stats.streams_finished += 1
        return response


def main(argv: list[str] | None = None) -> int:
    """`python -m rollgate.mock_llm`: serve the mock until interrupted."""
    parser = argparse.ArgumentParser(prog="rollgate mock-llm", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--latency-ms", type=float, default=0.0, help="delay before the first token"
    )
    parser.add_argument("--token-interval-ms", type=float, default=0.0, help="delay between tokens")
    parser.add_argument(
        "--answer-tokens",
        type=int,
        default=0,
        help="tokens in every text answer (0: a short echo of the last user message)",
    )
    parser.add_argument("--model", default="rollgate-mock")
    parser.add_argument("--api-key", default=None, help="require this bearer key (401 otherwise)")
    parser.add_argument(
        "--flavor", choices=FLAVORS, default="vllm", help="which server's wire shapes to speak"
    )
    parser.add_argument(
        "--strict-model", action="store_true", help="404 for any model but --model (like vLLM)"
    )
    parser.add_argument(
        "--usage-choices",
        choices=USAGE_CHOICES,
        default="empty",
        help="the streamed usage chunk's choices: [] (empty), null, or no key (absent)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    mock = MockLLM(
        host=args.host,
        port=args.port,
        latency_ms=args.latency_ms,
        token_interval_ms=args.token_interval_ms,
        model=args.model,
        api_key=args.api_key,
        flavor=args.flavor,
        strict_model=args.strict_model,
        usage_choices=args.usage_choices,
        answer_tokens=args.answer_tokens,
    )

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with mock:
            await stop.wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
