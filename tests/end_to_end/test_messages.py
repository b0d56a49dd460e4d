"""Anthropic Messages against the real processes (`rollgate up` style, a vLLM-kind worker on the
mock): the `anthropic` SDK streaming and not, a tool round trip, a session in the URL path; the
published trajectory holds the msg_ ids the client saw, exact token ids for the text it saw,
one logprob per token and the weight version of every token."""

from __future__ import annotations

from typing import Any

import aiohttp
import anthropic
import redis

from rollgate.mock_llm import EOS_ID, token_id, tokenize
from rollgate.stack import Stack
from rollgate.trainer_client import TrainerClient
from rollgate.trajectory import decode_trajectory
from tests.gateway.anthropic_shapes import BASH_TOOL, SYSTEM_BLOCKS

MODEL = "rollgate-mock"


async def _post(
    http: aiohttp.ClientSession, stack: Stack, path: str, key: str, body: dict[str, Any]
) -> dict[str, Any]:
    async with http.post(
        stack.gateway_url + path, json=body, headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        assert resp.status == 200, await resp.text()
        payload: dict[str, Any] = await resp.json()
        return payload


def _trajectory(stack: Stack, trajectory_id: str) -> Any:
    client = redis.Redis.from_url(stack.config.redis_url or "")
    try:
        entries: Any = client.xrange(f"{stack.config.redis_prefix}trajectories")
    finally:
        client.close()
    found = [
        decode_trajectory(fields[b"data"])
        for _, fields in entries
        if fields[b"trajectory_id"].decode() == trajectory_id
    ]
    assert len(found) == 1
    return found[0]


def _check_tokens(
    interaction: Any, text: str, output_tokens: int, version: int, last: int = EOS_ID
) -> None:
    """Exact ids: the mock's ids of the very text the client got, then the token that ended it
    (EOS, or the stop string's, sampled but never shown); a logprob and the weight version for
    each."""
    assert interaction.exact_tokens is True
    assert interaction.prompt_token_ids
    assert interaction.output_token_ids == [token_id(p) for p in tokenize(text)] + [last]
    assert len(interaction.output_logprobs) == len(interaction.output_token_ids) == output_tokens
    assert all(lp < 0 for lp in interaction.output_logprobs)
    assert interaction.output_versions == [version] * output_tokens


async def test_sdk_messages_plain_streamed_and_tool_use_are_recorded_exactly(stack: Stack) -> None:
    admin = stack.config.admin_key
    async with TrainerClient(stack.trainer_address, admin) as trainer:
        await trainer.set_weight_version(3)
    async with aiohttp.ClientSession() as http:
        key = (await _post(http, stack, "/rl/start_session", admin, {"task_id": "claude"}))[
            "api_key"
        ]
        sdk = anthropic.AsyncAnthropic(base_url=stack.gateway_url, api_key=key, max_retries=0)
        async with sdk:
            plain = await sdk.messages.create(
                model=MODEL,
                max_tokens=64,
                system=SYSTEM_BLOCKS,  # type: ignore[arg-type]
                messages=[{"role": "user", "content": "plain one"}],
            )
            async with sdk.messages.stream(
                model=MODEL,
                max_tokens=64,
                messages=[
                    {"role": "user", "content": "plain one"},
                    {"role": "assistant", "content": plain.content[0].text},  # type: ignore[union-attr]
                    {"role": "user", "content": "now stream"},
                ],
            ) as stream:
                events = [event async for event in stream]
                streamed = await stream.get_final_message()
            stopped = await sdk.messages.create(
                model=MODEL,
                max_tokens=64,
                stop_sequences=[" said"],
                messages=[{"role": "user", "content": "stop early"}],
            )
            async with sdk.messages.stream(
                model=MODEL,
                max_tokens=64,
                stop_sequences=[" said"],
                messages=[{"role": "user", "content": "stop early, streamed"}],
            ) as stream:
                stopped_streamed = await stream.get_final_message()
            tool = await sdk.messages.create(
                model=MODEL,
                max_tokens=64,
                tools=[BASH_TOOL],  # type: ignore[list-item]
                tool_choice={"type": "auto"},
                messages=[{"role": "user", "content": "run it /tool"}],
            )
        await _post(http, stack, "/rl/set_reward", key, {"reward": 1.0})
        ended = await _post(http, stack, "/rl/end_session", key, {})
    assert ended["interaction_count"] == 5

    trajectory = _trajectory(stack, ended["trajectory_id"])
    first, second, stop_one, stop_two, third = trajectory.interactions
    answers = [plain, streamed, stopped, stopped_streamed, tool]
    assert [i.interaction_id for i in trajectory.interactions] == [a.id for a in answers]
    assert all(a.id.startswith("msg_") for a in answers)
    for answer, recorded in ((stopped, stop_one), (stopped_streamed, stop_two)):
        assert (answer.stop_reason, answer.stop_sequence) == ("stop_sequence", " said")
        (text,) = answer.content
        assert text.type == "text" and text.text.endswith(": you")
        assert recorded.finish_reason == "stop"
        _check_tokens(recorded, text.text, answer.usage.output_tokens, 3, token_id(" said"))
    streamed_text = "".join(e.text for e in events if e.type == "text")
    # message_start names the served model and the prompt's length (vLLM's prompt ids come
    # on its first chunk), as the end of the stream and the record do.
    (started,) = [e.message for e in events if e.type == "message_start"]
    assert started.model == streamed.model == second.model == MODEL
    assert started.usage.input_tokens == streamed.usage.input_tokens
    assert started.usage.input_tokens == len(second.prompt_token_ids) > 0
    plain_text = plain.content[0].text  # type: ignore[union-attr]
    _check_tokens(first, plain_text, plain.usage.output_tokens, 3)
    _check_tokens(second, streamed_text, streamed.usage.output_tokens, 3)
    assert second.messages[-1] == {"role": "user", "content": "now stream"}
    assert second.messages[1] == {"role": "assistant", "content": plain_text}
    assert first.messages[0]["role"] == "system"
    (tool_use,) = tool.content
    assert tool_use.type == "tool_use" and tool.stop_reason == "tool_use"
    assert third.finish_reason == "tool_calls"
    assert third.output["tool_calls"][0]["id"] == tool_use.id
    assert len(third.output_logprobs) == len(third.output_token_ids) == tool.usage.output_tokens
    assert trajectory.final_reward == 1.0


async def test_a_session_in_the_url_path_with_a_header_mode_key_across_processes(
    stack: Stack,
) -> None:
    admin = stack.config.admin_key
    async with aiohttp.ClientSession() as http:
        key = (await _post(http, stack, "/rl/keys", admin, {"task_id": "claude-path"}))["api_key"]
        base = f"{stack.gateway_url}/sessions/run-42"
        async with anthropic.AsyncAnthropic(base_url=base, api_key=key, max_retries=0) as sdk:
            answers = [
                await sdk.messages.create(
                    model=MODEL, max_tokens=32, messages=[{"role": "user", "content": text}]
                )
                for text in ("first", "second")
            ]
        await _post(http, stack, "/sessions/run-42/rl/set_reward", key, {"reward": 0.5})
        ended = await _post(http, stack, "/sessions/run-42/rl/end_session", key, {})
    trajectory = _trajectory(stack, ended["trajectory_id"])
    assert trajectory.session_id == "run-42" and trajectory.task_id == "claude-path"
    assert [i.interaction_id for i in trajectory.interactions] == [a.id for a in answers]
    assert trajectory.interactions[-1].reward == 0.5
