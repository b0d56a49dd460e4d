"""The stream trimmer against a real Redis: only what every consumer group acked goes."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis

from services.dataproxy.redis_keys import RedisKeys
from services.dataproxy.stream_trim import StreamTrimmer
from tests.harness.poll import eventually


@pytest.fixture
def keys(key_prefix: str) -> RedisKeys:
    return RedisKeys(key_prefix)


async def add(redis: aioredis.Redis, keys: RedisKeys, count: int) -> list[str]:
    ids = []
    for n in range(count):
        stream_id: Any = await redis.xadd(
            keys.trajectories, {"trajectory_id": f"t{n}", "data": b"x"}
        )
        ids.append(stream_id.decode())
    return ids


async def read(
    redis: aioredis.Redis, keys: RedisKeys, group: str, consumer: str, n: int
) -> list[str]:
    reply: Any = await redis.xreadgroup(group, consumer, {keys.trajectories: ">"}, count=n)
    return [entry_id.decode() for _name, entries in reply for entry_id, _fields in entries]


async def remaining(redis: aioredis.Redis, keys: RedisKeys) -> list[str]:
    entries: Any = await redis.xrange(keys.trajectories)
    return [entry_id.decode() for entry_id, _fields in entries]


async def failures_at_least(trimmer: StreamTrimmer, count: int) -> bool:
    return trimmer.failures >= count


async def test_nothing_is_trimmed_while_there_is_no_consumer_group(
    redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    ids = await add(redis_client, keys, 3)

    result = await StreamTrimmer(redis=redis_client, keys=keys).trim_once()

    assert result.trimmed == 0
    assert await remaining(redis_client, keys) == ids


async def test_without_groups_only_a_configured_max_length_trims(
    redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    ids = await add(redis_client, keys, 5)

    result = await StreamTrimmer(
        redis=redis_client, keys=keys, max_len_without_groups=2
    ).trim_once()

    assert (result.trimmed, result.mode) == (3, "maxlen")
    assert await remaining(redis_client, keys) == ids[3:]


async def test_a_missing_stream_is_not_an_error(
    redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    result = await StreamTrimmer(redis=redis_client, keys=keys).trim_once()

    assert result.trimmed == 0
    assert not await redis_client.exists(keys.trajectories)


async def test_acked_entries_go_and_pending_ones_stay(
    redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    ids = await add(redis_client, keys, 5)
    await redis_client.xgroup_create(keys.trajectories, "ppo", id="0")
    delivered = await read(redis_client, keys, "ppo", "c0", 4)
    await redis_client.xack(keys.trajectories, "ppo", ids[0], ids[2])  # ids[1] still pending

    result = await StreamTrimmer(redis=redis_client, keys=keys).trim_once()

    assert delivered == ids[:4]
    assert (result.trimmed, result.min_id) == (1, ids[1])
    assert await remaining(redis_client, keys) == ids[1:]


async def test_undelivered_entries_stay_even_when_nothing_is_pending(
    redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    ids = await add(redis_client, keys, 4)
    await redis_client.xgroup_create(keys.trajectories, "ppo", id="0")
    await read(redis_client, keys, "ppo", "c0", 2)
    await redis_client.xack(keys.trajectories, "ppo", *ids[:2])

    result = await StreamTrimmer(redis=redis_client, keys=keys).trim_once()

    assert result.trimmed == 2
    assert await remaining(redis_client, keys) == ids[2:]


async def test_the_slowest_group_decides(redis_client: aioredis.Redis, keys: RedisKeys) -> None:
    ids = await add(redis_client, keys, 4)
    for group in ("fast", "slow"):
        await redis_client.xgroup_create(keys.trajectories, group, id="0")
    await read(redis_client, keys, "fast", "c", 4)
    await redis_client.xack(keys.trajectories, "fast", *ids)
    await read(redis_client, keys, "slow", "c", 1)
    await redis_client.xack(keys.trajectories, "slow", ids[0])

    result = await StreamTrimmer(redis=redis_client, keys=keys).trim_once()

    assert result.trimmed == 1
    assert await remaining(redis_client, keys) == ids[1:]


async def test_a_group_that_read_nothing_keeps_everything(
    redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    ids = await add(redis_client, keys, 3)
    await redis_client.xgroup_create(keys.trajectories, "new", id="0")

    result = await StreamTrimmer(redis=redis_client, keys=keys).trim_once()

    assert result.trimmed == 0
    assert await remaining(redis_client, keys) == ids


async def test_the_running_trimmer_trims_periodically_and_stops_on_exit(
    redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    ids = await add(redis_client, keys, 3)
    await redis_client.xgroup_create(keys.trajectories, "ppo", id="0")
    await read(redis_client, keys, "ppo", "c", 3)

    async with StreamTrimmer(redis=redis_client, keys=keys, interval_s=0.05) as trimmer:
        task = trimmer._task
        await redis_client.xack(keys.trajectories, "ppo", *ids)
        await eventually(lambda: redis_client.xlen(keys.trajectories), want=0)

    assert task is not None and task.cancelled()
    assert trimmer.passes >= 1 and trimmer.failures == 0


async def test_a_redis_failure_is_retried_at_the_next_interval(keys: RedisKeys) -> None:
    dead = aioredis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    trimmer = StreamTrimmer(redis=dead, keys=keys, interval_s=0.02)
    try:
        async with trimmer:
            await eventually(lambda: failures_at_least(trimmer, 3), want=True)
            assert trimmer._task is not None and not trimmer._task.done()
    finally:
        await dead.aclose()

    assert trimmer.failures >= 3
