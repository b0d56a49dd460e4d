"""vLLM's wire shapes (the `vllm` flavour), as a real vLLM 0.32 sends them (the captures in the
team's vllm_wire reference): `return_token_ids` honoured, usage only with
`stream_options.include_usage`, `system_fingerprint` only on the usage chunk, `prompt_token_ids`
on every choice's first (role) chunk, `finish_reason` and `stop_reason` on the last token's
chunk (no empty closing chunk), EOS sampled at a natural stop, a named `tool_choice` forcing
that call with finish_reason "stop", content `""` not null, no
`refusal` in logprobs, errors as `{"error": {message, type: NotFoundError | BadRequestError,
param, code: <status>}}`."""

from __future__ import annotations

from typing import Any, ClassVar

import orjson
from aiohttp import web

from rollgate.mock_llm.openai_wire import DONE, MOCK_FINGERPRINT, OpenAIWire, sse, usage
from rollgate.mock_llm.plan import Plan, Sampling


def vllm_error(status: int, message: str, *, param: str | None = None) -> web.Response:
    """vLLM's error shape: the exception's name as `type`, the status as an integer `code`."""
    error_type = {404: "NotFoundError"}.get(status, "BadRequestError")
    body = {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


class VllmWire(OpenAIWire):
    """What a vLLM server sends."""

    flavor: ClassVar[str] = "vllm"
    sampling: ClassVar[Sampling] = Sampling(eos=True, named_tool_choice=True)
    token_ids: ClassVar[bool] = True

    def refusal(self, body: dict[str, Any]) -> web.Response | None:
        """vLLM accepts every field the worker sends."""
        return None

    def bad_request(self, message: str) -> web.Response:
        """vLLM's 400 names the field."""
        return vllm_error(400, message, param="messages")

    def unknown_model(self, model: Any, served: str) -> web.Response:
        """vLLM's 404 lists the served names."""
        message = f"The model `{model}` does not exist. Valid aliases: {served}."
        return vllm_error(404, message, param="model")

    def logprobs(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        """No `refusal` key."""
        return {"content": entries}

    def message_content(self, content: str) -> str | None:
        """`""` where OpenAI answers null (a tool call, EOS only)."""
        return content

    def end_choice(self, plan: Plan, choice: dict[str, Any]) -> None:
        """`stop_reason`: the matched stop string, else null."""
        choice["stop_reason"] = plan.stop_reason

    def chunk(self, plan: Plan, choice: dict[str, Any] | None, **extra: Any) -> bytes:
        """The fingerprint only on the usage chunk; no `usage: null` on the others."""
        body = self._chunk_head(plan, choice)
        if "usage" in extra:
            body["system_fingerprint"] = MOCK_FINGERPRINT
        body.update(extra)
        return sse(body)

    def role_choice(self, plan: Plan) -> dict[str, Any]:
        """No `token_ids` on the role chunk (the prompt ids travel beside it)."""
        return {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def token_choice(self, plan: Plan, choice: dict[str, Any], position: int) -> None:
        """The finish rides on the last token's chunk."""
        if position == len(plan.tokens):
            choice["finish_reason"] = plan.finish_reason
            choice["stop_reason"] = plan.stop_reason

    def end_events(self, plan: Plan) -> list[bytes]:
        """No closing chunk: the usage chunk (when asked for), then [DONE]."""
        if not plan.tokens:
            return super().end_events(plan)
        events = [self.chunk(plan, None, usage=usage(plan))] if plan.want_usage else []
        return [*events, DONE]

    def group_chunk(self, plans: list[Plan], index: int, chunk: dict[str, Any]) -> None:
        """Every choice's role chunk keeps its prompt ids; no `usage: null`."""
