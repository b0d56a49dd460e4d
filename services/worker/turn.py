"""One turn's record, accumulated from upstream chunks or a completion, and the client's view.

Pure: no I/O. The adapters (`openai_compat.py`, `vllm.py`) feed a `TurnAccumulator`; the
functions at the bottom shape what the client gets back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(slots=True, kw_only=True)  # not frozen: built every turn (half the cost)
class ClientAsk:
    """What the client asked to see, read from its body before the worker rewrites it."""

    logprobs: bool
    token_ids: bool
    usage: bool
    # Group sampling: the upstream returns G choices, the client gets choice 0 only.
    only_choice_zero: bool = False

    @classmethod
    def of(cls, body: dict[str, Any]) -> ClientAsk:
        """Reads `logprobs`, `return_token_ids` and `stream_options.include_usage`."""
        options = body.get("stream_options")
        return cls(
            logprobs=bool(body.get("logprobs")),
            token_ids=bool(body.get("return_token_ids")),
            usage=isinstance(options, dict) and bool(options.get("include_usage")),
        )


@dataclass(slots=True, kw_only=True)  # not frozen: built every turn (half the cost)
class TurnTiming:
    """When the upstream call ran."""

    started_at_unix_s: float
    latency_s: float
    ttft_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnSample:
    """One more sample of the same call (group sampling, n > 1); fields of `TurnSample`."""

    finish_reason: str
    output_token_ids: list[int]
    output_logprobs: list[float]
    exact_tokens: bool
    length_mismatch: bool
    assistant_message_json: bytes


@dataclass(slots=True, kw_only=True)  # not frozen: built every turn (half the cost)
class TurnResult:
    """What one LLM call produced; the fields of the `TurnRecord` message, by name."""

    interaction_id: str
    upstream_model: str
    finish_reason: str
    # A list from the JSON, or an int32 array read through the prompt cache (turns.py).
    prompt_token_ids: Sequence[int]
    output_token_ids: list[int]
    output_logprobs: list[float]
    exact_tokens: bool
    assistant_message_json: bytes
    usage_json: bytes
    latency_s: float
    ttft_s: float
    upstream_kind: str
    length_mismatch: bool
    started_at_unix_s: float
    # Samples 1..G-1 of a group-sampled call (empty unless n_samples > 1).
    extra_samples: tuple[TurnSample, ...] = ()

    def sample(self) -> TurnSample:
        """This record's own sample (sample 0) in the shape of the extra ones."""
        return TurnSample(
            finish_reason=self.finish_reason,
            output_token_ids=self.output_token_ids,
            output_logprobs=self.output_logprobs,
            exact_tokens=self.exact_tokens,
            length_mismatch=self.length_mismatch,
            assistant_message_json=self.assistant_message_json,
        )


def choice_zero(body: dict[str, Any]) -> dict[str, Any] | None:
    """The choice with index 0 (only choice 0 is recorded), or None."""
    choices = body.get("choices")
    if type(choices) is not list:
        return None
    if len(choices) == 1:  # every chunk of a single-sample call: no loop
        choice = choices[0]
        if type(choice) is dict and choice.get("index", 0) == 0:
            return choice
        return None
    for choice in choices:
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            return choice
    return None


def _logprob_entries(logprobs: Any) -> list[dict[str, Any]]:
    if not isinstance(logprobs, dict):
        return []
    content = logprobs.get("content")
    if not isinstance(content, list):
        return []
    return [e for e in content if isinstance(e, dict) and "logprob" in e]


def _entry_bytes(entry: dict[str, Any]) -> bytes:
    raw = entry.get("bytes")
    if isinstance(raw, list):
        try:
            return bytes(raw)
        except (TypeError, ValueError):  # not all ints in 0-255: each taken modulo 256
            return bytes(int(b) & 0xFF for b in raw)
    token = entry.get("token")
    return token.encode() if isinstance(token, str) else b""


def _int_list(value: Any) -> list[int] | None:
    # orjson gives ints; the servicer packs them as int32 and refuses anything else there
    # (converting 12k prompt ids one by one here cost ~0.4 ms a turn).
    return value if isinstance(value, list) else None


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallFragment:
    """What a batch added to one tool call (id and name once, with its first fragment)."""

    index: int
    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True, kw_only=True)
class AnswerDelta:
    """What a batch of chunks added to the answer: text, reasoning, tool-call fragments."""

    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCallFragment, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


# Where an accumulator stood: content parts, reasoning parts, each tool call's arguments.
Mark = tuple[int, int, dict[int, int]]


class TurnAccumulator:
    """Collects one turn from a stream of chunks or from one completion body."""

    def __init__(self) -> None:
        self.interaction_id = ""
        self.model = ""
        self.finish_reason = ""
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.message: dict[str, Any] | None = None
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.logprobs: list[float] = []
        # Each sampled token's logprob entry (its bytes are read only to re-tokenize).
        self._sampled: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        # None: the upstream gave no ids (not the same as an empty output).
        self.prompt_token_ids: Sequence[int] | None = None
        self.output_token_ids: list[int] | None = None
        # True once a chunk carried generated output (for time to first token).
        self.output_seen = False

    def _read_header(self, body: dict[str, Any]) -> None:
        if not self.interaction_id and isinstance(body.get("id"), str):
            self.interaction_id = body["id"]
        if not self.model and isinstance(body.get("model"), str):
            self.model = body["model"]
        usage = body.get("usage")
        if isinstance(usage, dict):
            self.usage = usage

    def add_chunk(self, chunk: dict[str, Any], *, token_ids: bool = False) -> None:
        """Absorbs one `chat.completion.chunk` (the standard OpenAI fields of choice 0), and
        with `token_ids` the ids it carries (`add_token_ids`, without a second lookup).

        Runs once per streamed chunk, usually alone on a wake-up of the loop (one token per
        read), where every call costs: the common chunk — one choice, a content delta, one
        logprob entry, its ids — takes no call beyond the lookups (the same reads as
        `_read_header`, `_add_token_ids`, `_add_delta_rest` and `_add_logprobs`)."""
        if self.interaction_id and self.model:
            usage = chunk.get("usage")
            if isinstance(usage, dict):
                self.usage = usage
        else:
            self._read_header(chunk)
        choice = choice_zero(chunk)
        if token_ids:
            if self.prompt_token_ids is None:
                self._add_token_ids(chunk, choice)
            elif choice is not None:
                output = choice.get("token_ids")
                if isinstance(output, list):
                    if self.output_token_ids is None:
                        self.output_token_ids = []
                    self.output_token_ids.extend(output)
                    if output:
                        self.output_seen = True
        if choice is None:
            return
        delta = choice.get("delta")
        if isinstance(delta, dict):
            content = delta.get("content")
            if isinstance(content, str) and content:
                self.content.append(content)
                self.output_seen = True
            if (
                "reasoning_content" in delta
                or "reasoning" in delta
                or delta.get("tool_calls") is not None
            ):
                self._add_delta_rest(delta)
        logprobs = choice.get("logprobs")
        if logprobs is not None:
            entries = logprobs.get("content") if isinstance(logprobs, dict) else None
            if isinstance(entries, list):
                for entry in entries:
                    if isinstance(entry, dict) and "logprob" in entry:
                        self.logprobs.append(float(entry["logprob"]))
                        self._sampled.append(entry)
                        self.output_seen = True
        finish_reason = choice.get("finish_reason")
        if isinstance(finish_reason, str):
            self.finish_reason = finish_reason

    def take_common(self, chunk: dict[str, Any], ask: ClientAsk, *, token_ids: bool) -> bool:
        """`add_chunk` and `client_chunk` in one pass, for the chunk nearly every streamed
        token is: one choice (index 0) whose delta holds no reasoning and no tool calls, after
        the first chunk (its id, model and prompt ids read). Absorbs it and strips it for the
        client in place, as those two would; False, having changed nothing, for any other chunk
        (read it the general way). Per chunk this is most of the worker's Python: the general
        way looks the choice up four times and walks it in five calls."""
        if not self.model or not self.interaction_id:
            return False
        if token_ids and self.prompt_token_ids is None:
            return False
        choices = chunk.get("choices")
        if type(choices) is not list or len(choices) != 1:
            return False
        choice = choices[0]
        if type(choice) is not dict or choice.get("index", 0) != 0:
            return False
        delta = choice.get("delta")
        if type(delta) is dict:
            if "reasoning_content" in delta or "reasoning" in delta or "tool_calls" in delta:
                return False
            content = delta.get("content")
            if type(content) is str and content:
                self.content.append(content)
                self.output_seen = True
        elif delta is not None:
            return False
        usage = chunk.get("usage")
        if type(usage) is dict:
            self.usage = usage
        if token_ids:
            output = choice.get("token_ids")
            if type(output) is list:
                if self.output_token_ids is None:
                    self.output_token_ids = []
                if output:
                    self.output_token_ids.extend(output)
                    self.output_seen = True
        logprobs = choice.get("logprobs")
        if logprobs is not None:
            entries = logprobs.get("content") if type(logprobs) is dict else None
            if type(entries) is list:
                for entry in entries:
                    if type(entry) is dict and "logprob" in entry:
                        self.logprobs.append(float(entry["logprob"]))
                        self._sampled.append(entry)
                        self.output_seen = True
            if not ask.logprobs:
                choice["logprobs"] = None
        finish_reason = choice.get("finish_reason")
        if type(finish_reason) is str:
            self.finish_reason = finish_reason
        if not ask.token_ids:
            chunk.pop("prompt_token_ids", None)
            chunk.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
            choice.pop("token_ids", None)
        return True

    def _add_delta_rest(self, delta: dict[str, Any]) -> None:
        """A delta's reasoning and tool-call fragments (its content is taken already)."""
        reasoning = delta.get("reasoning_content")
        if not isinstance(reasoning, str):
            reasoning = delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            self.reasoning.append(reasoning)
            self.output_seen = True
        fragments = delta.get("tool_calls")
        if isinstance(fragments, list):
            for fragment in fragments:
                if isinstance(fragment, dict):
                    self._add_tool_fragment(fragment)

    def _add_tool_fragment(self, fragment: dict[str, Any]) -> None:
        self.output_seen = True
        index = fragment.get("index", 0)
        call = self.tool_calls.setdefault(
            int(index) if isinstance(index, int) else 0,
            {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
        )
        if fragment.get("id") and not call["id"]:
            call["id"] = fragment["id"]
        if fragment.get("type"):
            call["type"] = fragment["type"]
        function = fragment.get("function")
        if isinstance(function, dict):
            if function.get("name") and not call["function"]["name"]:
                call["function"]["name"] = function["name"]
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                call["function"]["arguments"] += arguments

    def mark(self) -> Mark:
        """Where the answer stands now (for `delta_since`)."""
        return (
            len(self.content),
            len(self.reasoning),
            {i: len(c["function"]["arguments"]) for i, c in self.tool_calls.items()},
        )

    def delta_since(self, mark: Mark) -> AnswerDelta:
        """What the answer gained since `mark`."""
        content, reasoning, calls = mark
        fragments = []
        for index, call in sorted(self.tool_calls.items()):
            arguments = call["function"]["arguments"]
            seen = calls.get(index)
            if seen is not None and seen == len(arguments):
                continue
            fragments.append(
                ToolCallFragment(
                    index=index,
                    call_id=call["id"] if seen is None else "",
                    name=call["function"]["name"] if seen is None else "",
                    arguments=arguments[seen or 0 :],
                )
            )
        return AnswerDelta(
            content="".join(self.content[content:]),
            reasoning="".join(self.reasoning[reasoning:]),
            tool_calls=tuple(fragments),
        )

    def add_completion(self, body: dict[str, Any]) -> None:
        """Absorbs one non-streaming `chat.completion` body."""
        self._read_header(body)
        choice = choice_zero(body)
        if choice is None:
            return
        message = choice.get("message")
        if isinstance(message, dict):
            self.message = message
        self._add_logprobs(choice.get("logprobs"))
        if isinstance(choice.get("finish_reason"), str):
            self.finish_reason = choice["finish_reason"]

    def _add_logprobs(self, logprobs: Any) -> bool:
        if logprobs is None:
            return False
        entries = _logprob_entries(logprobs)
        self.logprobs += [float(entry["logprob"]) for entry in entries]
        self._sampled += entries
        return bool(entries)

    @property
    def sampled_bytes(self) -> list[bytes]:
        """The bytes of each sampled token as the logprobs name them (for re-tokenizing)."""
        return [_entry_bytes(entry) for entry in self._sampled]

    def sampled_text(self) -> str:
        """The sampled output as text: the logprobs' token bytes, else reasoning + content."""
        if self._sampled:
            return b"".join(self.sampled_bytes).decode(errors="replace")
        message = self.assistant_message()
        return str(message.get("reasoning_content") or "") + str(message.get("content") or "")

    def add_token_ids(self, body: dict[str, Any]) -> None:
        """Absorbs vLLM's `prompt_token_ids` (top level or choice) and `choices[0].token_ids`."""
        self._add_token_ids(body, choice_zero(body))

    def _add_token_ids(self, body: dict[str, Any], choice: dict[str, Any] | None) -> None:
        if self.prompt_token_ids is None:
            prompt = _int_list(body.get("prompt_token_ids"))
            if prompt is None and choice is not None:
                prompt = _int_list(choice.get("prompt_token_ids"))
            self.prompt_token_ids = prompt
        output = _int_list(choice.get("token_ids")) if choice is not None else None
        if output is not None:
            if self.output_token_ids is None:
                self.output_token_ids = []
            self.output_token_ids.extend(output)
            if output:
                self.output_seen = True

    def assistant_message(self) -> dict[str, Any]:
        """The assistant message: {role, content, reasoning_content?, tool_calls?}."""
        if self.message is not None:
            return _normalized_message(self.message)
        tool_calls = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        content = "".join(self.content)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None if not content and tool_calls else content,
        }
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if tool_calls:
            message["tool_calls"] = tool_calls
        return message

    def result(self, *, kind: str, timing: TurnTiming) -> TurnResult:
        """The turn's record. Lengths are never padded or truncated: a mismatch is flagged."""
        output_ids = self.output_token_ids
        exact = output_ids is not None
        return TurnResult(
            interaction_id=self.interaction_id,
            upstream_model=self.model,
            finish_reason=self.finish_reason,
            prompt_token_ids=self.prompt_token_ids or [],
            output_token_ids=output_ids or [],
            output_logprobs=self.logprobs,
            exact_tokens=exact,
            assistant_message_json=orjson.dumps(self.assistant_message()),
            usage_json=orjson.dumps(self.usage or {}),
            latency_s=timing.latency_s,
            ttft_s=timing.ttft_s,
            upstream_kind=kind,
            length_mismatch=exact and len(self.logprobs) != len(output_ids or []),
            started_at_unix_s=timing.started_at_unix_s,
        )


def _normalized_message(message: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        out["reasoning_content"] = reasoning
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    return out


def _strip_choices(body: dict[str, Any], ask: ClientAsk) -> None:
    token_ids, logprobs = ask.token_ids, ask.logprobs
    if not token_ids:
        body.pop("prompt_token_ids", None)
        body.pop("token_ids", None)
    choices = body.get("choices")
    if not isinstance(choices, list):
        return
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        # The wire shape of a choice whose logprobs were not requested is `"logprobs": null`.
        if not logprobs and choice.get("logprobs") is not None:
            choice["logprobs"] = None
        if not token_ids:
            choice.pop("prompt_token_ids", None)
            choice.pop("token_ids", None)


def _keep_choice_zero(body: dict[str, Any]) -> bool:
    """Drops choices other than 0; False when the body only carried other choices."""
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices:
        return True
    body["choices"] = [c for c in choices if isinstance(c, dict) and c.get("index", 0) == 0]
    return bool(body["choices"])


def client_chunk(chunk: dict[str, Any], ask: ClientAsk) -> dict[str, Any] | None:
    """The chunk as the client should see it (modified in place), or None to drop it."""
    if not chunk.get("choices") and chunk.get("usage") is not None and not ask.usage:
        return None
    if ask.only_choice_zero and not _keep_choice_zero(chunk):
        return None
    _strip_choices(chunk, ask)
    return chunk


def client_completion(body: dict[str, Any], ask: ClientAsk) -> dict[str, Any]:
    """The completion body as the client should see it (modified in place)."""
    if ask.only_choice_zero:
        _keep_choice_zero(body)
    _strip_choices(body, ask)
    return body


def split_choices(body: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """One body per choice index, each carrying that choice as index 0 (for group sampling).

    A body without choices (the usage chunk) goes to index 0.
    """
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices:
        return {0: body}
    out: dict[int, dict[str, Any]] = {}
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        index = choice.get("index", 0)
        index = index if isinstance(index, int) else 0
        out[index] = {**body, "choices": [{**choice, "index": 0}]}
    return out
