"""The deployment's state as Redis holds it: numbered stream ids and exact backlogs, the
counters publication adds, history snapshots, the error list, and the Console service."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
import msgpack
import pytest
import redis.asyncio as aioredis

from protos import console_pb2, console_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from services.dataproxy.control import CapacityPolicy
from services.dataproxy.error_log import ErrorLog
from services.dataproxy.history import HistorySampler
from services.dataproxy.metrics import global_values
from services.dataproxy.overview import Overview, stream_seq
from services.dataproxy.redis_keys import RedisKeys
from services.runtime.grpc_client import open_channel
from tests.gateway.conftest import ADMIN_KEY
from tests.harness.inprocess import Upstream, running_full_chain

AUTH = (("authorization", f"Bearer {ADMIN_KEY}"),)
MODEL = "rollgate-mock"


@dataclass(frozen=True, slots=True, kw_only=True)
class Chain:
    url: str
    http: aiohttp.ClientSession
    trainer: trainer_pb2_grpc.TrainerStub
    console: console_pb2_grpc.ConsoleStub
    redis: aioredis.Redis
    keys: RedisKeys
    overview: Overview

    async def episode(self, turns: int, reward: float) -> str:
        """start → `turns` chats → reward → end; the session id."""
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        async with self.http.post(self.url + "/rl/start_session", json={}, headers=admin) as r:
            started = await r.json()
        auth = {"Authorization": f"Bearer {started['api_key']}"}
        for i in range(turns):
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"turn {i}"}]}
            async with self.http.post(
                self.url + "/v1/chat/completions", json=body, headers=auth
            ) as r:
                assert r.status == 200, await r.text()
        async with self.http.post(
            self.url + "/rl/set_reward", json={"reward": reward}, headers=auth
        ) as r:
            assert r.status == 200
        async with self.http.post(self.url + "/rl/end_session", json={}, headers=auth) as r:
            assert r.status == 200
        return str(started["session_id"])


@pytest.fixture
async def chain(
    redis_url: str, key_prefix: str, redis_client: aioredis.Redis
) -> AsyncIterator[Chain]:
    async with running_full_chain(
        redis_url, key_prefix, admin_key=ADMIN_KEY, upstreams=[Upstream(worker_id="w-ov")]
    ) as running:
        channel = open_channel(running.dataproxy_addr)
        keys = RedisKeys(key_prefix)
        try:
            yield Chain(
                url=running.url,
                http=running.http,
                trainer=running.trainer,
                console=console_pb2_grpc.ConsoleStub(channel),
                redis=redis_client,
                keys=keys,
                overview=Overview(redis=redis_client, keys=keys, policy=CapacityPolicy()),
            )
        finally:
            await channel.close()


async def _pull(chain: Chain, group: str, count: int) -> list[str]:
    call = chain.trainer.PullTrajectories(
        trainer_pb2.PullTrajectoriesRequest(
            include_history=True, group=group, consumer="c1", max_count=count, idle_timeout_s=2.0
        ),
        metadata=AUTH,
        timeout=20,
    )
    return [message.stream_id async for message in call]


async def test_stream_ids_count_publications_and_backlogs_are_exact(chain: Chain) -> None:
    rewards = [0.5, 1.0, -0.25, 0.0, 2.0]
    for i, reward in enumerate(rewards):
        await chain.episode(turns=i % 2 + 1, reward=reward)
    entries: Any = await chain.redis.xrange(chain.keys.trajectories)
    ids = [e[0].decode() for e in entries]
    assert [stream_seq(i) for i in ids] == [1, 2, 3, 4, 5]
    # group "a" received 3 and acked 1; group "b" exists and received nothing.
    pulled = await _pull(chain, "a", 3)
    assert pulled == ids[:3]
    ack = await chain.trainer.Ack(
        trainer_pb2.AckRequest(group="a", stream_ids=pulled[:1]), metadata=AUTH, timeout=5
    )
    assert ack.acked == 1
    await chain.redis.xgroup_create(chain.keys.trajectories, "b", id="0")
    counters = await chain.overview.counters()
    groups = {g.name: g for g in counters.groups}
    assert (groups["a"].backlog, groups["a"].pending, groups["a"].consumers) == (2, 2, 1)
    assert (groups["b"].backlog, groups["b"].pending, groups["b"].consumers) == (5, 0, 0)
    assert groups["a"].oldest_pending_age_s > 0 and groups["a"].oldest_undelivered_age_s > 0
    assert groups["b"].oldest_pending_age_s == 0
    trajectories = [msgpack.unpackb(e[1][b"data"]) for e in entries]
    # Sampled tokens: the ids when the upstream gives them, else one logprob per token.
    output_tokens = sum(
        len(i["output_token_ids"] or i["output_logprobs"]) // 4
        for t in trajectories
        for i in t["interactions"]
    )
    exact = sum(bool(i["exact_tokens"]) for t in trajectories for i in t["interactions"])
    assert output_tokens > 0
    assert (counters.published, counters.consumed, counters.open_episodes) == (5, 1, 0)
    assert counters.interactions == 1 + 2 + 1 + 2 + 1
    assert counters.output_tokens == output_tokens
    assert counters.exact_interactions == exact
    assert counters.reward_sum == pytest.approx(sum(rewards))
    assert counters.stream_length == 5
    assert counters.capacity_left == -1 and counters.capacity_bound is None
    # The same values as Prometheus families (what the exporting replica serves).
    families = {f.name: f for f in await global_values(chain.overview)()}
    backlog = {
        s.labels["group"]: s.value for s in families["rollgate_stream_backlog_entries"].samples
    }
    assert backlog == {"a": 2.0, "b": 5.0}
    assert families["rollgate_trajectories_published"].samples[0].value == 5.0
    assert families["rollgate_trajectories_acked"].samples[0].value == 1.0
    assert families["rollgate_interactions_published"].samples[0].value == 7.0
    # Rewards can be negative and a counter never decreases: the positive final rewards and
    # the negative ones' magnitudes are two counters (their difference is the sum).
    positive = families["rollgate_final_reward_positive"]
    negative = families["rollgate_final_reward_negative"]
    assert positive.type == negative.type == "counter"
    assert positive.samples[0].value == pytest.approx(3.5)
    assert negative.samples[0].value == pytest.approx(0.25)
    assert "rollgate_final_reward_sum" not in families
    for family in families.values():
        if family.type == "counter":
            assert all(sample.value >= 0 for sample in family.samples), family.name
    # Every trajectory is listed newest first with its summary.
    recent = await chain.overview.recent(limit=10)
    assert [stream_id for stream_id, _ in recent] == ids[::-1]
    assert [s["final_reward"] for _, s in recent] == rewards[::-1]
    assert [s["turns"] for _, s in recent] == [1, 2, 1, 2, 1]
    found = await chain.overview.trajectory(ids[2])
    assert found is not None and found[1] == entries[2][1][b"data"]
    assert await chain.overview.trajectory("1-999") is None
    assert await chain.overview.trajectory("not-an-id") is None


async def test_paused_capacity_and_weight_version_are_read_back(chain: Chain) -> None:
    await chain.trainer.SetWeightVersion(
        trainer_pb2.SetWeightVersionRequest(version=3), metadata=AUTH, timeout=5
    )
    await chain.trainer.GrantCapacity(
        trainer_pb2.GrantCapacityRequest(episodes=4), metadata=AUTH, timeout=5
    )
    before = time.time()
    await chain.trainer.PauseSubmission(
        trainer_pb2.PauseSubmissionRequest(timeout_s=1), metadata=AUTH, timeout=5
    )
    counters = await chain.overview.counters()
    assert counters.weight_version == 3
    assert counters.paused and before - 1 <= counters.paused_since <= time.time()
    # A unix time is a `_timestamp_seconds` gauge (Prometheus' naming), only while paused.
    families = {f.name: f for f in await global_values(chain.overview)()}
    since = families["rollgate_submission_paused_since_timestamp_seconds"]
    assert since.type == "gauge" and since.samples[0].value == counters.paused_since
    assert "rollgate_submission_paused_since_seconds" not in families
    assert counters.capacity_granted == 4 and counters.capacity_left == 4
    await chain.trainer.ResumeSubmission(
        trainer_pb2.ResumeSubmissionRequest(), metadata=AUTH, timeout=5
    )
    assert not (await chain.overview.counters()).paused
    families = {f.name: f for f in await global_values(chain.overview)()}
    assert "rollgate_submission_paused_since_timestamp_seconds" not in families


async def test_running_sessions_are_listed_with_their_turns_without_keys(chain: Chain) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with chain.http.post(
        chain.url + "/rl/start_session", json={"task_id": "math"}, headers=admin
    ) as r:
        started = await r.json()
    auth = {"Authorization": f"Bearer {started['api_key']}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(2):
        async with chain.http.post(chain.url + "/v1/chat/completions", json=body, headers=auth):
            pass
    sessions, total = await chain.overview.sessions(limit=10)
    assert total == 1
    (session,) = sessions
    assert (session.session_id, session.task_id, session.state, session.turns) == (
        started["session_id"],
        "math",
        "active",
        2,
    )
    assert session.deadline > time.time()
    reply = await chain.console.Overview(
        console_pb2.OverviewRequest(history_s=3600), metadata=AUTH, timeout=5
    )
    assert reply.sessions_total == 1 and reply.sessions[0].turns == 2
    assert started["api_key"] not in str(reply)


async def test_the_console_service_needs_the_admin_key(chain: Chain) -> None:
    for metadata in [(), (("authorization", "Bearer wrong"),)]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await chain.console.Overview(
                console_pb2.OverviewRequest(), metadata=metadata, timeout=5
            )
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await chain.console.GetTrajectory(
            console_pb2.GetTrajectoryRequest(stream_id="1-1"), metadata=AUTH, timeout=5
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_one_history_snapshot_per_interval_over_every_replica(chain: Chain) -> None:
    await chain.episode(turns=1, reward=1.0)
    samplers = [
        HistorySampler(redis=chain.redis, keys=chain.keys, overview=chain.overview, interval_s=10)
        for _ in range(2)
    ]
    # Ahead of the running dataproxy's own sampler, which writes the current slot.
    now = (time.time() // 10 + 1000) * 10
    assert await samplers[0].sample_once(now) is True
    assert await samplers[1].sample_once(now + 1) is False  # the same 10 s slot
    assert await samplers[1].sample_once(now + 10) is True
    points = await chain.overview.history(since=now)
    assert [p["t"] for p in points] == [now, now + 10]
    assert points[0]["published"] == 1 and points[0]["reward_sum"] == 1.0


async def test_failed_rpcs_are_kept_newest_first_and_counted(chain: Chain) -> None:
    async with ErrorLog(redis=chain.redis, keys=chain.keys) as errors:
        errors.record("/rollgate.v1.DataProxy/Chat", "UNAVAILABLE", "upstream down " + "x" * 999)
        errors.record("/rollgate.v1.DataProxy/Chat", "CANCELLED", "client went away")
        errors.record("/rollgate.v1.DataProxy/SetReward", "NOT_FOUND", "no such interaction")
        await errors.flush()
    events = await chain.overview.errors(limit=10)
    assert [(e["method"], e["code"]) for e in events] == [
        ("SetReward", "NOT_FOUND"),
        ("Chat", "UNAVAILABLE"),
    ]
    assert len(events[1]["message"]) == 300
    assert (await chain.overview.counters()).errors == 2


async def test_a_reported_turn_failure_is_checked_and_keeps_no_secret_or_address(
    chain: Chain,
) -> None:
    async with ErrorLog(redis=chain.redis, keys=chain.keys) as errors:
        errors.record_turn_failure(
            call="Worker.Complete",
            status="UNAVAILABLE",
            code="upstream_unavailable",
            message="cannot reach http://10.0.0.7:8000/v1 (worker-3:50061, 10.1.2.3) with "
            "Bearer abc.def and sk-sess-" + "k" * 20,
        )
        errors.record_turn_failure(call="rm -rf", status="BOGUS", code="<b>Nope</b>", message="x")
        await errors.flush()
    forged, reported = await chain.overview.errors(limit=10)
    assert (reported["method"], reported["code"]) == ("Worker.Complete", "UNAVAILABLE")
    assert reported["message"] == (
        "upstream_unavailable: cannot reach <address> (<address>, <address>) with "
        "Bearer *** and sk-sess-***"
    )
    assert (forged["method"], forged["code"], forged["message"]) == ("turn", "UNKNOWN", "bnopeb: x")
