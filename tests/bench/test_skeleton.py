"""bench/skeleton.py, the design's hops and nothing else, as the bench starts it: real
processes (its gateway, dataproxy and worker) on a real Redis, in front of the mock upstream;
unary and streamed answers come back whole and each turn ran its two Redis scripts."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import urllib.request
from pathlib import Path
from types import ModuleType

import orjson
import redis

from rollgate.mock_llm import MockLLM

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str) -> ModuleType:
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their class's module up
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def _post(url: str, body: dict[str, object]) -> bytes:
    request = urllib.request.Request(url, data=orjson.dumps(body), method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        return bytes(response.read())


async def test_the_skeleton_relays_unary_and_streamed_answers(
    redis_url: str, tmp_path: Path
) -> None:
    run = _load("run")
    counter = redis.Redis.from_url(redis_url)
    counter.delete("skeleton:count")
    async with MockLLM(port=0, answer_tokens=8) as mock:
        processes, url = run._skeleton(mock.base_url.removesuffix("/v1"), redis_url, tmp_path)
        try:
            chat = f"{url}/v1/chat/completions"
            messages = [{"role": "user", "content": "skeleton"}]
            model = "rollgate-mock"
            # In a thread: the mock answers on this test's loop.
            unary = orjson.loads(
                await asyncio.to_thread(_post, chat, {"model": model, "messages": messages})
            )
            streamed = await asyncio.to_thread(
                _post, chat, {"model": model, "messages": messages, "stream": True}
            )
        finally:
            for process in processes.values():
                process.terminate()
                process.wait(timeout=15)
    assert "you said skeleton" in unary["choices"][0]["message"]["content"]
    events = [line for line in streamed.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    text = "".join(
        (orjson.loads(e[6:])["choices"] or [{}])[0].get("delta", {}).get("content") or ""
        for e in events[:-1]
    )
    assert "you said skeleton" in text
    # A begin and a record per turn, each one script on the skeleton's dataproxy.
    assert int(counter.get("skeleton:count") or 0) == 4
