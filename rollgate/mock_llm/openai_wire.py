"""OpenAI's chat completion wire shapes (the `openai` flavour: a hosted API), which the other
flavours' wires (vllm_wire.py, sglang_wire.py) change where their servers differ."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, ClassVar

import orjson
from aiohttp import web

from rollgate.mock_llm.plan import Plan, Sampling, Token

MOCK_FINGERPRINT = "rollgate-mock"
# How the streamed usage chunk carries `choices`: `[]`, `null`, or no key at all.
USAGE_CHOICES = ("empty", "null", "absent")
DONE = b"data: [DONE]\n\n"


def openai_error(
    status: int, message: str, *, code: str | None = None, **headers: str
) -> web.Response:
    """An error in OpenAI's shape `{"error": {message, type, param, code}}`."""
    error_type = {
        401: "invalid_request_error",
        404: "invalid_request_error",
        429: "rate_limit_exceeded",
    }.get(status, "invalid_request_error" if status < 500 else "server_error")
    body = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    return web.Response(
        status=status, body=orjson.dumps(body), content_type="application/json", headers=headers
    )


def sse(body: Any) -> bytes:
    """One server-sent event carrying `body` as JSON."""
    return b"data: " + orjson.dumps(body) + b"\n\n"


def logprob_entry(token: Token, top: int) -> dict[str, Any]:
    """A token's `logprobs.content` entry, with `top` alternatives."""
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


def usage(plan: Plan) -> dict[str, Any]:
    """The answer's usage block."""
    completion = len(plan.tokens)
    return {
        "prompt_tokens": len(plan.prompt_ids),
        "completion_tokens": completion,
        "total_tokens": len(plan.prompt_ids) + completion,
    }


def usage_variant(events: list[bytes], variant: str) -> list[bytes]:
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
                event = sse(chunk)
        out.append(event)
    return out


class OpenAIWire:
    """A hosted OpenAI-compatible API: no token ids (`return_token_ids` is refused), `refusal:
    null` in logprobs, the fingerprint on every chunk, an empty closing chunk with the finish."""

    flavor: ClassVar[str] = "openai"
    sampling: ClassVar[Sampling] = Sampling()
    # Whether `return_token_ids` is honoured (prompt ids and sampled ids in the answer).
    token_ids: ClassVar[bool] = False
    # Whether SGLang's native `/generate` is served.
    serves_generate: ClassVar[bool] = False

    # -- errors ----------------------------------------------------------------------------

    def refusal(self, body: dict[str, Any]) -> web.Response | None:
        """An answer refusing the request's fields before anything else, if any."""
        if "return_token_ids" in body:
            return openai_error(400, "Unrecognized request argument supplied: return_token_ids")
        return None

    def bad_request(self, message: str) -> web.Response:
        """A request the planner refused (400)."""
        return openai_error(400, message)

    def unknown_model(self, model: Any, served: str) -> web.Response:
        """A request for a model this server does not serve (404, `--strict-model`)."""
        return openai_error(404, f"The model `{model}` does not exist.", code="model_not_found")

    # -- non-streaming ---------------------------------------------------------------------

    def logprobs(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        """A choice's `logprobs`."""
        return {"content": entries, "refusal": None}

    def message_content(self, content: str) -> str | None:
        """The message's `content` (OpenAI: null when there is no text)."""
        return content or None

    def end_choice(self, plan: Plan, choice: dict[str, Any]) -> None:
        """Adds what this server puts beside `finish_reason`."""

    def completion_body(self, plan: Plan) -> dict[str, Any]:
        """One chat.completion."""
        content = "".join(t.text for t in plan.tokens if t.channel == "content")
        reasoning = "".join(t.text for t in plan.tokens if t.channel == "reasoning")
        message: dict[str, Any] = {"role": "assistant", "content": self.message_content(content)}
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
                self.logprobs([logprob_entry(t, plan.top_logprobs) for t in plan.tokens])
                if plan.want_logprobs
                else None
            ),
            "finish_reason": plan.finish_reason,
        }
        self.end_choice(plan, choice)
        body: dict[str, Any] = {
            "id": plan.completion_id,
            "object": "chat.completion",
            "created": plan.created,
            "model": plan.model,
            "system_fingerprint": MOCK_FINGERPRINT,
            "choices": [choice],
            "usage": usage(plan),
        }
        if plan.want_token_ids:
            body["prompt_token_ids"] = plan.prompt_ids
            choice["token_ids"] = [t.id for t in plan.tokens]
        return body

    def group_body(self, plans: list[Plan]) -> dict[str, Any]:
        """One chat.completion with a choice per plan (n > 1), usage summed."""
        body = self.completion_body(plans[0])
        for index, plan in enumerate(plans[1:], start=1):
            choice = self.completion_body(plan)["choices"][0]
            choice["index"] = index
            body["choices"].append(choice)
        completion = sum(len(p.tokens) for p in plans)
        body["usage"]["completion_tokens"] = completion
        body["usage"]["total_tokens"] = body["usage"]["prompt_tokens"] + completion
        return body

    # -- streaming -------------------------------------------------------------------------

    def chunk(self, plan: Plan, choice: dict[str, Any] | None, **extra: Any) -> bytes:
        """One chat.completion.chunk event."""
        body = self._chunk_head(plan, choice)
        # OpenAI: the fingerprint on every chunk, and `usage: null` on each one with usage on.
        body["system_fingerprint"] = MOCK_FINGERPRINT
        if plan.want_usage:
            body["usage"] = None
        body.update(extra)
        return sse(body)

    def _chunk_head(self, plan: Plan, choice: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "id": plan.completion_id,
            "object": "chat.completion.chunk",
            "created": plan.created,
            "model": plan.model,
            "choices": [choice] if choice is not None else [],
        }

    def token_delta(self, plan: Plan, token: Token, first_tool_fragment: bool) -> dict[str, Any]:
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

    def role_choice(self, plan: Plan) -> dict[str, Any]:
        """The first chunk's choice: the assistant role."""
        choice: dict[str, Any] = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        if plan.want_token_ids:
            choice["token_ids"] = []
        return choice

    def token_choice(self, plan: Plan, choice: dict[str, Any], position: int) -> None:
        """Adds what this server puts on the chunk of token `position` (1-based)."""

    def stream_events(self, plan: Plan) -> list[bytes]:
        """Every SSE event of the answer, in order: role, one per token, the end, [DONE]."""
        first_extra: dict[str, Any] = (
            {"prompt_token_ids": plan.prompt_ids} if plan.want_token_ids else {}
        )
        events = [self.chunk(plan, self.role_choice(plan), **first_extra)]
        first_tool = True
        for position, token in enumerate(plan.tokens, start=1):
            choice: dict[str, Any] = {
                "index": 0,
                "delta": self.token_delta(plan, token, first_tool and token.channel == "tool"),
                "logprobs": (
                    self.logprobs([logprob_entry(token, plan.top_logprobs)])
                    if plan.want_logprobs
                    else None
                ),
                "finish_reason": None,
            }
            if token.channel == "tool":
                first_tool = False
            self.token_choice(plan, choice, position)
            if plan.want_token_ids:
                choice["token_ids"] = [token.id]
            events.append(self.chunk(plan, choice))
        return events + self.end_events(plan)

    def end_events(self, plan: Plan) -> list[bytes]:
        """What follows the token chunks: an empty chunk with the finish, usage, [DONE]."""
        final: dict[str, Any] = {
            "index": 0,
            "delta": {},
            "logprobs": None,
            "finish_reason": plan.finish_reason,
        }
        if plan.want_token_ids:
            final["token_ids"] = []
        events = [self.chunk(plan, final)]
        if plan.want_usage:
            events.append(self.chunk(plan, None, usage=usage(plan)))
        events.append(DONE)
        return events

    def group_chunk(self, plans: list[Plan], index: int, chunk: dict[str, Any]) -> None:
        """Adjusts one chunk of choice `index` of an n > 1 stream."""
        if index:
            chunk.pop("prompt_token_ids", None)
        if plans[0].want_usage:
            chunk["usage"] = None

    def group_stream(self, plans: list[Plan]) -> list[bytes]:
        """The SSE events of n > 1 choices, interleaved token by token, one usage chunk, [DONE]."""
        if len(plans) == 1:
            return self.stream_events(plans[0])
        per_choice: list[list[bytes]] = []
        for index, plan in enumerate(plans):
            events = []
            for raw in self.stream_events(dataclasses.replace(plan, want_usage=False))[:-1]:
                chunk = orjson.loads(raw.removeprefix(b"data: "))
                chunk["choices"][0]["index"] = index
                self.group_chunk(plans, index, chunk)
                events.append(sse(chunk))
            per_choice.append(events)
        out = [e for group in itertools.zip_longest(*per_choice) for e in group if e is not None]
        if plans[0].want_usage:
            out.append(self.chunk(plans[0], None, usage=self.group_body(plans)["usage"]))
        out.append(DONE)
        return out
