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
stop string's token likewise, a `tool_choice` naming one of the request's functions forcing a
call of it that ends with `finish_reason: "stop"` (not `tool_calls`), errors as `{"error": {message, type: NotFoundError |
BadRequestError, param, code: <status>}}`. `stop` is honoured by every flavor.

Deterministic: a word-level tokenizer with ids from a stable hash, a simple chat template,
seeded logprobs. The last user message can force behaviours for tests: `/tool` (a tool call
when the request has tools), `/fail-<status>`, `/hang`, `/fail-midstream`, and (vllm flavor)
`/utf8-fragment`: a lone UTF-8 fragment token as vLLM sends it (`token: ""`, `bytes: []`,
empty delta; the next chunk's content starts with U+FFFD, which no logprob token carries).

Modules: `plan.py` (what a request answers: tokens, ids, logprobs, stops), one wire per
flavour (`openai_wire.py`, `vllm_wire.py`, `sglang_wire.py`: the JSON and SSE shapes),
`faults.py` (what a message can force), `server.py` (the aiohttp server), `cli.py`.
"""

from rollgate.mock_llm.faults import FRAGMENT_ID
from rollgate.mock_llm.openai_wire import MOCK_FINGERPRINT, USAGE_CHOICES
from rollgate.mock_llm.plan import EOS_ID, EOS_PIECE, render_prompt, token_id, tokenize
from rollgate.mock_llm.server import FLAVORS, MockLLM, MockStats

__all__ = [
    "EOS_ID",
    "EOS_PIECE",
    "FLAVORS",
    "FRAGMENT_ID",
    "MOCK_FINGERPRINT",
    "USAGE_CHOICES",
    "MockLLM",
    "MockStats",
    "render_prompt",
    "token_id",
    "tokenize",
]
