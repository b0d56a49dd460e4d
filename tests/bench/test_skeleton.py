"""bench/skeleton.py, the design's hops and nothing else (or, `--record`, with the work no
recording gateway can skip), as the bench starts it: real processes (its gateway, dataproxy and
worker) on a real Redis, in front of the mock upstream; unary and streamed answers come back
whole, each turn ran its two Redis scripts, and a recording skeleton's client sees no ids or
logprobs while its dataproxy got the turn's packed prompt ids."""

from __future__ import annotations

import asyncio
import importlib.util
import struct
import sys
import urllib.request
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson
import pytest
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
    request.add_header("Authorization", "Bearer sk-sess-skeleton")
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        return bytes(response.read())


def _no_ids(choice: dict[str, Any]) -> bool:
    return choice.get("logprobs") is None and "token_ids" not in choice


@pytest.mark.parametrize("recording", [False, True], ids=["bare", "recording"])
async def test_the_skeleton_relays_unary_and_streamed_answers(
    redis_url: str, tmp_path: Path, recording: bool
) -> None:
    run = _load("run")
    store = redis.Redis.from_url(redis_url)
    store.delete("skeleton:count")
    async with MockLLM(port=0, answer_tokens=8) as mock:
        processes, url = run._skeleton(
            mock.base_url.removesuffix("/v1"), redis_url, tmp_path, recording=recording
        )
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
        asked = mock.stats.last_body
    assert "you said skeleton" in unary["choices"][0]["message"]["content"]
    events = [line for line in streamed.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    chunks = [orjson.loads(e[6:]) for e in events[:-1]]
    text = "".join((c["choices"] or [{}])[0].get("delta", {}).get("content") or "" for c in chunks)
    assert "you said skeleton" in text
    # A begin and a record per turn, each one script on the skeleton's dataproxy.
    assert int(store.get("skeleton:count") or 0) == 4
    if not recording:
        return
    # The upstream was asked for what a record needs; the client gets none of it.
    assert asked["logprobs"] is True and asked["return_token_ids"] is True
    assert asked["messages"] == messages
    assert _no_ids(unary["choices"][0]) and "prompt_token_ids" not in unary
    assert all(_no_ids(c) for chunk in chunks for c in chunk["choices"])
    assert not any("prompt_token_ids" in chunk for chunk in chunks)
    # Each record the dataproxy stored (its first 64 bytes) starts with the prompt's ids.
    stored = [store.get(key) for key in store.scan_iter(match="skeleton:[0-9]*")]
    prompts = [struct.unpack(">I", value[:4])[0] for value in stored if value]
    assert sum(1 for n in prompts if 0 < n < 1 << 16) >= 2
