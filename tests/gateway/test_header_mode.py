"""Header mode (OpenClaw-RL): one admin-issued key, episodes named by X-Session-Id, side turns
marked, X-Session-Done publishing, rewards by session — through the gateway in front of the
real router, dataproxy, worker and mock LLM."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack  # type: ignore[import-untyped]
import orjson
import pytest

from protos import trainer_pb2
from rollgate.tensors import to_tensors
from rollgate.trajectory import decode_trajectory, inline_content
from tests.gateway.conftest import ADMIN_KEY
from tests.gateway.test_lifecycle import AUTH_METADATA, MODEL, Chain, ChainFactory, chain

__all__ = ["chain"]

# What OpenClaw-RL's patched OpenClaw (pi-ai openai-completions) puts on the wire.
PI_AI_BODY: dict[str, Any] = {
    "model": MODEL,
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_completion_tokens": 64,
    "temperature": 0.7,
    "store": False,
}


async def issue(c: Chain) -> dict[str, Any]:
    status, body, _ = await c.post("/rl/keys", ADMIN_KEY, {})
    assert status == 200, body
    return body


async def openclaw_call(
    c: Chain,
    key: str,
    text: str,
    headers: dict[str, str],
    *,
    stream: bool = True,
    extra: dict[str, Any] | None = None,
) -> tuple[int, bytes]:
    body = {
        **PI_AI_BODY,
        "stream": stream,
        "messages": [
            {"role": "developer", "content": "You are a helpful agent."},
            {"role": "user", "content": text},
        ],
        **(extra or {}),
    }
    async with c.http.post(
        c.url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}", **headers},
    ) as resp:
        return resp.status, await resp.read()


async def trajectories(c: Chain) -> list[dict[str, Any]]:
    entries: Any = await c.redis.xrange(c.keys.trajectories)
    return [inline_content(msgpack.unpackb(fields[b"data"], raw=False)) for _, fields in entries]


async def test_rl_keys_issues_a_header_mode_key_only_to_the_admin(chain: ChainFactory) -> None:
    async with chain() as c:
        issued = await issue(c)
        assert issued["mode"] == "header"
        assert issued["api_key"].startswith("sk-sess-") and len(issued["key_id"]) == 24
        status, body, _ = await c.post("/rl/keys", issued["api_key"], {})
        assert status == 401, body
        status, body, _ = await c.post("/rl/keys", ADMIN_KEY, {"mode": "episode"})
        assert status == 400 and "header" in body["error"]["message"]
        # A header-mode key is not refreshed by start_session: its sessions start by header.
        status, body, _ = await c.post(
            "/rl/start_session", ADMIN_KEY, {"api_key": issued["api_key"]}
        )
        assert status == 400 and "X-Session-Id" in body["error"]["message"]


async def test_openclaw_rl_sequence_main_side_missing_type_and_session_done(
    chain: ChainFactory,
) -> None:
    async with chain() as c:
        key = (await issue(c))["api_key"]
        sid = "agent:main:7f3c"
        main = {"X-Session-Id": sid, "X-Turn-Type": "main"}
        assert (await openclaw_call(c, key, "plan the task", main))[0] == 200
        assert (await openclaw_call(c, key, "tool result: ok", main))[0] == 200
        side = {"X-Session-Id": sid, "X-Turn-Type": "side"}
        status, raw = await openclaw_call(c, key, "HEARTBEAT", side)
        assert status == 200 and raw.rstrip().endswith(b"data: [DONE]")
        # No X-Turn-Type: main here (OpenClaw-RL would silently make it a no-data side turn).
        assert (await openclaw_call(c, key, "next step", {"X-Session-Id": sid}))[0] == 200
        assert await c.redis.xlen(c.keys.trajectories) == 0
        # Body keys, as custom clients send them: stripped before the upstream sees them.
        status, _ = await openclaw_call(
            c, key, "final", {}, stream=False, extra={"session_id": sid, "session_done": True}
        )
        assert status == 200

        (trajectory,) = await trajectories(c)
        assert trajectory["session_id"] == sid and trajectory["episode"] == sid
        assert trajectory["end_reason"] == "session_done"
        types = [i["turn_type"] for i in trajectory["interactions"]]
        assert types == ["main", "main", "side", "main", "main"]
        forwarded = trajectory["interactions"][-1]["usage"]
        assert forwarded  # the upstream answered the stripped body
        entries: Any = await c.redis.xrange(c.keys.trajectories)
        decoded = decode_trajectory(entries[0][1][b"data"])
        side_id = decoded.interactions[2].interaction_id
        considered = to_tensors(decoded)  # (the mock gives no token ids: rows are skipped)
        assert len(considered.interaction_ids + considered.skipped) == 4
        assert side_id not in considered.interaction_ids + considered.skipped
        with_side = to_tensors(decoded, include_side_turns=True)
        assert side_id in with_side.interaction_ids + with_side.skipped

        # The same id again after its end starts a new episode of that session.
        assert (await openclaw_call(c, key, "back again", main))[0] == 200
        status, ended, _ = await c.post("/rl/end_session", key, {"session_id": sid})
        assert status == 200 and ended["interaction_count"] == 1
        second = (await trajectories(c))[1]
        assert second["session_id"] == sid and second["episode"] == f"{sid}#2"


async def test_missing_session_id_is_400_and_a_bad_turn_type_is_400(chain: ChainFactory) -> None:
    async with chain() as c:
        key = (await issue(c))["api_key"]
        status, raw = await openclaw_call(c, key, "hi", {"X-Turn-Type": "main"})
        assert status == 400 and b"X-Session-Id" in raw
        status, raw = await openclaw_call(c, key, "hi", {"X-Session-Id": "s", "X-Turn-Type": "x"})
        assert status == 400 and b"main or side" in raw


async def test_concurrent_sessions_under_one_key_publish_once_each(chain: ChainFactory) -> None:
    async with chain() as c:
        key = (await issue(c))["api_key"]
        sessions = [f"s-{n}" for n in range(6)]

        async def run(sid: str) -> None:
            for text in ("one", "two"):
                status, _ = await openclaw_call(c, key, f"{sid} {text}", {"X-Session-Id": sid})
                assert status == 200
            done = {"X-Session-Id": sid, "X-Session-Done": "true"}
            assert (await openclaw_call(c, key, f"{sid} done", done))[0] == 200

        await asyncio.gather(*(run(sid) for sid in sessions))

        published = await trajectories(c)
        assert sorted(t["session_id"] for t in published) == sessions
        assert all(len(t["interactions"]) == 3 for t in published)
        for t in published:
            texts = [i["messages"][-1]["content"] for i in t["interactions"]]
            assert all(text.startswith(t["session_id"] + " ") for text in texts)
        stats = await c.trainer.GetStats(
            trainer_pb2.GetStatsRequest(), metadata=AUTH_METADATA, timeout=5
        )
        assert stats.published == 6 and stats.open_episodes == 0


async def test_rewards_by_session_header_per_interaction_and_for_the_episode(
    chain: ChainFactory,
) -> None:
    async with chain() as c:
        key = (await issue(c))["api_key"]
        for sid in ("a", "b"):
            await openclaw_call(c, key, "step 1", {"X-Session-Id": sid}, stream=False)
            await openclaw_call(c, key, "step 2", {"X-Session-Id": sid}, stream=False)
        status, body, _ = await c.post("/rl/set_reward", key, {"reward": 1.0})
        assert status == 400 and "X-Session-Id" in body["error"]["message"]
        async with c.http.post(
            c.url + "/rl/set_reward",
            json={"reward": 0.25},
            headers={"Authorization": f"Bearer {key}", "X-Session-Id": "a"},
        ) as resp:
            assert resp.status == 200
            last_a = (await resp.json())["interaction_id"]
        # With session_id in the body instead of the header.
        status, body, _ = await c.post("/rl/set_reward", key, {"reward": 1.0, "session_id": "b"})
        assert status == 200
        for sid in ("a", "b"):
            async with c.http.post(
                c.url + "/rl/end_session",
                json={},
                headers={"Authorization": f"Bearer {key}", "X-Session-Id": sid},
            ) as resp:
                assert resp.status == 200
        by_session = {t["session_id"]: t for t in await trajectories(c)}
        a_last = by_session["a"]["interactions"][-1]
        assert a_last["interaction_id"] == last_a and a_last["reward"] == 0.25
        assert by_session["b"]["final_reward"] == 1.0
        assert not by_session["b"]["interactions"][0]["reward_set"]


async def test_paused_submission_is_503_with_openclaw_rl_text(chain: ChainFactory) -> None:
    async with chain(pause_wait_s=0.3) as c:
        key = (await issue(c))["api_key"]
        await c.trainer.PauseSubmission(
            trainer_pb2.PauseSubmissionRequest(timeout_s=1.0), metadata=AUTH_METADATA, timeout=5
        )
        status, raw = await openclaw_call(c, key, "hi", {"X-Session-Id": "p"}, stream=False)
        assert status == 503 and b"submission paused for weight update" in raw
        await c.trainer.ResumeSubmission(
            trainer_pb2.ResumeSubmissionRequest(), metadata=AUTH_METADATA, timeout=5
        )
        assert (await openclaw_call(c, key, "hi", {"X-Session-Id": "p"}))[0] == 200


async def test_a_per_episode_key_ignores_session_headers(chain: ChainFactory) -> None:
    async with chain() as c:
        status, started, _ = await c.post("/rl/start_session", ADMIN_KEY, {"task_id": "t"})
        key = started["api_key"]
        headers = {"X-Session-Id": "other", "X-Session-Done": "true", "X-Turn-Type": "side"}
        assert (await openclaw_call(c, key, "hi", headers))[0] == 200
        assert await c.redis.xlen(c.keys.trajectories) == 0  # not ended by the header
        status, ended, _ = await c.post("/rl/end_session", key, {})
        assert status == 200 and ended["session_id"] == started["session_id"]
        (trajectory,) = await trajectories(c)
        assert trajectory["interactions"][0]["turn_type"] == "side"
        # A retried end_session (its reply lost) returns the same publication again.
        status, again, _ = await c.post("/rl/end_session", key, {})
        assert status == 200 and again == ended
        assert await c.redis.xlen(c.keys.trajectories) == 1


@pytest.mark.parametrize("value", ["yes", "ON"])
async def test_session_done_accepts_openclaw_rl_truthy_strings(
    chain: ChainFactory, value: str
) -> None:
    async with chain() as c:
        key = (await issue(c))["api_key"]
        done = {"X-Session-Id": "d", "X-Session-Done": value}
        assert (await openclaw_call(c, key, "hi", done, stream=False))[0] == 200
        assert await c.redis.xlen(c.keys.trajectories) == 1


async def test_prm_style_rewards_name_each_turn_of_a_header_mode_session(
    chain: ChainFactory,
) -> None:
    async with chain() as c:
        key = (await issue(c))["api_key"]
        session = {"Authorization": f"Bearer {key}", "X-Session-Id": "prm"}
        ids = []
        for text in ("turn one", "turn two"):
            status, raw = await openclaw_call(c, key, text, {"X-Session-Id": "prm"}, stream=False)
            assert status == 200
            ids.append(orjson.loads(raw)["id"])
        # A PRM judges each turn once the next state is known: reward each by its id.
        for interaction_id, reward in zip(ids, (0.25, 0.75), strict=True):
            async with c.http.post(
                c.url + "/rl/set_reward",
                json={"reward": reward, "interaction_id": interaction_id},
                headers=session,
            ) as resp:
                assert resp.status == 200, await resp.text()
                assert (await resp.json())["interaction_id"] == interaction_id
        async with c.http.post(c.url + "/rl/end_session", json={}, headers=session) as resp:
            assert resp.status == 200
        (trajectory,) = await trajectories(c)
        assert trajectory["session_id"] == "prm"
        rewarded = [(i["interaction_id"], i["reward"]) for i in trajectory["interactions"]]
        assert rewarded == [(ids[0], 0.25), (ids[1], 0.75)]
        assert all(i["reward_set"] for i in trajectory["interactions"])


@pytest.mark.parametrize("stream", [False, True])
async def test_openclaw_rl_body_keys_are_stripped_before_the_upstream(
    chain: ChainFactory, stream: bool
) -> None:
    async with chain() as c:
        key = (await issue(c))["api_key"]
        extra = {"session_id": "strip", "turn_type": "side", "session_done": False}
        status, _ = await openclaw_call(c, key, "hi", {}, stream=stream, extra=extra)
        assert status == 200
        sent = c.mock.stats.last_body
        assert sent is not None and sent["messages"][-1]["content"] == "hi"
        assert not {"session_id", "turn_type", "session_done"} & set(sent)
        # The body keys still took effect: a side turn of session `strip`, still open.
        assert await c.redis.xlen(c.keys.trajectories) == 0
        async with c.http.post(
            c.url + "/rl/end_session",
            json={},
            headers={"Authorization": f"Bearer {key}", "X-Session-Id": "strip"},
        ) as resp:
            assert resp.status == 200
        (trajectory,) = await trajectories(c)
        assert [i["turn_type"] for i in trajectory["interactions"]] == ["side"]


async def test_a_responses_call_carries_the_session_headers_like_chat(
    chain: ChainFactory,
) -> None:
    async with chain() as c:
        key = (await issue(c))["api_key"]
        sid = "agent:responses:1"
        for turn_type, done in (("main", False), ("side", True)):
            headers = {"X-Session-Id": sid, "X-Turn-Type": turn_type}
            if done:
                headers["X-Session-Done"] = "1"
            async with c.http.post(
                c.url + "/v1/responses",
                json={
                    "model": MODEL,
                    "input": f"a {turn_type} turn",
                    "stream": turn_type == "main",
                },
                headers={"Authorization": f"Bearer {key}", **headers},
            ) as resp:
                assert resp.status == 200, await resp.read()
                await resp.read()

        (trajectory,) = await trajectories(c)
        assert trajectory["session_id"] == sid and trajectory["end_reason"] == "session_done"
        assert [i["turn_type"] for i in trajectory["interactions"]] == ["main", "side"]
        assert all(i["interaction_id"].startswith("resp_") for i in trajectory["interactions"])
