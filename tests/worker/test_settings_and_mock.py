"""Worker settings from the environment, and the mock LLM as the real OpenAI SDK sees it."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from rollgate.mock_llm import MockLLM, render_prompt, token_id, tokenize
from rollgate.mock_llm.plan import prompt_token_ids
from services.worker.settings import WorkerSettings

BASE = {"ROLLGATE_UPSTREAM_BASE_URL": "http://127.0.0.1:8000"}


def test_settings_read_the_documented_environment() -> None:
    settings = WorkerSettings.from_env(
        {
            **BASE,
            "ROLLGATE_ROUTER_ADDR": "r:1",
            "ROLLGATE_WORKER_ID": "w1",
            "ROLLGATE_WORKER_ADVERTISE": "w1.local:50061",
            "ROLLGATE_UPSTREAM_API_KEY": "sk-secret",
            "ROLLGATE_UPSTREAM_KIND": "vllm",
            "ROLLGATE_UPSTREAM_MODELS": "a, b,",
            "ROLLGATE_UPSTREAM_TIMEOUT_S": "30",
        },
        port=0,
    )
    assert settings.upstream_base_url == "http://127.0.0.1:8000/v1"
    assert (settings.router_addr, settings.worker_id, settings.advertise) == (
        "r:1",
        "w1",
        "w1.local:50061",
    )
    assert settings.upstream_models == ("a", "b")
    assert settings.upstream_timeout_s == 30.0
    assert settings.port == 0
    assert "sk-secret" not in repr(settings)


def test_settings_defaults() -> None:
    settings = WorkerSettings.from_env(BASE)
    assert settings.port == 50061
    assert settings.upstream_kind == "openai"
    assert settings.upstream_models == ()
    assert settings.worker_id.startswith("worker-")


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({}, "ROLLGATE_UPSTREAM_BASE_URL is not set"),
        (
            {**BASE, "ROLLGATE_UPSTREAM_KIND": "sglang", "ROLLGATE_SGLANG_PATH": "generate"},
            "needs ROLLGATE_UPSTREAM_TOKENIZER",
        ),
        ({**BASE, "ROLLGATE_UPSTREAM_API_KEY_VAR": "TAOTOKEN_API_KEY"}, "export TAOTOKEN"),
        ({**BASE, "ROLLGATE_UPSTREAM_ALIASES": "qwen"}, "alias=served"),
        ({**BASE, "ROLLGATE_N_SAMPLES": "0"}, "positive integer"),
        ({**BASE, "ROLLGATE_UPSTREAM_KIND": "tgi"}, "not one of"),
    ],
)
def test_bad_settings_say_what_to_fix(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorkerSettings.from_env(environ)


def test_mock_tokenizer_is_deterministic_and_lossless() -> None:
    text = "Hello  there,\nfriend"
    assert "".join(tokenize(text)) == text
    assert [token_id(p) for p in tokenize(text)] == [token_id(p) for p in tokenize(text)]
    assert all(100 <= token_id(p) < 50_100 for p in tokenize(text))


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "hi"}],
        [
            {"role": "system", "content": "  lead and trail  \n"},
            {"role": "user", "content": ""},
            {"role": "assistant", "content": [{"type": "text", "text": "a\tb"}, "x"]},
            "not a message",
            {"role": "tool", "content": None},
            {"content": "no role\n\n"},
        ],
        [],
    ],
)
def test_the_mocks_cached_prompt_ids_are_the_whole_prompts(messages: list[Any]) -> None:
    expected = [token_id(p) for p in tokenize(render_prompt(messages))]
    assert prompt_token_ids(messages) == expected
    assert prompt_token_ids(messages) == expected  # and again, from the cache


async def test_the_openai_sdk_streams_from_the_mock() -> None:
    async with MockLLM(port=0) as mock:
        client = openai.AsyncOpenAI(base_url=mock.base_url, api_key="unused")
        stream = await client.chat.completions.create(
            model="rollgate-mock",
            messages=[{"role": "user", "content": "hi there"}],
            stream=True,
            logprobs=True,
            stream_options={"include_usage": True},
        )
        text, logprobs, usage = "", 0, None
        async for event in stream:
            if event.choices:
                text += event.choices[0].delta.content or ""
                if event.choices[0].logprobs and event.choices[0].logprobs.content:
                    logprobs += len(event.choices[0].logprobs.content)
            if event.usage:
                usage = event.usage
        await client.close()
    assert text.startswith("Mock reply") and text.endswith("you said hi there")
    assert usage is not None and usage.completion_tokens == logprobs > 0


async def test_the_openai_sdk_gets_a_401_from_a_keyed_mock() -> None:
    async with MockLLM(port=0, api_key="right") as mock:
        client = openai.AsyncOpenAI(base_url=mock.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(
                model="rollgate-mock", messages=[{"role": "user", "content": "hi"}]
            )
        await client.close()
        keyed = openai.AsyncOpenAI(base_url=mock.base_url, api_key="right")
        models = await keyed.models.list()
        await keyed.close()
    assert [m.id for m in models.data] == ["rollgate-mock"]
    assert mock.stats.requests == 1


@pytest.mark.parametrize("answer_tokens", [3, 256])
async def test_answer_tokens_sizes_every_text_answer_streamed_or_not(answer_tokens: int) -> None:
    async with MockLLM(port=0, answer_tokens=answer_tokens) as mock:
        client = openai.AsyncOpenAI(base_url=mock.base_url, api_key="unused")
        stream = await client.chat.completions.create(
            model="rollgate-mock",
            messages=[{"role": "user", "content": "hi there"}],
            stream=True,
            logprobs=True,
        )
        streamed = [
            len(event.choices[0].logprobs.content)
            async for event in stream
            if event.choices and event.choices[0].logprobs and event.choices[0].logprobs.content
        ]
        unary = await client.chat.completions.create(
            model="rollgate-mock", messages=[{"role": "user", "content": "hi there"}]
        )
        capped = await client.chat.completions.create(
            model="rollgate-mock", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        await client.close()
    assert sum(streamed) == len(streamed) == answer_tokens
    assert unary.usage is not None and unary.usage.completion_tokens == answer_tokens
    assert unary.choices[0].finish_reason == "stop"
    assert capped.choices[0].finish_reason == "length"
