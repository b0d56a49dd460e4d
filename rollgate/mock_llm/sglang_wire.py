"""SGLang's wire shapes (the `sglang` flavour): chat completions without token ids (the reasoning
and tool-call markup sampled as tokens, sglang#25055), and the native `/generate` with
`input_ids` and `meta_info.output_token_logprobs` `[[logprob, id, text], …]`."""

from __future__ import annotations

import random
import re
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson
from aiohttp import web

from rollgate.mock_llm.openai_wire import OpenAIWire
from rollgate.mock_llm.plan import (
    EOS_ID,
    REASONING_TEXT,
    BadRequest,
    Sampling,
    echo_of,
    sampled_logprob,
    token_id,
    tokenize,
)

_LAST_USER = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.DOTALL)
_TOOL_NAME = re.compile(r'<tools>.*?"name":\s*"([^"]+)"', re.DOTALL)


class SglangWire(OpenAIWire):
    """SGLang's OpenAI endpoint (token ids ignored, markup in logprobs) and `/generate`."""

    flavor: ClassVar[str] = "sglang"
    sampling: ClassVar[Sampling] = Sampling(raw_markup=True)
    serves_generate: ClassVar[bool] = True

    def refusal(self, body: dict[str, Any]) -> web.Response | None:
        """SGLang ignores `return_token_ids` (and sends no ids)."""
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateAnswer:
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


def generate_answer(
    body: dict[str, Any], decode: Callable[[list[int]], str] | None
) -> GenerateAnswer:
    """The answer to a /generate request (`input_ids` read back with `decode`, or `text`)."""
    input_ids = body.get("input_ids")
    if isinstance(input_ids, list) and input_ids:
        prompt_ids = [int(i) for i in input_ids]
        prompt = decode(prompt_ids) if decode is not None else ""
    elif isinstance(body.get("text"), str):
        prompt = body["text"]
        prompt_ids = [token_id(p) for p in tokenize(prompt)]
    else:
        raise BadRequest("either text or input_ids should be provided")
    users = _LAST_USER.findall(prompt)
    user_text = users[-1] if users else ""
    tool = _TOOL_NAME.search(prompt)
    rng = random.Random(zlib.crc32(orjson.dumps(prompt_ids)))
    echo = echo_of(user_text)
    raw = ""
    if "/think" in user_text:
        raw += f"<think>\n{REASONING_TEXT}\n</think>\n\n"
    if tool is not None and "/tool" in user_text:
        call = orjson.dumps({"name": tool.group(1), "arguments": {"query": echo}}).decode()
        raw += f"<tool_call>\n{call}\n</tool_call>"
    else:
        raw += f"Mock reply {rng.randint(1, 99)}: you said {echo}".rstrip()
    pieces = tokenize(raw)
    finish: dict[str, Any] = {"type": "stop", "matched": EOS_ID}
    params = body.get("sampling_params")
    limit = params.get("max_new_tokens") if isinstance(params, dict) else None
    if isinstance(limit, int) and 0 < limit < len(pieces):
        pieces = pieces[:limit]
        finish = {"type": "length", "length": limit}
    return GenerateAnswer(
        rid=uuid.uuid4().hex,
        prompt_ids=prompt_ids,
        user_text=user_text,
        tokens=[(p, sampled_logprob(rng)) for p in pieces],
        finish=finish,
        with_text=bool(body.get("return_text_in_logprobs")),
    )
