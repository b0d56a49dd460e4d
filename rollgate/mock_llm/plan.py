"""The planner: everything one request will answer, decided from the request before the first
byte (deterministic: word-level tokens with hashed ids, seeded logprobs)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random
import re
import time
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from rollgate.mock_llm.faults import Faults, with_fragment

_PIECE = re.compile(r"\s*\S+|\s+")
REASONING_TEXT = "Let me think about what the user asked before I answer."
# Qwen's <|im_end|>, the EOS a vLLM serving a ChatML model samples at a natural stop.
EOS_PIECE = "<|im_end|>"
EOS_ID = 151645
MAX_ECHO_WORDS = 24


def tokenize(text: str) -> list[str]:
    """Word-level pieces (each keeps its leading whitespace, like BPE); joined they give `text`."""
    return _PIECE.findall(text)


def token_id(piece: str) -> int:
    """A stable id for a piece: 100 + crc32 % 50000."""
    return 100 + zlib.crc32(piece.encode()) % 50_000


def content_text(content: Any) -> str:
    """A message's content as text (a string, or the text of its parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def render_prompt(messages: Sequence[Any]) -> str:
    """A ChatML-like template over the messages, ending with the assistant header."""
    return "".join(_segments(messages))


def _segments(messages: Sequence[Any]) -> Iterator[str]:
    """The rendering in parts, each cut right after an `<|im_end|>`, before its newline."""
    lead = ""
    for message in messages:
        if isinstance(message, dict):
            role = str(message.get("role", "user"))
            yield f"{lead}<|im_start|>{role}\n{content_text(message.get('content'))}<|im_end|>"
            lead = "\n"
    yield f"{lead}<|im_start|>assistant\n"


def prompt_token_ids(messages: Sequence[Any]) -> list[int]:
    """The ids of `tokenize(render_prompt(messages))`, each message's tokenised once and kept,
    as an engine's prefix cache keeps an agent's unchanged system prompt (re-tokenising 48 KB
    took the mock ≈ 2 ms of CPU per request, which a bench on one machine charged to whatever
    ran beside it).

    The rendering is cut right after each `<|im_end|>`, before its newline: a piece always ends
    where whitespace follows non-whitespace, so the pieces of the parts are the pieces of the
    whole."""
    ids: list[int] = []
    for segment in _segments(messages):
        ids += _segment_ids(segment)
    return ids


@functools.lru_cache(maxsize=256)  # the recent messages of a few conversations
def _segment_ids(segment: str) -> tuple[int, ...]:
    return tuple(token_id(piece) for piece in tokenize(segment))


def last_user_text(messages: Sequence[Any]) -> str:
    """The text of the last user message ("" when there is none)."""
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            return content_text(message.get("content"))
    return ""


def echo_of(user_text: str) -> str:
    """The start of the user's words the mock's answers echo."""
    return " ".join(user_text.split()[:MAX_ECHO_WORDS])


def sampled_logprob(rng: random.Random) -> float:
    """A logprob in (-3, 0)."""
    return -(0.001 + rng.random() * 2.998)


class BadRequest(Exception):
    """The request cannot be answered (400); the message says why."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Token:
    """One sampled token of the answer."""

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
class Plan:
    """Everything one request will answer, decided before the first byte."""

    completion_id: str
    created: int
    model: str
    prompt_ids: list[int]
    tokens: list[Token]
    finish_reason: str
    tool_name: str | None
    tool_call_id: str
    top_logprobs: int
    want_logprobs: bool
    want_token_ids: bool
    want_usage: bool
    stream: bool
    # vLLM's `stop_reason`: the stop string matched (None: EOS, length, or a tool call).
    stop_reason: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampling:
    """What a flavour's server samples besides the answer's words."""

    # SGLang: <think>/</think> and the tool-call markup are tokens (with logprobs, no delta).
    raw_markup: bool = False
    # vLLM: EOS is sampled at a natural stop (its id and logprob sent, never its text), and a
    # lone UTF-8 fragment can be (`/utf8-fragment`).
    eos: bool = False
    # vLLM: a `tool_choice` naming one of the request's functions forces a call of it, which
    # ends with finish_reason "stop" (as OpenAI ends one), not "tool_calls".
    named_tool_choice: bool = False


def plan_chat(
    body: dict[str, Any],
    default_model: str,
    *,
    index: int = 0,
    sampling: Sampling = Sampling(),
    answer_tokens: int = 0,
) -> Plan:
    """The plan of choice `index` of a chat completion request."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    seed = body.get("seed")
    if not isinstance(seed, int):
        seed = zlib.crc32(orjson.dumps(messages))
    kwargs = body.get("chat_template_kwargs")
    return _plan_answer(
        body,
        default_model,
        rng=random.Random(seed + index * 7919),
        user_text=last_user_text(messages),
        tools=body.get("tools"),
        thinking=isinstance(kwargs, dict) and bool(kwargs.get("enable_thinking")),
        prompt_ids=prompt_token_ids(messages),
        sampling=sampling,
        answer_tokens=answer_tokens,
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
    sampling: Sampling,
    answer_tokens: int,
) -> Plan:
    def make(piece: str, channel: str, text: str | None = None) -> Token:
        return Token(
            piece=piece,
            logprob=sampled_logprob(rng),
            channel=channel,
            text=piece if text is None else text,
        )

    tokens: list[Token] = []
    if thinking:
        tokens += _reasoning(make, raw_markup=sampling.raw_markup)
    tool_name: str | None = None
    echo = echo_of(user_text)
    forced = _named_tool(body.get("tool_choice"), tools) if sampling.named_tool_choice else None
    if forced is not None:
        tool_name = forced
        tokens += _tool_call(make, tool_name, echo, raw_markup=sampling.raw_markup)
        finish_reason = "stop"
    elif isinstance(tools, list) and tools and "/tool" in user_text:
        tool_name = _tool_name(tools[0])
        tokens += _tool_call(make, tool_name, echo, raw_markup=sampling.raw_markup)
        finish_reason = "tool_calls"
    else:
        reply = f"Mock reply {rng.randint(1, 99)}: you said {echo}".rstrip()
        # With vLLM's EOS, `answer_tokens` counts it too (the answer's length in tokens).
        sized = max(1, answer_tokens - 1) if sampling.eos and answer_tokens > 0 else answer_tokens
        tokens += [make(p, "content") for p in _sized(tokenize(reply), sized)]
        finish_reason = "stop"
        if sampling.eos and Faults.of(user_text).utf8_fragment and len(tokens) > 1:
            tokens = with_fragment(tokens, make)
    tokens, stop_reason = _apply_stop(tokens, body.get("stop"))
    if stop_reason is not None:
        finish_reason = "stop"
    elif sampling.eos:
        # A natural stop samples EOS: its id and logprob are sent, its text never is.
        channel = "tool" if tool_name is not None else "content"
        eos = make(EOS_PIECE, channel, "")
        tokens.append(dataclasses.replace(eos, fixed_id=EOS_ID))
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    params = body.get("sampling_params")
    if isinstance(params, dict):
        limit = params.get("max_new_tokens")
    if isinstance(limit, int) and 0 < limit < len(tokens):
        tokens = tokens[:limit]
        finish_reason = "length"
        stop_reason = None
    top = body.get("top_logprobs")
    stream_options = body.get("stream_options")
    return Plan(
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
        stop_reason=stop_reason,
    )


Make = Callable[..., Token]


def _reasoning(make: Make, *, raw_markup: bool) -> list[Token]:
    reasoning = [make(p, "reasoning") for p in tokenize(REASONING_TEXT)]
    if not raw_markup:
        return reasoning
    return [
        make("<think>", "markup", ""),
        make("\n", "markup", ""),
        *reasoning,
        make("\n", "markup", ""),
        make("</think>", "markup", ""),
        make("\n\n", "markup", ""),
    ]


def _named_tool(choice: Any, tools: Any) -> str | None:
    """The function a `{"type": "function", "function": {"name"}}` tool_choice names, when the
    request's tools have it."""
    if not isinstance(choice, dict) or choice.get("type") != "function":
        return None
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    names = {_tool_name(tool) for tool in tools} if isinstance(tools, list) else set()
    return name if isinstance(name, str) and name in names else None


def _tool_name(first: Any) -> str:
    function = first.get("function") if isinstance(first, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    return str(name or "tool")


def _tool_call(make: Make, tool_name: str, echo: str, *, raw_markup: bool) -> list[Token]:
    arguments = orjson.dumps({"query": echo}).decode()
    tokens = [make("<tool_call>", "tool", "")]
    if raw_markup:
        head = f'\n{{"name": {orjson.dumps(tool_name).decode()}, "arguments": '
        tokens.append(make(head, "markup", ""))
    # Split the arguments at a fixed point so they always stream in at least two fragments.
    half = max(1, len(arguments) // 2)
    tokens += [make(arguments[:half], "tool"), make(arguments[half:], "tool")]
    if raw_markup:
        tokens += [make("}\n", "markup", ""), make("</tool_call>", "markup", "")]
    return tokens


def _stop_strings(stop: Any) -> list[str]:
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list):
        return [s for s in stop if isinstance(s, str) and s]
    return []


def _apply_stop(tokens: list[Token], stop: Any) -> tuple[list[Token], str | None]:
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
