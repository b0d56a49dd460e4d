"""Concurrent turns of one episode and its idle deadline: a finishing turn never lowers it below
the leases of the turns still running; the last one sets it to now + idle timeout."""

from __future__ import annotations

import time
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
import redis.asyncio as aioredis

from services.dataproxy.control import CapacityPolicy, Control
from services.dataproxy.redis_keys import RedisKeys
from services.dataproxy.scripts import Scripts
from services.dataproxy.sessions import ActiveEpisode, EpisodePolicy, SessionStore
from services.gateway.relay import Chunks, Done
from services.runtime.errors import RollgateError, Unavailable
from services.runtime.keys import key_digest
from services.runtime.secret import Secret
from tests.dataproxy.test_control import running_proxy
from tests.dataproxy.test_sessions import ADMIN_KEY, turn_record
from tests.harness.inprocess import collect
from tests.harness.poll import eventually

IDLE_S = 30.0


@pytest.fixture
def keys(key_prefix: str) -> RedisKeys:
    return RedisKeys(key_prefix)


@pytest.fixture
def store(redis_client: aioredis.Redis, keys: RedisKeys) -> SessionStore:
    return SessionStore(
        redis=redis_client,
        keys=keys,
        scripts=Scripts.load(),
        admin_key=Secret(ADMIN_KEY),
        refresh_lock_s=30.0,
        policy=EpisodePolicy(capacity=CapacityPolicy(), session_idle_timeout_s=IDLE_S),
    )


@pytest.fixture
def control(redis_client: aioredis.Redis, keys: RedisKeys) -> Control:
    return Control(redis=redis_client, keys=keys, scripts=Scripts.load(), policy=CapacityPolicy())


async def begin(store: SessionStore, digest: str, token: str, lease_until: float) -> ActiveEpisode:
    episode = await store.begin_turn(digest, session_id="", token=token, lease_until=lease_until)
    assert episode is not None
    return episode


async def record(store: SessionStore, episode: ActiveEpisode, interaction_id: str) -> int:
    return await store.record_turn(
        episode,
        interaction_id=interaction_id,
        encode=lambda end: turn_record(interaction_id).encode(
            weight_version=episode.weight_version,
            weight_version_end=end,
            now=time.time(),
            turn_type="main",
        ),
    )


async def running_turns(redis: aioredis.Redis, keys: RedisKeys, member: str) -> int | None:
    raw: Any = await redis.hget(keys.episode_turns, member)
    return None if raw is None else int(raw)


async def test_a_turn_finishing_while_another_runs_keeps_the_deadline_at_the_others_lease(
    store: SessionStore, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    started = await store.start(task_id="t", api_key="")
    digest = key_digest(started.api_key)
    member = f"{digest}/{started.session_id}"
    long_lease = time.time() + 600
    short = await begin(store, digest, "short", time.time() + 60)
    long = await begin(store, digest, "long", long_lease)
    assert await running_turns(redis_client, keys, member) == 2

    await record(store, short, "c-short")

    # The long turn still runs: its lease's deadline holds (not now + 30 s).
    assert await redis_client.zscore(keys.idle, member) == pytest.approx(long_lease, abs=0.01)
    assert await running_turns(redis_client, keys, member) == 1

    before = time.time()
    await record(store, long, "c-long")

    # The last running turn: the deadline is now + idle timeout, lowered from the lease's.
    score = await redis_client.zscore(keys.idle, member)
    assert score is not None and before + IDLE_S <= score <= time.time() + IDLE_S
    assert await running_turns(redis_client, keys, member) is None


async def test_a_turn_released_before_its_append_no_longer_holds_the_deadline(
    store: SessionStore, control: Control, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    started = await store.start(task_id="t", api_key="")
    digest = key_digest(started.api_key)
    member = f"{digest}/{started.session_id}"
    recorded = await begin(store, digest, "ok", time.time() + 60)

    async def begin_failing(token: str, lease_until: float) -> ActiveEpisode | None:
        return await store.begin_turn(digest, session_id="", token=token, lease_until=lease_until)

    _, lease = await control.admit(begin_failing)
    assert lease.member == member
    assert await running_turns(redis_client, keys, member) == 2

    # The turn fails before its append (upstream error, cancel): released twice, counted once.
    await control.release(lease)
    await control.release(lease)
    assert await running_turns(redis_client, keys, member) == 1

    before = time.time()
    await record(store, recorded, "c-ok")

    score = await redis_client.zscore(keys.idle, member)
    assert score is not None and before + IDLE_S <= score <= time.time() + IDLE_S
    assert await running_turns(redis_client, keys, member) is None
    assert await control.in_flight() == 0


async def test_publication_drops_the_count_and_a_turn_finishing_after_it_leaves_none(
    store: SessionStore, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    started = await store.start(task_id="t", api_key="")
    digest = key_digest(started.api_key)
    member = f"{digest}/{started.session_id}"
    late = await begin(store, digest, "late", time.time() + 60)
    assert await running_turns(redis_client, keys, member) == 1

    await store.end(digest)
    assert await running_turns(redis_client, keys, member) is None

    with pytest.raises(Unavailable) as caught:
        await record(store, late, "c-late")
    assert caught.value.code == "episode_ended"
    assert await running_turns(redis_client, keys, member) is None
    assert await redis_client.zscore(keys.in_flight, "late") is None


async def test_a_long_turn_is_recorded_when_a_shorter_concurrent_one_ends_first(
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
        member = f"{key_digest(started.api_key)}/{started.session_id}"
        long = proxy.chat(started.api_key, "a question long enough for a slow answer of many words")
        assert isinstance(await long.read(), Chunks)
        short = await collect(proxy.chat(started.api_key, "hi"))
        assert isinstance(short[-1], Done)
        short_done = time.monotonic()

        messages = await collect(long)

        # The construction: the long turn ran on well past the idle timeout after the short
        # one ended (before the fix the reaper ended the episode then: 503 episode_ended).
        assert time.monotonic() - short_done > idle_s + 0.2
        assert isinstance(messages[-1], Done)

        async def published() -> bool:
            return bool(await proxy.redis.xlen(proxy.keys.trajectories))

        await eventually(published)
        entries: Any = await proxy.redis.xrange(proxy.keys.trajectories)
        ((_, fields),) = entries
        trajectory = msgpack.unpackb(fields[b"data"], raw=False)
        assert trajectory["end_reason"] == "idle"
        assert len(trajectory["interactions"]) == 2
        assert await running_turns(proxy.redis, proxy.keys, member) is None


async def test_a_failed_turn_leaves_no_running_count(redis_url: str, key_prefix: str) -> None:
    async with running_proxy(redis_url, key_prefix) as proxy:
        started = await proxy.start()
        member = f"{key_digest(started.api_key)}/{started.session_id}"

        with pytest.raises(RollgateError) as caught:
            await collect(proxy.chat(started.api_key, "/fail-500"))

        assert caught.value.http_status >= 500

        async def released() -> bool:
            return (await proxy.stats()).in_flight == 0

        await eventually(released)
        assert await running_turns(proxy.redis, proxy.keys, member) is None
