"""The mock as an aiohttp server: routes, the flavour's wire, the fault hooks, streaming and
what it has seen (`GET /mock/stats`)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from rollgate.mock_llm.faults import Faults
from rollgate.mock_llm.openai_wire import (
    DONE,
    USAGE_CHOICES,
    OpenAIWire,
    openai_error,
    sse,
    usage_variant,
)
from rollgate.mock_llm.plan import BadRequest, Plan, last_user_text, plan_chat
from rollgate.mock_llm.sglang_wire import SglangWire, generate_answer
from rollgate.mock_llm.vllm_wire import VllmWire

log = logging.getLogger("rollgate.mock_llm")

# Flavour name → its wire, in the order `--flavor` lists them.
WIRES: dict[str, type[OpenAIWire]] = {w.flavor: w for w in (VllmWire, SglangWire, OpenAIWire)}
FLAVORS = tuple(WIRES)


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
        if flavor not in WIRES:
            raise ValueError(f"flavor {flavor!r} is not one of {', '.join(FLAVORS)}")
        if usage_choices not in USAGE_CHOICES:
            raise ValueError(f"usage_choices {usage_choices!r} is not one of {USAGE_CHOICES}")
        # The streamed usage chunk's `choices`: [] ("empty"), null ("null"), no key ("absent").
        self.usage_choices = usage_choices
        # vllm: honours return_token_ids; sglang: SGLang's shapes (chat without ids, /generate);
        # openai: a hosted API (refuses return_token_ids like OpenAI does).
        self.flavor = flavor
        self.wire = WIRES[flavor]()
        # True: a request for another model gets the server's 404 "model does not exist".
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

    async def _body(self, request: web.Request) -> Any:
        """The request's JSON (counted), or the error answer to send instead."""
        self.stats.requests += 1
        self.stats.last_headers = dict(request.headers)
        if not self._authorized(request):
            return openai_error(401, "Incorrect API key provided.", code="invalid_api_key")
        try:
            return orjson.loads(await request.read())
        except orjson.JSONDecodeError as err:
            return openai_error(400, f"invalid JSON body: {err}")

    async def _models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return openai_error(401, "Incorrect API key provided.", code="invalid_api_key")
        body = {
            "object": "list",
            "data": [{"id": self.model, "object": "model", "owned_by": "rollgate-mock"}],
        }
        return web.json_response(body, dumps=lambda v: orjson.dumps(v).decode())

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        if not isinstance(body, dict):
            return openai_error(400, "the body must be a JSON object")
        self.stats.last_body = body
        model = str(body.get("model"))
        self.stats.models[model] = self.stats.models.get(model, 0) + 1
        refused = self._refusal(body)
        if refused is not None:
            return refused
        try:
            plans = self._plans(body)
        except BadRequest as err:
            return self.wire.bad_request(str(err))
        plan = plans[0]
        faults = Faults.of(last_user_text(body["messages"]))
        failure = faults.failure()
        if failure is not None:
            status, message, headers = failure
            return openai_error(status, message, **headers)
        if faults.hang:
            return await self._hang(request)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        if not plan.stream:
            return web.Response(
                body=orjson.dumps(self.wire.group_body(plans)), content_type="application/json"
            )
        events = usage_variant(self.wire.group_stream(plans), self.usage_choices)
        return await self._stream(request, plan, events, midstream_failure=faults.fail_midstream)

    def _plans(self, body: dict[str, Any]) -> list[Plan]:
        """One plan per requested choice (`n`), sharing the completion's id and time."""
        n = body.get("n") or 1
        count = n if isinstance(n, int) else 1
        plans = [
            plan_chat(
                body,
                self.model,
                index=i,
                sampling=self.wire.sampling,
                answer_tokens=self.answer_tokens,
            )
            for i in range(count)
        ]
        if not self.wire.token_ids:
            plans = [dataclasses.replace(p, want_token_ids=False) for p in plans]
        return [
            dataclasses.replace(p, completion_id=plans[0].completion_id, created=plans[0].created)
            for p in plans
        ]

    def _refusal(self, body: dict[str, Any]) -> web.Response | None:
        refused = self.wire.refusal(body)
        if refused is not None:
            return refused
        if self.strict_model and body.get("model") != self.model:
            return self.wire.unknown_model(body.get("model"), self.model)
        return None

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        """SGLang's native /generate: input_ids (or text) in, meta_info logprob triples out."""
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        self.stats.last_body = body
        if not isinstance(body, dict) or not self.wire.serves_generate:
            return openai_error(404, "Not Found")
        try:
            answer = generate_answer(body, self.decode)
        except BadRequest as err:
            return openai_error(400, str(err))
        failure = Faults.of(answer.user_text).failure()
        if failure is not None:
            status, message, headers = failure
            return openai_error(status, message, **headers)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        if not body.get("stream"):
            return web.Response(
                body=orjson.dumps(answer.event(len(answer.tokens))),
                content_type="application/json",
            )
        events = [sse(answer.event(i)) for i in range(1, len(answer.tokens) + 1)]
        return await self._stream(request, None, [*events, DONE], midstream_failure=False, first=0)

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
        plan: Plan | None,
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
