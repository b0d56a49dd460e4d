"""Runs turns against the upstream: streaming (chunks as they arrive, then the record) or not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import orjson

from services.runtime.errors import UpstreamError
from services.runtime.logs import get_logger
from services.worker.adapters import UpstreamAdapter
from services.worker.turn import (
    TurnAccumulator,
    TurnResult,
    TurnTiming,
    client_chunk,
    client_completion,
)
from services.worker.upstream import (
    DONE,
    UpstreamClient,
    build_upstream_request,
    parse_client_body,
)

log = get_logger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class CompletedTurn:
    """A non-streaming turn: the body for the client and the record."""

    body_json: bytes
    record: TurnResult


def _parse_chunk(payload: bytes) -> dict[str, Any]:
    try:
        chunk = orjson.loads(payload)
    except orjson.JSONDecodeError:
        raise UpstreamError("the upstream streamed a chunk that is not JSON") from None
    if not isinstance(chunk, dict):
        raise UpstreamError("the upstream streamed a chunk that is not a JSON object")
    if isinstance(chunk.get("error"), dict):
        # vLLM reports errors raised after the stream started as one `data: {"error": ...}` event.
        raise UpstreamError(f"the upstream failed mid-stream: {chunk['error'].get('message', '')}")
    return chunk


class _Clock:
    """Wall and monotonic start of one upstream call, and its first token."""

    def __init__(self) -> None:
        self.started_at_unix_s = time.time()
        self.started = time.perf_counter()
        self.first_token: float | None = None

    def mark_first_token(self) -> None:
        if self.first_token is None:
            self.first_token = time.perf_counter()

    def timing(self) -> TurnTiming:
        now = time.perf_counter()
        first = self.first_token if self.first_token is not None else now
        return TurnTiming(
            started_at_unix_s=self.started_at_unix_s,
            latency_s=now - self.started,
            ttft_s=first - self.started,
        )


class TurnRunner:
    """Calls the upstream for one turn at a time per call, and counts the turns in flight."""

    def __init__(self, *, upstream: UpstreamClient, adapter: UpstreamAdapter) -> None:
        self._upstream = upstream
        self._adapter = adapter
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        """Turns running now (reported on heartbeats)."""
        return self._in_flight

    async def stream(
        self, body_json: bytes, *, budget_s: float
    ) -> AsyncGenerator[list[bytes] | TurnResult, None]:
        """Batches of client chunks as they arrive, then the turn's record; raises RollgateError."""
        request = build_upstream_request(
            parse_client_body(body_json), stream=True, prepare=self._adapter.prepare
        )
        deadline = asyncio.get_running_loop().time() + budget_s
        acc = TurnAccumulator()
        clock = _Clock()
        done = False
        self._in_flight += 1
        try:
            async with self._upstream.post_chat(request.body, deadline=deadline) as response:
                async for payloads in self._upstream.read_events(response, deadline=deadline):
                    batch: list[bytes] = []
                    for payload in payloads:
                        if payload == DONE:
                            done = True
                            break
                        chunk = _parse_chunk(payload)
                        self._adapter.read_chunk(chunk, acc)
                        if acc.output_seen:
                            clock.mark_first_token()
                        view = client_chunk(chunk, request.ask)
                        if view is not None:
                            batch.append(orjson.dumps(view))
                    if batch:
                        yield batch
                    if done:
                        break
            if not done and not acc.finish_reason:
                raise UpstreamError(
                    "the upstream ended its stream before the answer was complete",
                    code="upstream_broken_stream",
                )
            yield acc.result(
                kind=self._adapter.kind, request_json=request.request_json, timing=clock.timing()
            )
        finally:
            self._in_flight -= 1

    async def complete(self, body_json: bytes, *, budget_s: float) -> CompletedTurn:
        """One non-streaming upstream call: the client's body and the record."""
        request = build_upstream_request(
            parse_client_body(body_json), stream=False, prepare=self._adapter.prepare
        )
        deadline = asyncio.get_running_loop().time() + budget_s
        acc = TurnAccumulator()
        clock = _Clock()
        self._in_flight += 1
        try:
            async with self._upstream.post_chat(request.body, deadline=deadline) as response:
                body = await self._upstream.read_json(response, deadline=deadline)
            if not isinstance(body, dict):
                raise UpstreamError("the upstream answered with JSON that is not an object")
            self._adapter.read_completion(body, acc)
            clock.mark_first_token()
            record = acc.result(
                kind=self._adapter.kind, request_json=request.request_json, timing=clock.timing()
            )
            return CompletedTurn(
                body_json=orjson.dumps(client_completion(body, request.ask)), record=record
            )
        finally:
            self._in_flight -= 1
