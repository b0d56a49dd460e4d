"""The adapters for SGLang: its OpenAI chat endpoint, or its native `/generate` (exact ids).

`chat` path: SGLang's `/v1/chat/completions`. Its logprobs cover every sampled token
(reasoning and tool markup included, sglang#25055). Token ids are recorded, and the turn is
exact, only when the answer carries them (`prompt_token_ids` / `choices[].token_ids`, the
names vLLM uses); otherwise `exact_tokens = false`.

`generate` path: the worker renders the chat template itself (built-in ChatML), encodes it
with the configured tokenizer.json and POSTs `{"input_ids", "sampling_params",
"return_logprob": true}` to `/generate`. The ids SGLang prefilled are the ones sent, and
`meta_info.output_token_logprobs` (`[[logprob, token_id, text], …]`) gives the sampled ids:
exact. The answer is translated into vLLM-shaped chat chunks, so the client sees ordinary
chat completions (reasoning split at `</think>`, `<tool_call>` blocks parsed into tool calls).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar

import orjson

from chatml.template import parse_output, render_chatml
from chatml.tokenizer import LocalTokenizer
from services.runtime.errors import InvalidRequest
from services.worker.openai_compat import OpenAICompatAdapter, Translator
from services.worker.turn import TurnAccumulator

_THINK_OPEN, _THINK_CLOSE, _TOOL_OPEN = "<think>", "</think>", "<tool_call>"
# Chat fields that map onto SGLang's sampling_params.
_SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "stop": "stop",
    "seed": "sampling_seed",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
}


class SglangChatAdapter(OpenAICompatAdapter):
    """SGLang's OpenAI chat endpoint: exact only when the answer carries token ids."""

    kind: ClassVar[str] = "sglang"
    reads_token_ids: ClassVar[bool] = True

    def read_completion(self, body: dict[str, Any], acc: TurnAccumulator) -> None:
        """Absorbs one completion and any token ids it carries."""
        acc.add_completion(body)
        acc.add_token_ids(body)


def _partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def _visible(raw: str) -> tuple[str, str]:
    """(reasoning, content) of a partial raw output that are safe to show already."""
    reasoning, rest = "", raw
    if raw.startswith(_THINK_OPEN) or _THINK_CLOSE in raw:
        head, closed, rest = raw.partition(_THINK_CLOSE)
        reasoning = head.removeprefix(_THINK_OPEN)
        if not closed:
            reasoning = reasoning[: len(reasoning) - _partial_tag_suffix(reasoning, _THINK_CLOSE)]
            # Trailing whitespace is held back: before `</think>` it is stripped, as the
            # non-streamed answer strips it, so both give the same reasoning.
            return reasoning.lstrip("\n").rstrip(), ""
        reasoning = reasoning.strip()
        rest = rest.lstrip("\n")
    cut = rest.find(_TOOL_OPEN)
    rest = rest[:cut] if cut >= 0 else rest[: len(rest) - _partial_tag_suffix(rest, _TOOL_OPEN)]
    return reasoning.lstrip("\n"), rest


def _logprob_entry(triple: Any) -> tuple[dict[str, Any], int] | None:
    if not isinstance(triple, list | tuple) or len(triple) < 2:
        return None
    logprob, token_id = triple[0], triple[1]
    text = triple[2] if len(triple) > 2 and isinstance(triple[2], str) else ""
    entry = {"token": text, "logprob": float(logprob), "bytes": list(text.encode())}
    entry["top_logprobs"] = []
    return entry, int(token_id)


def _finish_reason(meta: dict[str, Any]) -> str | None:
    reason = meta.get("finish_reason")
    if isinstance(reason, dict):
        kind = reason.get("type")
        return str(kind) if kind else None
    return str(reason) if isinstance(reason, str) else None


class GenerateTranslator:
    """Turns one call's `/generate` answer (streamed or not) into vLLM-shaped chat JSON."""

    def __init__(self, *, prompt_ids: list[int], model: str) -> None:
        self.prompt_ids = prompt_ids
        self.model = model
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self._raw = ""
        self._reasoning_sent = ""
        self._content_sent = ""
        self._entries_seen = 0
        self._started = False

    def _chunk(self, choice: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [choice] if choice is not None else [],
        }
        body.update(extra)
        return body

    def events(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """The chat chunks of one streamed `/generate` event."""
        meta = event.get("meta_info")
        meta = meta if isinstance(meta, dict) else {}
        out: list[dict[str, Any]] = []
        if not self._started:
            self._started = True
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": []}
            out.append(self._chunk(role, prompt_token_ids=self.prompt_ids))
        text = event.get("text")
        if isinstance(text, str):
            # SGLang streams the cumulative text (incremental with --incremental-streaming-output).
            self._raw = text if text.startswith(self._raw) else self._raw + text
        entries, ids = self._new_logprobs(meta)
        reasoning, content = _visible(self._raw)
        delta: dict[str, Any] = {}
        if len(reasoning) > len(self._reasoning_sent):
            delta["reasoning_content"] = reasoning[len(self._reasoning_sent) :]
            self._reasoning_sent = reasoning
        if len(content) > len(self._content_sent):
            delta["content"] = content[len(self._content_sent) :]
            self._content_sent = content
        finish = _finish_reason(meta)
        if delta or entries:
            out.append(
                self._chunk(
                    {
                        "index": 0,
                        "delta": delta,
                        "logprobs": {"content": entries, "refusal": None} if entries else None,
                        "finish_reason": None,
                        "token_ids": ids,
                    }
                )
            )
        if finish is not None:
            out += self._finish(finish, meta)
        return out

    def _new_logprobs(self, meta: dict[str, Any]) -> tuple[list[dict[str, Any]], list[int]]:
        triples = meta.get("output_token_logprobs")
        if not isinstance(triples, list):
            return [], []
        completion = meta.get("completion_tokens")
        cumulative = isinstance(completion, int) and completion == len(triples)
        fresh = triples[self._entries_seen :] if cumulative else triples
        self._entries_seen += len(fresh)
        entries: list[dict[str, Any]] = []
        ids: list[int] = []
        for triple in fresh:
            parsed = _logprob_entry(triple)
            if parsed is not None:
                entries.append(parsed[0])
                ids.append(parsed[1])
        return entries, ids

    def _finish(self, finish: str, meta: dict[str, Any]) -> list[dict[str, Any]]:
        parsed = parse_output(self._raw)
        out: list[dict[str, Any]] = []
        if parsed.tool_calls:
            fragments = [{"index": i, **call} for i, call in enumerate(parsed.tool_calls)]
            delta = {"tool_calls": fragments}
            out.append(self._chunk({"index": 0, "delta": delta, "finish_reason": None}))
            finish = "tool_calls" if finish == "stop" else finish
        elif len(parsed.content) > len(self._content_sent):
            # A held-back partial tag turned out to be plain text.
            rest = parsed.content[len(self._content_sent) :]
            out.append(self._chunk({"index": 0, "delta": {"content": rest}, "finish_reason": None}))
        final = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}
        out.append(self._chunk(final))
        out.append(self._chunk(None, usage=_usage(meta, len(self.prompt_ids))))
        return out

    def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat.completion of one non-streamed `/generate` answer."""
        meta = body.get("meta_info")
        meta = meta if isinstance(meta, dict) else {}
        text = body.get("text")
        parsed = parse_output(text if isinstance(text, str) else "")
        entries, ids = self._new_logprobs({**meta, "completion_tokens": None})
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content or None}
        if parsed.reasoning:
            message["reasoning_content"] = parsed.reasoning
        finish = _finish_reason(meta) or "stop"
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
            finish = "tool_calls" if finish == "stop" else finish
        elif message["content"] is None:
            message["content"] = ""
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "prompt_token_ids": self.prompt_ids,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": {"content": entries, "refusal": None},
                    "finish_reason": finish,
                    "token_ids": ids,
                }
            ],
            "usage": _usage(meta, len(self.prompt_ids)),
        }


def _usage(meta: dict[str, Any], prompt_len: int) -> dict[str, int]:
    prompt = meta.get("prompt_tokens")
    prompt = prompt if isinstance(prompt, int) else prompt_len
    completion = meta.get("completion_tokens")
    completion = completion if isinstance(completion, int) else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


class SglangGenerateAdapter(SglangChatAdapter):
    """SGLang's native `/generate` with `input_ids` from the worker's own template: exact."""

    single_sample: ClassVar[bool] = True

    def __init__(self, tokenizer: LocalTokenizer) -> None:
        self._tokenizer = tokenizer

    def endpoint(self, base_url: str) -> str:
        """The server root's `/generate` (not under /v1)."""
        return base_url.removesuffix("/v1") + "/generate"

    def encode(self, body: dict[str, Any], request_json: bytes) -> bytes:
        """The `/generate` body: input_ids from the chat template, sampling_params, logprobs."""
        recorded = orjson.loads(request_json)
        tools = recorded.get("tools")
        prompt = render_chatml(recorded["messages"], tools if isinstance(tools, list) else None)
        params: dict[str, Any] = {"skip_special_tokens": False}
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if isinstance(limit, int):
            params["max_new_tokens"] = limit
        for name, target in _SAMPLING_FIELDS.items():
            if body.get(name) is not None:
                params[target] = body[name]
        if isinstance(body.get("n"), int) and body["n"] > 1:
            raise InvalidRequest("the sglang generate path asks for one sample per call")
        return orjson.dumps(
            {
                "input_ids": self._tokenizer.encode(prompt),
                "sampling_params": params,
                "return_logprob": True,
                "return_text_in_logprobs": True,
                "logprob_start_len": -1,
                "stream": bool(body.get("stream")),
            }
        )

    def translator(self, upstream_body: bytes, model: str) -> Translator:
        """A translator for this call, knowing the prompt ids it sent."""
        sent = orjson.loads(upstream_body)
        return GenerateTranslator(prompt_ids=list(sent["input_ids"]), model=model)
