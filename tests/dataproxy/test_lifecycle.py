"""Episode lifecycle against a real Redis: capacity, idle reaper, late rewards, groups, races."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from schema.packing import pack_float32, pack_int32
from services.dataproxy.control import CapacityPolicy, Control
from services.dataproxy.reaper import Reaper
from services.dataproxy.redis_keys import RedisKeys
from services.dataproxy.scripts import Scripts
from services.dataproxy.sessions import EpisodePolicy, SessionStore, StartedSession
from services.runtime.errors import Conflict, TooManyRequests, Unavailable
from services.runtime.keys import key_digest, key_id_of
from services.runtime.secret import Secret
from tests.dataproxy.test_sessions import ADMIN_KEY, chat, decode, stream_entries, turn_record
from tests.harness.poll import eventually

StoreFactory = Callable[..., SessionStore]


@pytest.fixture
def keys(key_prefix: str) -> RedisKeys:
    return RedisKeys(key_prefix)


@pytest.fixture
def make_store(redis_client: aioredis.Redis, keys: RedisKeys) -> StoreFactory:
    def make(
        *,
        refresh_timeout_s: float = 2.0,
        offpolicyness: int | None = None,
        batch_size: int = 1,
        idle_s: float = 3600.0,
        late_reward_s: float = 0.0,
        refresh_lock_s: float | None = None,
    ) -> SessionStore:
        return SessionStore(
            redis=redis_client,
            keys=keys,
            scripts=Scripts.load(),
            admin_key=Secret(ADMIN_KEY),
            refresh_lock_s=refresh_lock_s or refresh_timeout_s + 10,
            policy=EpisodePolicy(
                refresh_timeout_s=refresh_timeout_s,
                capacity=CapacityPolicy(
                    max_head_offpolicyness=offpolicyness, batch_size=batch_size
                ),
                session_idle_timeout_s=idle_s,
                late_reward_timeout_s=late_reward_s,
            ),
        )

    return make


@pytest.fixture
def control(redis_client: aioredis.Redis, keys: RedisKeys) -> Control:
    return Control(redis=redis_client, keys=keys, scripts=Scripts.load(), policy=CapacityPolicy())


async def stats(redis: aioredis.Redis, keys: RedisKeys) -> dict[str, int]:
    raw: Any = await redis.hgetall(keys.stats)
    return {k.decode(): int(v) for k, v in raw.items()}


async def one_turn_episode(store: SessionStore) -> tuple[StartedSession, str]:
    """A new key whose episode holds one recorded turn ("c1"): (its start, its key digest)."""
    started = await store.start(task_id="t", api_key="")
    await chat(store, started.api_key, "c1")
    return started, key_digest(started.api_key)


# -- capacity ----------------------------------------------------------------------------


async def test_capacity_is_unlimited_without_a_bound_or_a_grant(
    make_store: StoreFactory, control: Control
) -> None:
    store = make_store()
    for _ in range(5):
        await store.start(task_id="t", api_key="")
    assert (await control.snapshot()).capacity == -1


async def test_staleness_bound_counts_open_and_published_and_grows_with_the_version(
    make_store: StoreFactory, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    # (0 + version 0 + 1) x 2 = 2 episodes, open or published, until the version moves.
    store = make_store(offpolicyness=0, batch_size=2, refresh_timeout_s=0.3)
    control = Control(
        redis=redis_client,
        keys=keys,
        scripts=Scripts.load(),
        policy=CapacityPolicy(max_head_offpolicyness=0, batch_size=2),
    )
    first = await store.start(task_id="t", api_key="")
    await chat(store, first.api_key, "c1")
    await store.end(key_digest(first.api_key))
    await store.start(task_id="t", api_key="")
    assert (await control.snapshot()).capacity == 0

    with pytest.raises(TooManyRequests) as caught:
        await store.start(task_id="t", api_key="")
    assert "trainer has not caught up" in caught.value.message
    assert caught.value.retry_after_s

    await redis_client.set(keys.weight_version, 1)
    assert (await control.snapshot()).capacity == 2
    await store.start(task_id="t", api_key="")


async def test_a_grant_makes_capacity_finite_and_each_start_takes_one(
    make_store: StoreFactory, control: Control
) -> None:
    store = make_store(refresh_timeout_s=0.2)
    assert await control.grant(2) == 2
    await store.start(task_id="t", api_key="")
    await store.start(task_id="t", api_key="")
    assert (await control.snapshot()).capacity == 0
    with pytest.raises(TooManyRequests):
        await store.start(task_id="t", api_key="")


async def test_a_start_waiting_for_capacity_proceeds_when_a_grant_arrives(
    make_store: StoreFactory, control: Control, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    store = make_store(refresh_timeout_s=10.0)
    await control.grant(0)
    waiting = asyncio.create_task(store.start(task_id="t", api_key=""))
    # The start took its session number: it is in the capacity wait.
    await eventually(lambda: _exists(redis_client, keys.session_seq))
    # A window that proves the start does NOT finish while there is no capacity.
    done, _ = await asyncio.wait({waiting}, timeout=0.2)
    assert not done
    await control.grant(1)
    async with asyncio.timeout(5):
        started = await waiting
    assert started.session_id.startswith("t-")


async def test_refresh_timeout_publishes_the_old_episode_and_the_same_key_works_on_retry(
    make_store: StoreFactory, control: Control, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    store = make_store(refresh_timeout_s=0.3)
    await control.grant(1)
    started, digest = await one_turn_episode(store)

    with pytest.raises(TooManyRequests) as caught:
        await store.start(task_id="", api_key=started.api_key)
    assert "retry with the same api_key" in caught.value.message
    entries = await stream_entries(redis_client, keys)
    assert len(entries) == 1 and decode(entries[0])["end_reason"] == "refresh"
    # Between episodes: chat is 503 (never 401), the key is still known.
    with pytest.raises(Unavailable):
        await store.active_episode(digest)

    await control.grant(1)
    again = await store.start(task_id="", api_key=started.api_key)
    assert again.api_key == started.api_key
    assert not again.refreshed  # nothing was active to end this time
    await chat(store, started.api_key, "c2")
    assert len(await stream_entries(redis_client, keys)) == 1


async def test_a_second_refresh_while_one_waits_for_capacity_gets_429_at_once(
    make_store: StoreFactory, control: Control, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    store = make_store(refresh_timeout_s=5.0)
    await control.grant(1)
    started = await store.start(task_id="t", api_key="")
    waiting = asyncio.create_task(store.start(task_id="", api_key=started.api_key))
    # The refresh holds the marker and has ended the old episode: it waits for capacity.
    digest = key_digest(started.api_key)
    await eventually(lambda: _refresh_waiting(redis_client, keys, digest))
    began = time.monotonic()
    with pytest.raises(TooManyRequests) as caught:
        await store.start(task_id="", api_key=started.api_key)
    assert time.monotonic() - began < 1.0
    assert "already in progress" in caught.value.message
    # Chat during the refresh: between episodes, 503.
    with pytest.raises(Unavailable):
        await store.active_episode(key_digest(started.api_key))
    await control.grant(1)
    async with asyncio.timeout(5):
        assert (await waiting).refreshed


async def test_a_waiting_refresh_keeps_its_short_lived_marker_alive(
    make_store: StoreFactory, control: Control, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    store = make_store(refresh_timeout_s=10.0, refresh_lock_s=0.3)
    await control.grant(1)
    started = await store.start(task_id="t", api_key="")
    waiting = asyncio.create_task(store.start(task_id="", api_key=started.api_key))
    marker = keys.refreshing(key_digest(started.api_key))
    token = await eventually(lambda: redis_client.get(marker), what="the refresh marker")
    # The holder extends the marker every third of its 0.3 s lifetime: nine extensions seen
    # (its TTL going up), the same token at every look, span three lifetimes.
    extensions, last_ttl = 0, await redis_client.pttl(marker)

    async def extended_nine_times() -> bool:
        nonlocal extensions, last_ttl
        assert await redis_client.get(marker) == token, "the marker expired while its holder lived"
        ttl = await redis_client.pttl(marker)
        extensions, last_ttl = extensions + (ttl > last_ttl), ttl
        return extensions >= 9

    await eventually(extended_nine_times, interval_s=0.01, what="nine marker extensions")
    with pytest.raises(TooManyRequests):
        await store.start(task_id="", api_key=started.api_key)
    await control.grant(1)
    async with asyncio.timeout(5):
        await waiting


async def test_a_dead_refreshers_marker_expires_and_the_key_refreshes_again(
    make_store: StoreFactory, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    store = make_store(refresh_lock_s=0.3)
    started = await store.start(task_id="t", api_key="")
    digest = key_digest(started.api_key)
    await redis_client.set(keys.refreshing(digest), "dead-holder", px=300)
    with pytest.raises(TooManyRequests):
        await store.start(task_id="", api_key=started.api_key)
    await eventually(lambda: _refreshed(store, started.api_key))


async def _exists(redis: aioredis.Redis, name: str) -> bool:
    return bool(await redis.exists(name))


async def _refresh_waiting(redis: aioredis.Redis, keys: RedisKeys, digest: str) -> bool:
    state = await redis.hget(keys.key(digest), "state")
    return bool(await redis.exists(keys.refreshing(digest))) and state == b"idle"


async def _refreshed(store: SessionStore, api_key: str) -> bool:
    try:
        await store.start(task_id="", api_key=api_key)
    except TooManyRequests:
        return False
    return True


async def test_concurrent_refreshes_publish_once_and_leave_one_episode_bound(
    make_store: StoreFactory, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    store = make_store()
    started = await store.start(task_id="t", api_key="")
    await chat(store, started.api_key, "c1")
    results = await asyncio.gather(
        *(store.start(task_id="", api_key=started.api_key) for _ in range(8)),
        return_exceptions=True,
    )
    ok = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, TooManyRequests)]
    assert len(ok) + len(refused) == 8 and ok
    entries = await stream_entries(redis_client, keys)
    assert [decode(e)["session_id"] for e in entries] == [started.session_id]
    assert (await stats(redis_client, keys))["open_episodes"] == 1


# -- counters ----------------------------------------------------------------------------


async def test_open_episodes_and_interaction_counters_follow_every_transition(
    make_store: StoreFactory, redis_client: aioredis.Redis, keys: RedisKeys, control: Control
) -> None:
    store = make_store()
    a = await store.start(task_id="t", api_key="")
    b = await store.start(task_id="t", api_key="")
    c = await store.start(task_id="t", api_key="")
    assert (await stats(redis_client, keys))["open_episodes"] == 3
    # a: a1, a2 continuing a1 (joined), a3 a fresh prompt (not joined).
    await chat_tokens(store, a.api_key, "a1", prompt=[1, 2, 3], output=[7, 8])
    await chat_tokens(store, a.api_key, "a2", prompt=[1, 2, 3, 7, 8, 9], output=[10])
    await chat_tokens(store, a.api_key, "a3", prompt=[4], output=[5])
    # c: c1, c2 continuing c1 (joined).
    await chat_tokens(store, c.api_key, "c1", prompt=[1], output=[2])
    await chat_tokens(store, c.api_key, "c2", prompt=[1, 2, 3], output=[4])
    await store.end(key_digest(a.api_key))
    await store.end(key_digest(b.api_key))  # empty: not published
    await store.end(key_digest(c.api_key))
    counters = await stats(redis_client, keys)
    assert counters["open_episodes"] == 0
    assert counters["published"] == 2 and counters["empty_episodes"] == 1
    assert counters["interactions"] == 5 and counters["joined"] == 2
    # joined / (interactions - published): each episode's first interaction has no parent.
    assert (await control.snapshot()).join_rate == pytest.approx(2 / (5 - 2))


async def chat_tokens(
    store: SessionStore, api_key: str, interaction_id: str, *, prompt: list[int], output: list[int]
) -> None:
    """Records one completed turn with these token ids on the key's active episode."""
    episode = await store.active_episode(key_digest(api_key))
    turn = turn_record(interaction_id)
    record = turn.record
    record.prompt_token_ids = pack_int32(prompt)
    record.output_token_ids = pack_int32(output)
    record.output_logprobs = pack_float32([-0.5] * len(output))
    data = turn.encode(weight_version=episode.weight_version, now=time.time())
    await store.append_turn(episode, interaction_id=interaction_id, record=data)


async def _due(redis: aioredis.Redis, zset: str, member: str) -> bool:
    """Whether `member`'s deadline in `zset` has passed (by the clock the reaper claims by)."""
    deadline = await redis.zscore(zset, member)
    assert deadline is not None, f"{member} has no deadline in {zset}"
    return deadline <= time.time()


# -- idle reaper ---------------------------------------------------------------------------


async def test_idle_episode_is_published_by_the_reaper_once_and_the_key_stays_usable(
    make_store: StoreFactory, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    store = make_store(idle_s=0.3)
    started, digest = await one_turn_episode(store)
    member = f"{digest}/{started.session_id}"
    assert await redis_client.zscore(keys.idle, member) is not None

    reapers = [Reaper(store=store, interval_s=0.05) for _ in range(3)]
    await eventually(lambda: _due(redis_client, keys.idle, member))
    swept = await asyncio.gather(*(r.sweep() for r in reapers))
    assert sum(len(s.idle) for s in swept) >= 1
    entries = await stream_entries(redis_client, keys)
    assert len(entries) == 1 and decode(entries[0])["end_reason"] == "idle"
    assert await redis_client.zscore(keys.idle, member) is None
    with pytest.raises(Unavailable):
        await store.active_episode(digest)

    again = await store.start(task_id="", api_key=started.api_key)
    await chat(store, again.api_key, "c2")


async def test_activity_pushes_the_idle_deadline_forward(
    make_store: StoreFactory, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    store = make_store(idle_s=100.0)
    started = await store.start(task_id="t", api_key="")
    member = f"{key_digest(started.api_key)}/{started.session_id}"
    before = await redis_client.zscore(keys.idle, member)
    await chat(store, started.api_key, "c1")
    after = await redis_client.zscore(keys.idle, member)
    assert before is not None and after is not None and after > before


async def test_a_turn_start_holds_the_idle_deadline_until_its_lease_and_never_lowers_it(
    make_store: StoreFactory, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    store = make_store(idle_s=1.0)
    started = await store.start(task_id="t", api_key="")
    digest = key_digest(started.api_key)
    member = f"{digest}/{started.session_id}"
    lease_until = time.time() + 50
    assert await store.begin_turn(digest, session_id="", token="a", lease_until=lease_until)
    assert await redis_client.zscore(keys.idle, member) == pytest.approx(lease_until)
    # A second turn with a shorter lease leaves the later deadline alone.
    assert await store.begin_turn(digest, session_id="", token="b", lease_until=lease_until - 40)
    assert await redis_client.zscore(keys.idle, member) == pytest.approx(lease_until)


async def test_reaper_leaves_an_episode_that_became_active_since_its_deadline_was_set(
    make_store: StoreFactory, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    store = make_store(idle_s=30.0)
    started = await store.start(task_id="t", api_key="")
    member = f"{key_digest(started.api_key)}/{started.session_id}"
    await redis_client.zadd(keys.idle, {member: time.time() - 1})  # a stale deadline
    swept = await Reaper(store=store).sweep()
    assert swept.idle == []
    score = await redis_client.zscore(keys.idle, member)
    assert score is not None and score > time.time() + 20
    await store.active_episode(key_digest(started.api_key))


# -- late rewards --------------------------------------------------------------------------


async def test_late_reward_holds_the_ended_episode_until_its_reward_publishes_it(
    make_store: StoreFactory, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    store = make_store(late_reward_s=30.0)
    started, digest = await one_turn_episode(store)
    ended = await store.end(digest)
    assert ended.status == "held" and ended.interaction_count == 1
    assert await stream_entries(redis_client, keys) == []
    ep = await redis_client.hget(keys.episode(key_id_of(digest), started.session_id), "state")
    assert ep == b"ended_awaiting_reward"

    assert await store.set_reward(digest, reward=0.75, interaction_id="") == "c1"
    entries = await stream_entries(redis_client, keys)
    assert len(entries) == 1
    trajectory = decode(entries[0])
    assert trajectory["final_reward"] == 0.75 and trajectory["end_reason"] == "end_session"
    assert (await stats(redis_client, keys))["open_episodes"] == 0


async def test_a_rewarded_episode_is_published_at_once_even_with_late_rewards_on(
    make_store: StoreFactory, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    store = make_store(late_reward_s=30.0)
    _, digest = await one_turn_episode(store)
    await store.set_reward(digest, reward=1.0, interaction_id="")
    assert (await store.end(digest)).status == "published"


async def test_late_reward_after_a_refresh_names_the_ended_session(
    make_store: StoreFactory, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    store = make_store(late_reward_s=30.0)
    started, digest = await one_turn_episode(store)
    await store.start(task_id="", api_key=started.api_key)  # refresh: E1 held, E2 active
    await chat(store, started.api_key, "c2")
    # Without session_id the reward goes to the active episode (E2).
    await store.set_reward(digest, reward=0.1, interaction_id="")
    assert await stream_entries(redis_client, keys) == []
    await store.set_reward(digest, reward=0.9, interaction_id="", session_id=started.session_id)
    entries = await stream_entries(redis_client, keys)
    assert [decode(e)["session_id"] for e in entries] == [started.session_id]
    assert decode(entries[0])["final_reward"] == 0.9
    with pytest.raises(Conflict):
        await store.set_reward(digest, reward=0.5, interaction_id="", session_id=started.session_id)


async def test_held_episode_is_published_with_reward_zero_after_the_timeout(
    make_store: StoreFactory, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    store = make_store(late_reward_s=0.2)
    started, digest = await one_turn_episode(store)
    await store.end(digest)
    await eventually(
        lambda: _due(redis_client, keys.awaiting_reward, f"{digest}/{started.session_id}")
    )
    swept = await Reaper(store=store).sweep()
    assert [p.status for p in swept.released] == ["published"]
    entries = await stream_entries(redis_client, keys)
    trajectory = decode(entries[0])
    assert trajectory["final_reward"] == 0.0 and trajectory["end_reason"] == "end_session"
    assert not trajectory["interactions"][-1]["reward_set"]
    assert await Reaper(store=store).sweep() == type(swept)(idle=[], released=[])


# -- groups --------------------------------------------------------------------------------


async def test_group_start_binds_g_keys_under_one_group_id(
    make_store: StoreFactory, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    store = make_store()
    started = await store.start(task_id="math", api_key="", group_size=3)
    assert started.group_id.startswith("grp-") and len(started.members) == 3
    assert len({key for _, key in started.members}) == 3
    for session_id, api_key in started.members:
        digest = key_digest(api_key)
        ep: Any = await redis_client.hgetall(keys.episode(key_id_of(digest), session_id))
        assert ep[b"group_id"] == started.group_id.encode() and ep[b"group_size"] == b"3"
    assert (await stats(redis_client, keys))["open_episodes"] == 3
    for index, (_, api_key) in enumerate(started.members[:2]):
        await chat(store, api_key, f"c{index}")
        await store.end(key_digest(api_key))
    await store.end(key_digest(started.members[2][1]))  # empty member
    group: Any = await redis_client.hgetall(keys.group(started.group_id))
    assert group[b"done"] == b"3" and group[b"size"] == b"3"
    trajectory = decode((await stream_entries(redis_client, keys))[0])
    assert trajectory["group_id"] == started.group_id


async def test_a_group_needs_capacity_for_every_member_or_starts_none(
    make_store: StoreFactory, control: Control, redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    store = make_store(refresh_timeout_s=0.2)
    await control.grant(2)
    with pytest.raises(TooManyRequests):
        await store.start(task_id="t", api_key="", group_size=3)
    assert (await stats(redis_client, keys)).get("open_episodes", 0) == 0
    assert (await control.snapshot()).capacity == 2
