"""The bench's floor relays the request body and the response bytes unchanged."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import aiohttp
import orjson
from aiohttp import web

from rollgate.mock_llm import MockLLM

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_the_floor_forwards_the_body_and_relays_the_stream_unchanged() -> None:
    floor, openclaw = _load("floor"), _load("openclaw")
    body = openclaw.body("rollgate-mock")
    raw = orjson.dumps(body)
    assert 55_000 < len(raw) < 65_000 and len(body["tools"]) == 12
    async with MockLLM(port=0, answer_tokens=64) as mock:
        runner = web.AppRunner(floor.app(f"http://127.0.0.1:{mock.port}"))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with aiohttp.ClientSession() as session:
                answers = []
                for base in (mock.base_url, f"http://127.0.0.1:{port}/v1"):
                    async with session.post(f"{base}/chat/completions", data=raw) as resp:
                        assert resp.status == 200
                        assert resp.headers["Content-Type"].startswith("text/event-stream")
                        answers.append(await resp.read())
                    assert mock.stats.last_body == body
        finally:
            await runner.cleanup()
    direct, relayed = (a.split(b"\n\n") for a in answers)
    # role, 64 tokens (the last is EOS and carries the finish, as vLLM sends it), usage,
    # [DONE], ""
    assert len(direct) == len(relayed) == 64 + 4
    assert relayed[-2] == b"data: [DONE]"
    texts = [
        "".join(
            (orjson.loads(e[6:])["choices"] or [{}])[0].get("delta", {}).get("content") or ""
            for e in events
            if e.startswith(b"data: {")
        )
        for events in (direct, relayed)
    ]
    assert texts[0] == texts[1] and len(texts[0].split()) >= 60
