"""A streamed answer that stalls: the turn fails as timed out at its deadline (one timer per
answer closes the upstream response), and an answer that keeps coming in time is unaffected."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import orjson
import pytest
from aiohttp import web

from services.runtime.errors import UpstreamTimeout
from services.runtime.secret import Secret
from services.worker.upstream import UpstreamClient


def _chunk(text: str) -> bytes:
    body = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return b"data: " + orjson.dumps(body) + b"\n\n"


@contextlib.asynccontextmanager
async def _upstream(
    stall_after: int, interval_s: float
) -> AsyncIterator[tuple[str, asyncio.Event]]:
    """An SSE upstream that sends `stall_after` chunks `interval_s` apart, then stalls until
    its client goes away (the returned event is set then)."""
    gone = asyncio.Event()

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for i in range(stall_after):
                await response.write(_chunk(f"t{i} "))
                await asyncio.sleep(interval_s)  # the upstream's pace between tokens
            await asyncio.Event().wait()  # stalled until the client goes away
        finally:
            gone.set()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, handler_cancellation=True)  # a client gone cancels it
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}/v1", gone
    finally:
        await runner.cleanup()


async def _read(client: UpstreamClient, base: str, budget_s: float, into: list[bytes]) -> None:
    # The turn's budget, as the worker gives it (not a wait of the test's own).
    budget_ends = asyncio.get_running_loop().time() + budget_s
    url = base + "/chat/completions"
    async with client.post_chat(b'{"stream":true}', deadline=budget_ends, url=url) as response:
        async for batch in client.read_events(response, deadline=budget_ends):
            into += batch


# Both of the worker's clients: its own HTTP/1.1 client (the request's timer), and aiohttp's,
# which a base URL with credentials in it takes (read_events' timer).
@pytest.mark.parametrize("userinfo", ["", "user:pw@"], ids=["http1", "aiohttp"])
async def test_a_stream_that_stalls_fails_as_timed_out_at_its_deadline(userinfo: str) -> None:
    async with _upstream(stall_after=3, interval_s=0.01) as (plain, gone):
        base = plain.replace("http://", "http://" + userinfo)
        async with UpstreamClient(base_url=base, api_key=Secret("")) as client:
            payloads: list[bytes] = []
            started = time.monotonic()
            with pytest.raises(UpstreamTimeout) as caught:
                await _read(client, base, 0.6, payloads)
            waited = time.monotonic() - started
            # The upstream saw its client go (the generation would stop there).
            async with asyncio.timeout(5):
                await gone.wait()
    assert caught.value.http_status == 504
    assert "did not finish its answer in time" in caught.value.message
    assert len(payloads) == 3
    assert 0.5 < waited < 5.0


async def test_an_answer_that_keeps_coming_is_read_whole_until_it_stalls() -> None:
    async with (
        _upstream(stall_after=40, interval_s=0.005) as (base, _),
        UpstreamClient(base_url=base, api_key=Secret("")) as client,
    ):
        payloads: list[bytes] = []
        with pytest.raises(UpstreamTimeout):
            await _read(client, base, 2.0, payloads)
    texts = [orjson.loads(p)["choices"][0]["delta"]["content"] for p in payloads]
    assert texts == [f"t{i} " for i in range(40)]
