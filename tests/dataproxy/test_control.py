"""Trainer control through a real dataproxy (DataProxy + Trainer over gRPC), worker and mock LLM."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest

from protos import dataproxy_pb2, trainer_pb2
from services.dataproxy.control import PAUSED_MESSAGE
from services.gateway.relay import Chunks, Done
from services.runtime.errors import RollgateError, Unavailable
from services.runtime.keys import key_digest
from tests.harness.inprocess import (
    ADMIN_KEY,
    RPC_TIMEOUT_S,
    DataproxyChain,
    TurnCall,
    collect,
    running_dataproxy_chain,
)
from tests.harness.poll import eventually

AUTH = (("authorization", f"Bearer {ADMIN_KEY}"),)


@dataclass(frozen=True, slots=True, kw_only=True)
class Proxy(DataproxyChain):
    """A dataproxy (with its Trainer service) and a worker over the mock LLM."""

    async def start(self, **fields: Any) -> dataproxy_pb2.StartSessionResponse:
        reply: dataproxy_pb2.StartSessionResponse = await self.dataproxy.StartSession(
            dataproxy_pb2.StartSessionRequest(task_id="ctl", **fields), timeout=RPC_TIMEOUT_S
        )
        return reply

    def chat(self, api_key: str, text: str) -> TurnCall:
        """A streamed turn through the relay (not started until read)."""
        return self.call(key_digest(api_key), text, request_id=f"req-{text}")

    async def stats(self) -> trainer_pb2.GetStatsResponse:
        reply: trainer_pb2.GetStatsResponse = await self.trainer.GetStats(
            trainer_pb2.GetStatsRequest(), metadata=AUTH, timeout=RPC_TIMEOUT_S
        )
        return reply


def running_proxy(
    redis_url: str, key_prefix: str, *, token_interval_ms: float = 0.0, **overrides: Any
) -> contextlib.AbstractAsyncContextManager[Proxy]:
    return running_dataproxy_chain(
        redis_url, key_prefix, chain_type=Proxy, token_interval_ms=token_interval_ms, **overrides
    )


async def test_pause_waits_for_turns_in_flight_then_new_turns_wait_and_resume_releases_them(
    redis_url: str, key_prefix: str
) -> None:
    async with running_proxy(redis_url, key_prefix, token_interval_ms=40.0) as proxy:
        started = await proxy.start()
        running = proxy.chat(started.api_key, "long")
        assert isinstance(await running.read(), Chunks)  # the turn is generating
        assert (await proxy.stats()).in_flight == 1

        pause = asyncio.ensure_future(
            proxy.trainer.PauseSubmission(
                trainer_pb2.PauseSubmissionRequest(timeout_s=10), metadata=AUTH, timeout=20
            )
        )
        await eventually(lambda: _is_paused(proxy))
        assert not pause.done()  # the running turn holds it
        rest = await collect(running)
        assert isinstance(rest[-1], Done)  # the running turn finished and was recorded
        paused = await pause
        assert paused.drained and paused.in_flight == 0

        requests = proxy.mock.stats.requests
        waiting = asyncio.create_task(collect(proxy.chat(started.api_key, "waits")))
        # A window that proves the new turn does NOT start while paused: it neither finishes
        # nor reaches the model.
        done, _ = await asyncio.wait({waiting}, timeout=0.3)
        assert not done and proxy.mock.stats.requests == requests
        await proxy.trainer.ResumeSubmission(
            trainer_pb2.ResumeSubmissionRequest(), metadata=AUTH, timeout=RPC_TIMEOUT_S
        )
        async with asyncio.timeout(10):
            assert isinstance((await waiting)[-1], Done)
        assert (await proxy.stats()).paused is False


async def _is_paused(proxy: Proxy) -> bool:
    return bool((await proxy.stats()).paused)


async def test_a_turn_paused_too_long_gets_503_submission_paused(
    redis_url: str, key_prefix: str
) -> None:
    async with running_proxy(redis_url, key_prefix, pause_wait_s=0.3) as proxy:
        started = await proxy.start()
        reply = await proxy.trainer.PauseSubmission(
            trainer_pb2.PauseSubmissionRequest(timeout_s=1), metadata=AUTH, timeout=5
        )
        assert reply.drained
        with pytest.raises(RollgateError) as caught:
            await collect(proxy.chat(started.api_key, "refused"))
        err = caught.value
        assert isinstance(err, Unavailable) and err.http_status == 503
        assert err.message == PAUSED_MESSAGE == "submission paused for weight update"
        assert err.retry_after_s
        assert (await proxy.stats()).in_flight == 0


async def test_pause_timeout_reports_the_turns_still_running(
    redis_url: str, key_prefix: str
) -> None:
    async with running_proxy(redis_url, key_prefix, token_interval_ms=60.0) as proxy:
        started = await proxy.start()
        running = proxy.chat(started.api_key, "slow")
        await running.read()
        reply = await proxy.trainer.PauseSubmission(
            trainer_pb2.PauseSubmissionRequest(timeout_s=0.1), metadata=AUTH, timeout=5
        )
        assert (reply.drained, reply.in_flight) == (False, 1)
        await collect(running)
        await proxy.trainer.ResumeSubmission(
            trainer_pb2.ResumeSubmissionRequest(), metadata=AUTH, timeout=5
        )


async def test_a_dead_replicas_expired_turn_lease_does_not_block_pause(
    redis_url: str, key_prefix: str
) -> None:
    async with running_proxy(redis_url, key_prefix) as proxy:
        await proxy.redis.zadd(proxy.keys.in_flight, {"dead-replica-turn": time.time() - 1})
        reply = await proxy.trainer.PauseSubmission(
            trainer_pb2.PauseSubmissionRequest(timeout_s=1), metadata=AUTH, timeout=5
        )
        assert reply.drained


async def test_turns_record_the_weight_version_at_admission_and_at_the_end(
    redis_url: str, key_prefix: str
) -> None:
    async with running_proxy(redis_url, key_prefix, token_interval_ms=30.0) as proxy:
        started = await proxy.start()
        await proxy.trainer.SetWeightVersion(
            trainer_pb2.SetWeightVersionRequest(version=3), metadata=AUTH, timeout=5
        )
        running = proxy.chat(started.api_key, "spans")
        await running.read()
        # Not paused first: the version moves under a running turn.
        await proxy.trainer.SetWeightVersion(
            trainer_pb2.SetWeightVersionRequest(version=4), metadata=AUTH, timeout=5
        )
        await collect(running)
        digest = key_digest(started.api_key)
        key: Any = await proxy.redis.hgetall(proxy.keys.key(digest))
        raw = await proxy.redis.lrange(
            proxy.keys.turns(key[b"key_id"].decode(), key[b"episode"].decode()), 0, -1
        )
        turn = msgpack.unpackb(raw[0], raw=False)
        assert (turn["weight_version"], turn["weight_version_end"]) == (3, 4)


async def test_get_stats_reports_capacity_grants_and_open_episodes(
    redis_url: str, key_prefix: str
) -> None:
    async with running_proxy(
        redis_url, key_prefix, max_head_offpolicyness=1, batch_size=2
    ) as proxy:
        assert (await proxy.stats()).capacity == 4  # (1 + 0 + 1) x 2
        await proxy.start()
        stats = await proxy.stats()
        assert (stats.capacity, stats.open_episodes) == (3, 1)
        granted = await proxy.trainer.GrantCapacity(
            trainer_pb2.GrantCapacityRequest(episodes=5), metadata=AUTH, timeout=5
        )
        assert granted.capacity == 8


async def test_get_stats_says_whether_rollgates_own_staleness_bound_is_configured(
    redis_url: str, key_prefix: str
) -> None:
    async with running_proxy(
        redis_url, key_prefix, max_head_offpolicyness=0, batch_size=3
    ) as proxy:
        bounded = await proxy.stats()
    assert bounded.HasField("max_head_offpolicyness")
    assert (bounded.max_head_offpolicyness, bounded.staleness_batch_size) == (0, 3)
    async with running_proxy(redis_url, key_prefix + "free:") as proxy:
        free = await proxy.stats()
    assert not free.HasField("max_head_offpolicyness")
    assert free.staleness_batch_size == 1


async def test_complete_groups_only_delivers_a_group_once_every_member_ended(
    redis_url: str, key_prefix: str
) -> None:
    async with running_proxy(redis_url, key_prefix) as proxy:
        group = await proxy.start(group_size=3)
        assert len(group.members) == 3 and group.group_id
        solo = await proxy.start()
        keys = [m.api_key for m in group.members]
        for api_key in [keys[0], keys[1], solo.api_key]:
            await collect(proxy.chat(api_key, "hi"))
            await proxy.dataproxy.EndSession(
                dataproxy_pb2.EndSessionRequest(key_digest=key_digest(api_key)), timeout=5
            )

        first = await _pull(proxy, "c1")
        assert [m.group_id for m in first] == [""]  # only the solo episode
        await proxy.trainer.Ack(
            trainer_pb2.AckRequest(group="grpo", stream_ids=[first[0].stream_id]),
            metadata=AUTH,
            timeout=5,
        )
        # The last member ends empty: it counts as done, is not delivered, the group is.
        await proxy.dataproxy.EndSession(
            dataproxy_pb2.EndSessionRequest(key_digest=key_digest(keys[2])), timeout=5
        )
        second = await _pull(proxy, "c1")
        assert [m.group_id for m in second] == [group.group_id] * 2
        assert {m.group_size for m in second} == {3}


async def _pull(proxy: Proxy, consumer: str) -> list[trainer_pb2.TrajectoryMessage]:
    call = proxy.trainer.PullTrajectories(
        trainer_pb2.PullTrajectoriesRequest(
            include_history=True,
            group="grpo",
            consumer=consumer,
            idle_timeout_s=0.6,
            complete_groups_only=True,
        ),
        metadata=AUTH,
        timeout=20,
    )
    return [message async for message in call]


async def test_a_turn_that_outlives_its_episode_is_refused_and_leaves_no_lease(
    redis_url: str, key_prefix: str
) -> None:
    async with running_proxy(redis_url, key_prefix, token_interval_ms=30.0) as proxy:
        started = await proxy.start()
        running = proxy.chat(started.api_key, "late")
        await running.read()
        await proxy.dataproxy.EndSession(
            dataproxy_pb2.EndSessionRequest(key_digest=key_digest(started.api_key)), timeout=5
        )
        with pytest.raises(RollgateError) as caught:
            await collect(running)
        assert caught.value.code == "episode_ended"
        assert (await proxy.stats()).in_flight == 0
        reply = await proxy.trainer.PauseSubmission(
            trainer_pb2.PauseSubmissionRequest(timeout_s=1), metadata=AUTH, timeout=5
        )
        assert reply.drained


async def test_a_turn_longer_than_the_idle_timeout_is_recorded_not_reaped_mid_turn(
    redis_url: str, key_prefix: str
) -> None:
    idle_s = 0.3
    async with running_proxy(
        redis_url,
        key_prefix,
        token_interval_ms=60.0,
        session_idle_timeout_s=idle_s,
        reaper_interval_s=0.05,
    ) as proxy:
        started = await proxy.start()
        began = time.monotonic()
        messages = await collect(
            proxy.chat(started.api_key, "a question long enough for a slow answer of many words")
        )
        # The construction: the turn outlived the idle timeout several reaper sweeps over.
        assert time.monotonic() - began > idle_s + 0.2
        assert isinstance(messages[-1], Done)  # recorded, not 503 episode_ended

        # Once idle after the turn, the reaper publishes the episode with that turn in it.
        async def published() -> bool:
            return bool(await proxy.redis.xlen(proxy.keys.trajectories))

        await eventually(published)
        entries: Any = await proxy.redis.xrange(proxy.keys.trajectories)
        ((_, fields),) = entries
        trajectory = msgpack.unpackb(fields[b"data"], raw=False)
        assert trajectory["session_id"] == started.session_id
        assert trajectory["end_reason"] == "idle"
        assert len(trajectory["interactions"]) == 1
