"""Header-mode keys in the session store against a real Redis: sessions bound on first use
(capacity applies), the idle reaper, the one-script turn start and end, end_session retries."""

from __future__ import annotations

import time
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
import redis.asyncio as aioredis

from services.dataproxy.control import CapacityPolicy
from services.dataproxy.reaper import Reaper
from services.dataproxy.redis_keys import RedisKeys
from services.dataproxy.scripts import Scripts
from services.dataproxy.sessions import ActiveEpisode, EpisodePolicy, SessionStore
from services.runtime.errors import Conflict, InvalidRequest, TooManyRequests
from services.runtime.keys import key_digest
from services.runtime.secret import Secret
from tests.dataproxy.test_sessions import ADMIN_KEY, stream_entries, turn_record
from tests.harness.poll import eventually


@pytest.fixture
def keys(key_prefix: str) -> RedisKeys:
    return RedisKeys(key_prefix)


def make_store(redis: aioredis.Redis, keys: RedisKeys, **policy: Any) -> SessionStore:
    return SessionStore(
        redis=redis,
        keys=keys,
        scripts=Scripts.load(),
        admin_key=Secret(ADMIN_KEY),
        refresh_lock_s=30.0,
        policy=EpisodePolicy(**policy),
    )


async def begin(store: SessionStore, digest: str, session_id: str, token: str) -> ActiveEpisode:
    episode = await store.begin_turn(
        digest, session_id=session_id, token=token, lease_until=time.time() + 60
    )
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


async def test_turn_start_and_end_hold_and_release_the_in_flight_lease(
    redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    store = make_store(redis_client, keys)
    digest = key_digest((await store.issue_key(task_id="claw")).api_key)
    episode = await begin(store, digest, "s1", "tok-1")
    assert episode.session_id == "s1" and episode.episode == "s1" and episode.mode == "header"
    assert await redis_client.zscore(keys.in_flight, "tok-1") is not None
    await record(store, episode, "i-1")
    assert await redis_client.zscore(keys.in_flight, "tok-1") is None
    ep = await redis_client.hgetall(keys.episode(episode.key_id, "s1"))
    assert ep[b"session_id"] == b"s1" and ep[b"task_id"] == b"claw" and ep[b"turns"] == b"1"
    # The key hash never becomes active: its sessions are.
    assert await redis_client.hget(keys.key(digest), "state") == b"idle"


async def test_a_version_moved_during_the_turn_is_recorded_as_its_end_version(
    redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    store = make_store(redis_client, keys)
    digest = key_digest((await store.issue_key()).api_key)
    episode = await begin(store, digest, "v", "tok")
    await redis_client.set(keys.weight_version, 3)
    await record(store, episode, "i-1")
    (raw,) = await redis_client.lrange(keys.turns(episode.key_id, "v"), 0, -1)
    turn = msgpack.unpackb(raw, raw=False)
    assert turn["weight_version"] == 0 and turn["weight_version_end"] == 3
    assert await redis_client.zcard(keys.in_flight) == 0


async def test_a_new_session_takes_capacity_and_waits_then_429(
    redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    store = make_store(
        redis_client,
        keys,
        refresh_timeout_s=0.2,
        capacity=CapacityPolicy(max_head_offpolicyness=0, batch_size=1),
    )
    digest = key_digest((await store.issue_key()).api_key)
    await begin(store, digest, "first", "t1")
    await begin(store, digest, "first", "t2")  # the same session: no new capacity needed
    with pytest.raises(TooManyRequests) as caught:
        await store.begin_turn(digest, session_id="second", token="t3", lease_until=1e12)
    assert caught.value.code == "no_capacity"
    with pytest.raises(InvalidRequest, match="X-Session-Id"):
        await store.begin_turn(digest, session_id="", token="t4", lease_until=1e12)


async def test_the_idle_reaper_publishes_an_abandoned_session_once(
    redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    store = make_store(redis_client, keys, session_idle_timeout_s=0.2)
    digest = key_digest((await store.issue_key()).api_key)
    for sid in ("idle-a", "idle-b"):
        await record(store, await begin(store, digest, sid, f"t-{sid}"), f"i-{sid}")
    reaper = Reaper(store=store, interval_s=0.05)
    ended: list[str] = []

    async def both_ended() -> bool:
        ended.extend(p.session_id for p in (await reaper.sweep()).idle)
        return len(ended) >= 2

    await eventually(both_ended, timeout_s=5, interval_s=0, what="both sessions reaped")
    assert sorted(ended) == ["idle-a", "idle-b"]
    assert not (await reaper.sweep()).idle
    entries = await stream_entries(redis_client, keys)
    decoded = [msgpack.unpackb(e[b"data"], raw=False) for e in entries]
    assert sorted(t["session_id"] for t in decoded) == ["idle-a", "idle-b"]
    assert {t["end_reason"] for t in decoded} == {"idle"}
    # The same id afterwards starts the session's next episode.
    again = await begin(store, digest, "idle-a", "t-again")
    assert again.episode == "idle-a#2"


async def test_a_retried_end_session_is_answered_only_within_the_retry_window(
    redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    store = make_store(redis_client, keys)
    started = await store.start(task_id="t", api_key="")
    digest = key_digest(started.api_key)
    await store.end(digest)  # empty episode
    assert (await store.end(digest)).status == "empty"
    await redis_client.hset(keys.key(digest), "last_ended_at", repr(time.time() - 301))
    with pytest.raises(Conflict, match="no active episode"):
        await store.end(digest)
