"""The session store against a real Redis: start, refresh, publication, rewards, end."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import msgpack  # type: ignore[import-untyped]
import orjson
import pytest
import redis.asyncio as aioredis

from schema.packing import unpack_float32, unpack_int32
from services.dataproxy.redis_keys import RedisKeys
from services.dataproxy.scripts import Publish, PublishCall, Scripts
from services.dataproxy.sessions import ActiveEpisode, KeyState, SessionStore
from services.runtime.errors import (
    Conflict,
    InvalidRequest,
    NotFound,
    TooManyRequests,
    Unauthenticated,
    Unavailable,
)
from services.runtime.keys import key_digest, key_id_of, looks_like_session_key
from services.runtime.secret import Secret
from tests.dataproxy.turn_records import WithRequest
from tests.dataproxy.turn_records import turn_record as packed_record

ADMIN_KEY = "admin-test-key-0123456789"


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
    )


def turn_record(interaction_id: str, text: str = "hello") -> WithRequest:
    rec = packed_record(
        interaction_id=interaction_id,
        upstream_model="mock",
        finish_reason="stop",
        prompt_token_ids=[1, 2, 3],
        output_token_ids=[7, 8],
        output_logprobs=[-0.5, -0.25],
        exact_tokens=True,
        assistant_message_json=orjson.dumps({"role": "assistant", "content": text}),
        usage_json=b'{"prompt_tokens": 3, "completion_tokens": 2}',
        latency_s=0.1,
        ttft_s=0.05,
        upstream_kind="vllm",
        started_at_unix_s=time.time(),
    )
    return WithRequest(rec, orjson.dumps({"messages": [{"role": "user", "content": text}]}))


async def chat(store: SessionStore, api_key: str, interaction_id: str) -> ActiveEpisode:
    """Records one completed turn on the key's active episode, as the chat path does."""
    episode = await store.active_episode(key_digest(api_key))
    data = turn_record(interaction_id).encode(
        weight_version=episode.weight_version, now=time.time()
    )
    await store.append_turn(episode, interaction_id=interaction_id, record=data)
    return episode


async def stream_entries(redis: aioredis.Redis, keys: RedisKeys) -> list[dict[bytes, bytes]]:
    entries: Any = await redis.xrange(keys.trajectories)
    return [fields for _id, fields in entries]


async def stored_bytes(redis: aioredis.Redis, name: bytes) -> bytes:
    """Everything a hash, list, zset or string key holds, concatenated."""
    kind = await redis.type(name)
    if kind == b"zset":
        members: Any = await redis.zrange(name, 0, -1)
        return b"".join(members)
    if kind == b"hash":
        fields: Any = await redis.hgetall(name)
        return b"".join(bytes(k) + bytes(v) for k, v in fields.items())
    if kind == b"list":
        items: Any = await redis.lrange(name, 0, -1)
        return b"".join(items)
    value: Any = await redis.get(name)
    return bytes(value or b"")


def decode(entry: dict[bytes, bytes]) -> dict[str, Any]:
    trajectory: dict[str, Any] = msgpack.unpackb(entry[b"data"], raw=False)
    return trajectory


async def test_start_session_mints_a_key_and_stores_only_its_digest(
    store: SessionStore, redis_client: aioredis.Redis, keys: RedisKeys, key_prefix: str
) -> None:
    started = await store.start(task_id="", api_key="")
    await chat(store, started.api_key, "chatcmpl-1")

    assert looks_like_session_key(started.api_key)
    assert started.session_id.startswith("default-")
    assert not started.refreshed
    digest = key_digest(started.api_key)
    key_hash = await redis_client.hgetall(keys.key(digest))
    assert key_hash[b"key_id"] == key_id_of(digest).encode()
    assert key_hash[b"state"] == b"active"
    assert key_hash[b"episode"] == started.session_id.encode()
    raw_key = started.api_key.encode()
    names = [name async for name in redis_client.scan_iter(match=f"{key_prefix}*")]
    assert names, "the session left nothing in Redis"
    for name in names:
        assert raw_key not in name
        assert raw_key not in await stored_bytes(redis_client, name), (
            f"the raw key is stored in {name!r}"
        )


async def test_session_ids_count_up_per_task(store: SessionStore) -> None:
    first = await store.start(task_id="math", api_key="")
    second = await store.start(task_id="math", api_key="")

    prefix, n1 = first.session_id.rsplit("-", 1)
    _, n2 = second.session_id.rsplit("-", 1)
    assert prefix == "math"
    assert int(n2) == int(n1) + 1


async def test_refresh_without_a_task_id_keeps_the_keys_task(store: SessionStore) -> None:
    first = await store.start(task_id="math", api_key="")

    same_task = await store.start(task_id="", api_key=first.api_key)
    other_task = await store.start(task_id="code", api_key=first.api_key)

    assert same_task.session_id.startswith("math-")
    assert other_task.session_id.startswith("code-")


async def test_unknown_api_key_is_replaced_by_a_new_key(store: SessionStore) -> None:
    made_up = "sk-sess-" + "x" * 43

    started = await store.start(task_id="t", api_key=made_up)

    assert started.api_key != made_up
    assert looks_like_session_key(started.api_key)
    assert not started.refreshed
    with pytest.raises(Unauthenticated):
        await store.resolve(key_digest(made_up))


async def test_admin_key_is_refused_as_a_session_key(store: SessionStore) -> None:
    with pytest.raises(InvalidRequest, match="admin key"):
        await store.start(task_id="t", api_key=ADMIN_KEY)


async def test_refresh_publishes_the_episode_with_its_turns_and_reward_and_keeps_the_key(
    store: SessionStore, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    first = await store.start(task_id="t", api_key="")
    episode = await chat(store, first.api_key, "chatcmpl-a")
    await chat(store, first.api_key, "chatcmpl-b")
    await store.set_reward(key_digest(first.api_key), reward=0.75, interaction_id="")

    refreshed = await store.start(task_id="t", api_key=first.api_key)

    assert refreshed.api_key == first.api_key
    assert refreshed.refreshed
    assert refreshed.session_id != first.session_id
    entries = await stream_entries(redis_client, keys)
    assert len(entries) == 1
    assert entries[0][b"codec"] == b"msgpack"
    assert entries[0][b"trajectory_id"] == refreshed.ended_trajectory_id.encode()
    trajectory = decode(entries[0])
    assert trajectory["session_id"] == first.session_id
    assert trajectory["end_reason"] == "refresh"
    assert trajectory["key_id"] == key_id_of(key_digest(first.api_key))
    interactions = trajectory["interactions"]
    assert [i["interaction_id"] for i in interactions] == ["chatcmpl-a", "chatcmpl-b"]
    assert [i["reward"] for i in interactions] == [0.0, 0.75]
    assert unpack_int32(interactions[0]["output_token_ids"]) == [7, 8]
    assert unpack_float32(interactions[0]["output_logprobs"]) == [-0.5, -0.25]
    # The same key is bound to a fresh, empty episode; the old one's data is gone.
    key = await store.resolve(key_digest(first.api_key))
    assert key.active
    assert key.episode == refreshed.session_id
    assert await redis_client.exists(keys.turns(episode.key_id, episode.episode)) == 0
    old = await redis_client.hgetall(keys.episode(episode.key_id, episode.episode))
    assert old[b"state"] == b"published"
    assert await redis_client.ttl(keys.episode(episode.key_id, episode.episode)) > 0
    assert (await store.history(key_digest(first.api_key))).entries == []


async def test_refresh_of_an_empty_episode_publishes_nothing_and_counts_it(
    store: SessionStore, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    first = await store.start(task_id="t", api_key="")

    refreshed = await store.start(task_id="t", api_key=first.api_key)

    assert refreshed.refreshed
    assert refreshed.ended_trajectory_id == ""
    assert await redis_client.xlen(keys.trajectories) == 0
    stats = await redis_client.hgetall(keys.stats)
    assert stats[b"empty_episodes"] == b"1"
    assert b"published" not in stats


async def test_publication_retried_after_success_adds_no_second_entry(
    store: SessionStore, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    started = await store.start(task_id="t", api_key="")
    await chat(store, started.api_key, "chatcmpl-1")
    key = await store.resolve(key_digest(started.api_key))

    first = await store.publish(key, end_reason="end_session")
    retried = await store.publish(key, end_reason="end_session")

    assert first.status == retried.status == "published"
    assert retried.stream_id == first.stream_id
    assert retried.trajectory_id == first.trajectory_id
    assert retried.interaction_count == 1
    assert await redis_client.xlen(keys.trajectories) == 1
    assert await redis_client.hget(keys.stats, "published") == b"1"


async def test_publish_script_refuses_when_a_turn_landed_since_the_read(
    store: SessionStore, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    started = await store.start(task_id="t", api_key="")
    await chat(store, started.api_key, "chatcmpl-1")
    key = await store.resolve(key_digest(started.api_key))
    scripts = Scripts.load()

    # As if the publisher had read the episode before its one turn landed.
    result = await scripts.publish.run(
        redis_client,
        PublishCall(
            key=keys.key(key.digest),
            episode_hash=keys.episode(key.key_id, key.episode),
            turns=keys.turns(key.key_id, key.episode),
            rewards=keys.rewards(key.key_id, key.episode),
            interaction_index=keys.interaction_index(key.key_id, key.episode),
            trajectories=keys.trajectories,
            stats=keys.stats,
            idle=keys.idle,
            awaiting_reward=keys.awaiting_reward,
            trajectory_group=keys.trajectory_group("traj-x"),
            group=keys.stats,
            session=keys.stats,
            episode_turns=keys.episode_turns,
            recent_trajectories=keys.recent_trajectories,
            episode=key.episode,
            epoch=key.epoch,
            turn_count=0,
            trajectory_id="traj-x",
            codec="msgpack",
            data=b"",
            now=0.0,
            end_reason="end_session",
            ttl_s=60,
            member=f"{key.digest}/{key.episode}",
            interactions=0,
            joined=0,
            hold_until=0.0,
            group_id="",
            group_size=0,
            mode=key.mode,
            summary=b"",
            recent_kept=1,
        ),
    )

    assert result.status is Publish.RETRY
    assert await redis_client.xlen(keys.trajectories) == 0
    assert (await store.resolve(key.digest)).active
    # The store's own publication re-reads and succeeds.
    ended = await store.end(key.digest)
    assert ended.interaction_count == 1


async def test_publication_of_a_superseded_episode_is_refused(store: SessionStore) -> None:
    started = await store.start(task_id="t", api_key="")
    old = await store.resolve(key_digest(started.api_key))
    await store.start(task_id="t", api_key=started.api_key)
    # An episode that never existed under this key (wrong epoch) is not published.
    stale = KeyState(
        digest=old.digest, key_id=old.key_id, active=True, episode="t-missing", epoch=old.epoch
    )

    with pytest.raises(Conflict):
        await store.publish(stale, end_reason="end_session")


async def test_concurrent_refreshes_of_one_key_publish_each_episode_once(
    store: SessionStore, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    started = await store.start(task_id="t", api_key="")
    await chat(store, started.api_key, "chatcmpl-1")

    results = await asyncio.gather(
        *(store.start(task_id="t", api_key=started.api_key) for _ in range(4)),
        return_exceptions=True,
    )

    successes = [r for r in results if not isinstance(r, BaseException)]
    failures = [r for r in results if isinstance(r, BaseException)]
    assert successes, results
    assert all(isinstance(f, TooManyRequests) for f in failures), failures
    assert all(f.retry_after_s == 1.0 for f in failures if isinstance(f, TooManyRequests))
    assert all(s.api_key == started.api_key for s in successes)
    entries = await stream_entries(redis_client, keys)
    assert len(entries) == 1
    assert decode(entries[0])["session_id"] == started.session_id
    assert sum(1 for s in successes if s.ended_trajectory_id) == 1
    key = await store.resolve(key_digest(started.api_key))
    assert key.active
    assert await redis_client.exists(keys.refreshing(key.digest)) == 0


async def test_a_second_refresh_while_one_runs_gets_too_many_requests(
    store: SessionStore, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    started = await store.start(task_id="t", api_key="")
    await redis_client.set(keys.refreshing(key_digest(started.api_key)), "other", ex=30)

    with pytest.raises(TooManyRequests, match="already in progress") as caught:
        await store.start(task_id="t", api_key=started.api_key)

    assert caught.value.retry_after_s == 1.0
    assert (await store.resolve(key_digest(started.api_key))).episode == started.session_id


async def test_turn_appended_after_its_episode_ended_is_rejected_and_absent_from_the_next(
    store: SessionStore, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    started = await store.start(task_id="t", api_key="")
    running = await store.active_episode(key_digest(started.api_key))
    await store.start(task_id="t", api_key=started.api_key)
    late = turn_record("chatcmpl-late").encode(weight_version=0, now=time.time())

    with pytest.raises(Unavailable, match="episode ended while this turn") as caught:
        await store.append_turn(running, interaction_id="chatcmpl-late", record=late)

    assert caught.value.code == "episode_ended"
    current = await store.resolve(key_digest(started.api_key))
    assert await redis_client.llen(keys.turns(current.key_id, current.episode)) == 0
    assert await redis_client.llen(keys.turns(running.key_id, running.episode)) == 0
    ended = await store.end(key_digest(started.api_key))
    assert ended.interaction_count == 0
    assert await redis_client.xlen(keys.trajectories) == 0


async def test_retried_append_of_the_same_interaction_records_it_once(
    store: SessionStore, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    started = await store.start(task_id="t", api_key="")
    episode = await chat(store, started.api_key, "chatcmpl-1")
    data = turn_record("chatcmpl-1").encode(weight_version=0, now=time.time())

    index = await store.append_turn(episode, interaction_id="chatcmpl-1", record=data)

    assert index == 0
    assert await redis_client.llen(keys.turns(episode.key_id, episode.episode)) == 1


async def test_set_reward_without_an_id_rewards_the_last_interaction(
    store: SessionStore,
) -> None:
    started = await store.start(task_id="t", api_key="")
    await chat(store, started.api_key, "chatcmpl-1")
    await chat(store, started.api_key, "chatcmpl-2")

    rewarded = await store.set_reward(key_digest(started.api_key), reward=1.0, interaction_id="")

    assert rewarded == "chatcmpl-2"


async def test_set_reward_names_an_earlier_interaction_and_last_write_wins(
    store: SessionStore, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    started = await store.start(task_id="t", api_key="")
    digest = key_digest(started.api_key)
    await chat(store, started.api_key, "chatcmpl-1")
    await chat(store, started.api_key, "chatcmpl-2")

    await store.set_reward(digest, reward=0.1, interaction_id="chatcmpl-1")
    await store.set_reward(digest, reward=-2.5, interaction_id="chatcmpl-1")
    await store.end(digest)

    (entry,) = await stream_entries(redis_client, keys)
    rewards = {i["interaction_id"]: i["reward"] for i in decode(entry)["interactions"]}
    assert rewards == {"chatcmpl-1": -2.5, "chatcmpl-2": 0.0}


async def test_set_reward_for_an_unknown_interaction_is_not_found(store: SessionStore) -> None:
    started = await store.start(task_id="t", api_key="")
    await chat(store, started.api_key, "chatcmpl-1")

    with pytest.raises(NotFound, match="interaction chatcmpl-nope not found"):
        await store.set_reward(
            key_digest(started.api_key), reward=1.0, interaction_id="chatcmpl-nope"
        )


@pytest.mark.parametrize("reward", [math.nan, math.inf, -math.inf])
async def test_set_reward_refuses_non_finite_rewards(store: SessionStore, reward: float) -> None:
    started = await store.start(task_id="t", api_key="")
    await chat(store, started.api_key, "chatcmpl-1")

    with pytest.raises(InvalidRequest, match="finite"):
        await store.set_reward(key_digest(started.api_key), reward=reward, interaction_id="")


async def test_set_reward_before_any_chat_is_a_conflict(store: SessionStore) -> None:
    started = await store.start(task_id="t", api_key="")

    with pytest.raises(Conflict, match="no completed interaction yet"):
        await store.set_reward(key_digest(started.api_key), reward=1.0, interaction_id="")


async def test_end_session_publishes_and_leaves_the_key_between_episodes(
    store: SessionStore, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    started = await store.start(task_id="t", api_key="")
    digest = key_digest(started.api_key)
    await chat(store, started.api_key, "chatcmpl-1")

    ended = await store.end(digest)

    assert ended.session_id == started.session_id
    assert ended.interaction_count == 1
    (entry,) = await stream_entries(redis_client, keys)
    assert entry[b"trajectory_id"] == ended.trajectory_id.encode()
    assert decode(entry)["end_reason"] == "end_session"
    # A retried end (its reply was lost) gets the same publication; nothing is published twice.
    retried = await store.end(digest)
    assert retried == ended
    assert len(await stream_entries(redis_client, keys)) == 1
    with pytest.raises(Conflict, match="no active episode on this key"):
        await store.set_reward(digest, reward=1.0, interaction_id="")
    with pytest.raises(Unavailable) as caught:
        await store.active_episode(digest)
    assert caught.value.code == "episode_not_active"
    assert caught.value.retry_after_s == 1.0
    # The key stays valid: start_session with it starts the next episode.
    again = await store.start(task_id="t", api_key=started.api_key)
    assert again.api_key == started.api_key
    assert not again.refreshed
    assert (await store.active_episode(digest)).episode == again.session_id


async def test_unknown_key_is_unauthenticated_everywhere(store: SessionStore) -> None:
    digest = key_digest("sk-sess-" + "y" * 43)

    with pytest.raises(Unauthenticated):
        await store.end(digest)
    with pytest.raises(Unauthenticated):
        await store.set_reward(digest, reward=1.0, interaction_id="")
    with pytest.raises(Unauthenticated, match="unknown session key"):
        await store.active_episode(digest)
    with pytest.raises(Unauthenticated):
        await store.history(digest)


async def test_history_lists_the_current_episodes_interactions_with_rewards(
    store: SessionStore,
) -> None:
    started = await store.start(task_id="t", api_key="")
    digest = key_digest(started.api_key)
    await chat(store, started.api_key, "chatcmpl-1")
    await chat(store, started.api_key, "chatcmpl-2")
    await store.set_reward(digest, reward=0.5, interaction_id="chatcmpl-1")

    history = await store.history(digest)

    assert history.session_id == started.session_id
    assert [iid for iid, _ in history.entries] == ["chatcmpl-1", "chatcmpl-2"]
    first = orjson.loads(history.entries[0][1])
    assert first["request"]["messages"][0]["role"] == "user"
    assert first["output_message"] == {"role": "assistant", "content": "hello"}
    assert first["reward"] == 0.5
    assert orjson.loads(history.entries[1][1])["reward"] is None


async def test_scripts_fall_back_to_eval_when_redis_forgot_them(
    store: SessionStore, redis_client: aioredis.Redis
) -> None:
    await redis_client.script_flush()

    started = await store.start(task_id="t", api_key="")

    assert (await store.resolve(key_digest(started.api_key))).active
