"""The reaper's re-check never lowers an idle deadline that a turn start raised after its claim."""

from __future__ import annotations

import time

import pytest
import redis.asyncio as aioredis

from services.dataproxy.control import CapacityPolicy
from services.dataproxy.reaper import CLAIM_BATCH, CLAIM_LEASE_S
from services.dataproxy.redis_keys import RedisKeys
from services.dataproxy.scripts import Scripts
from services.dataproxy.sessions import EpisodePolicy, SessionStore
from services.runtime.keys import key_digest
from services.runtime.secret import Secret
from tests.dataproxy.test_sessions import ADMIN_KEY

# Shorter than the turn's lease, as with a turn timeout above the idle timeout.
IDLE_S = 30.0
LEASE_S = 600.0


def make_store(redis_client: aioredis.Redis, keys: RedisKeys) -> SessionStore:
    return SessionStore(
        redis=redis_client,
        keys=keys,
        scripts=Scripts.load(),
        admin_key=Secret(ADMIN_KEY),
        refresh_lock_s=10.0,
        policy=EpisodePolicy(capacity=CapacityPolicy(), session_idle_timeout_s=IDLE_S),
    )


async def test_a_turn_started_between_the_reapers_claim_and_recheck_keeps_its_deadline(
    redis_client: aioredis.Redis, key_prefix: str
) -> None:
    keys = RedisKeys(key_prefix)
    store = make_store(redis_client, keys)
    started = await store.start(task_id="t", api_key="")
    digest = key_digest(started.api_key)
    member = f"{digest}/{started.session_id}"
    # The deadline has come due by the zset (a stale one), though the episode was just active.
    await redis_client.zadd(keys.idle, {member: time.time() - 1})

    # 1. The reaper claims the member: its deadline is pushed one claim lease ahead.
    assert await store.claim_due(held=False, lease_s=CLAIM_LEASE_S, limit=CLAIM_BATCH) == [member]
    # 2. A turn starts: begin_turn raises the deadline to the turn's lease deadline.
    lease_until = time.time() + LEASE_S
    assert await store.begin_turn(digest, session_id="", token="t1", lease_until=lease_until)
    assert await redis_client.zscore(keys.idle, member) == pytest.approx(lease_until, abs=0.01)
    # 3. The reaper's re-check sees recent activity and reschedules, without lowering it.
    assert await store.reap_idle(member) is None
    assert await redis_client.zscore(keys.idle, member) == pytest.approx(lease_until, abs=0.01)
    await store.active_episode(digest)


async def test_the_recheck_does_not_bring_back_a_member_published_meanwhile(
    redis_client: aioredis.Redis, key_prefix: str
) -> None:
    keys = RedisKeys(key_prefix)
    store = make_store(redis_client, keys)
    started = await store.start(task_id="t", api_key="")
    digest = key_digest(started.api_key)
    member = f"{digest}/{started.session_id}"
    await redis_client.zadd(keys.idle, {member: time.time() - 1})
    assert await store.claim_due(held=False, lease_s=CLAIM_LEASE_S, limit=CLAIM_BATCH) == [member]
    # The episode looks active to the re-check, but its member is removed first (as a
    # publication between the re-check's read and its write does).
    await redis_client.zrem(keys.idle, member)
    assert await store.reap_idle(member) is None
    assert await redis_client.zscore(keys.idle, member) is None
