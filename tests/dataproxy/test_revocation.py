"""Revoking keys against a real Redis: a session key's open episodes are discarded, never
published, and every later use is refused as revoked; issued admin and trainer keys."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis

from services.dataproxy.access_keys import AccessKeyStore
from services.dataproxy.redis_keys import RedisKeys
from services.dataproxy.revocation import KeyRevocation, SessionKeyRevoker
from services.dataproxy.scripts import Scripts
from services.dataproxy.sessions import EpisodePolicy, SessionStore
from services.dataproxy.trainer_auth import TrainerAuth
from services.runtime.errors import InvalidRequest, NotFound, Unauthenticated, Unavailable
from services.runtime.keys import key_digest, key_id_of
from services.runtime.secret import Secret
from tests.dataproxy.test_header_mode import begin, record
from tests.dataproxy.test_sessions import chat, stream_entries

ADMIN_KEY = "admin-test-key-0123456789"


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


@pytest.fixture
def revocation(redis_client: aioredis.Redis, keys: RedisKeys) -> KeyRevocation:
    return KeyRevocation(
        sessions=SessionKeyRevoker(redis=redis_client, keys=keys),
        access=AccessKeyStore(redis=redis_client, keys=keys),
    )


async def stats(redis: aioredis.Redis, keys: RedisKeys) -> dict[str, int]:
    raw: dict[bytes, bytes] = await redis.hgetall(keys.stats)  # type: ignore[misc]
    return {k.decode(): int(v) for k, v in raw.items()}


async def assert_revoked(call: Any) -> None:
    with pytest.raises(Unauthenticated) as raised:
        await call
    assert raised.value.code == "key_revoked"
    assert "revoked" in raised.value.message


async def test_revoking_a_session_key_discards_its_open_episode_and_refuses_every_later_use(
    redis_client: aioredis.Redis, keys: RedisKeys, revocation: KeyRevocation
) -> None:
    store = make_store(redis_client, keys)
    started = await store.start(task_id="t", api_key="")
    await chat(store, started.api_key, "c1")
    await chat(store, started.api_key, "c2")
    digest = key_digest(started.api_key)
    key_id = key_id_of(digest)
    assert (await stats(redis_client, keys))["open_episodes"] == 1

    revoked = await revocation.revoke(digest=digest)

    assert (revoked.kind, revoked.key_id, revoked.episodes_discarded) == ("session", key_id, 1)
    assert not revoked.already_revoked
    assert await stream_entries(redis_client, keys) == [], "a revoked episode is never published"
    counters = await stats(redis_client, keys)
    assert counters["open_episodes"] == 0 and counters["revoked_episodes"] == 1
    episode = keys.episode(key_id, started.session_id)
    assert await redis_client.hget(episode, "state") == b"revoked"
    assert await redis_client.hget(episode, "end_reason") == b"revoked"
    for gone in (
        keys.key(digest),
        keys.turns(key_id, started.session_id),
        keys.rewards(key_id, started.session_id),
        keys.interaction_index(key_id, started.session_id),
    ):
        assert not await redis_client.exists(gone)
    assert await redis_client.zscore(keys.idle, f"{digest}/{started.session_id}") is None
    tombstone = await redis_client.hgetall(keys.revoked(digest))  # type: ignore[misc]
    assert tombstone[b"key_id"] == key_id.encode() and tombstone[b"kind"] == b"session"

    await assert_revoked(store.resolve(digest))
    await assert_revoked(store.active_episode(digest))
    await assert_revoked(store.begin_turn(digest, session_id="", token="t", lease_until=1e12))
    await assert_revoked(store.set_reward(digest, reward=1.0, interaction_id=""))
    await assert_revoked(store.end(digest))
    await assert_revoked(store.history(digest))
    # A refresh with the revoked key is refused: it does not mint a replacement.
    await assert_revoked(store.start(task_id="t", api_key=started.api_key))

    again = await revocation.revoke(digest=digest)
    assert again.already_revoked and again.episodes_discarded == 0 and again.kind == "session"


async def test_a_never_issued_key_is_unknown_not_revoked(
    redis_client: aioredis.Redis, keys: RedisKeys, revocation: KeyRevocation
) -> None:
    store = make_store(redis_client, keys)
    digest = key_digest("sk-sess-" + "x" * 43)
    with pytest.raises(Unauthenticated) as raised:
        await store.resolve(digest)
    assert raised.value.code == "invalid_api_key" and "unknown session key" in raised.value.message
    with pytest.raises(NotFound) as missing:
        await revocation.revoke(digest=digest)
    assert missing.value.code == "key_not_found"
    with pytest.raises(NotFound):
        await revocation.revoke(key_id="0" * 24)
    with pytest.raises(InvalidRequest):
        await revocation.revoke(key_id="not-hex")


async def test_revoking_a_header_mode_key_discards_every_open_session_and_blocks_new_ones(
    redis_client: aioredis.Redis, keys: RedisKeys, revocation: KeyRevocation
) -> None:
    store = make_store(redis_client, keys)
    issued = await store.issue_key(task_id="claw")
    digest = key_digest(issued.api_key)
    for n in range(3):
        await record(store, await begin(store, digest, f"s{n}", f"tok{n}"), f"c{n}")
    # A turn that began before the revocation: its append finds the episode gone.
    running = await begin(store, digest, "s0", "late")
    assert (await stats(redis_client, keys))["open_episodes"] == 3

    revoked = await revocation.revoke(key_id=issued.key_id)

    assert (revoked.kind, revoked.episodes_discarded) == ("header", 3)
    assert await stream_entries(redis_client, keys) == []
    assert (await stats(redis_client, keys))["open_episodes"] == 0
    for n in range(3):
        pointer = await redis_client.hget(keys.session(issued.key_id, f"s{n}"), "episode")
        assert pointer == b""
    assert await redis_client.hlen(keys.episode_turns) == 0
    with pytest.raises(Unavailable) as late:
        await record(store, running, "late-1")
    assert late.value.code == "episode_ended"
    assert await redis_client.zcard(keys.in_flight) == 0, "the late turn's lease is released"
    await assert_revoked(store.begin_turn(digest, session_id="new", token="n", lease_until=1e12))
    await assert_revoked(store.set_reward(digest, reward=1.0, interaction_id="", session_id="s1"))


async def test_an_episode_held_for_a_late_reward_is_discarded_too(
    redis_client: aioredis.Redis, keys: RedisKeys, revocation: KeyRevocation
) -> None:
    store = make_store(redis_client, keys, late_reward_timeout_s=30.0)
    started = await store.start(task_id="t", api_key="")
    await chat(store, started.api_key, "c1")
    digest = key_digest(started.api_key)
    assert (await store.end(digest)).status == "held"

    revoked = await revocation.revoke(digest=digest)

    assert revoked.episodes_discarded == 1
    assert await redis_client.zcard(keys.awaiting_reward) == 0
    assert await stream_entries(redis_client, keys) == []
    assert (await stats(redis_client, keys))["open_episodes"] == 0


async def test_a_revoked_group_member_counts_as_done_and_the_others_publish(
    redis_client: aioredis.Redis, keys: RedisKeys, revocation: KeyRevocation
) -> None:
    store = make_store(redis_client, keys)
    started = await store.start(task_id="math", api_key="", group_size=2)
    (_, first), (_, second) = started.members
    await chat(store, first, "a1")
    await chat(store, second, "b1")

    await revocation.revoke(digest=key_digest(first))
    await store.end(key_digest(second))

    group = await redis_client.hgetall(keys.group(started.group_id))  # type: ignore[misc]
    assert group[b"done"] == b"2" and group[b"size"] == b"2"
    assert len(await stream_entries(redis_client, keys)) == 1


async def test_issued_admin_and_trainer_keys_are_stored_as_digests_and_revoked_at_once(
    redis_client: aioredis.Redis, keys: RedisKeys, revocation: KeyRevocation
) -> None:
    access = AccessKeyStore(redis=redis_client, keys=keys)
    admin_key, admin = await access.issue(kind="admin", label="ci runner")
    trainer_key, trainer = await access.issue(kind="trainer")
    assert admin_key.startswith("sk-admin-") and trainer_key.startswith("sk-trainer-")
    stored = await redis_client.hgetall(keys.access_keys)  # type: ignore[misc]
    assert set(stored) == {key_digest(admin_key).encode(), key_digest(trainer_key).encode()}
    assert all(k.encode() not in b"".join(stored.values()) for k in (admin_key, trainer_key))
    assert [(i.kind, i.label) for i in await access.list()] == [
        ("admin", "ci runner"),
        ("trainer", ""),
    ]
    assert await access.lookup(key_digest(admin_key)) == "admin"
    assert await access.lookup(key_digest("sk-admin-" + "y" * 43)) == ""

    auth = TrainerAuth(admin_key=Secret(ADMIN_KEY), lookup=access.lookup)
    await auth.check([("authorization", f"Bearer {trainer_key}")])
    await auth.check([("authorization", f"Bearer {admin_key}")])
    await auth.check([("authorization", f"Bearer {ADMIN_KEY}")])

    revoked = await revocation.revoke(key_id=trainer.key_id)
    assert (revoked.kind, revoked.key_id, revoked.already_revoked) == (
        "trainer",
        trainer.key_id,
        False,
    )
    assert await access.lookup(key_digest(trainer_key)) == "revoked"
    with pytest.raises(Unauthenticated) as refused:
        await auth.check([("authorization", f"Bearer {trainer_key}")])
    assert refused.value.code == "key_revoked"
    await auth.check([("authorization", f"Bearer {admin_key}")])
    assert [i.key_id for i in await access.list()] == [admin.key_id]
    again = await revocation.revoke(key_id=trainer.key_id)
    assert again.already_revoked and again.kind == "trainer"
    with pytest.raises(InvalidRequest):
        await access.issue(kind="session")


async def test_a_header_episode_bound_while_the_revocation_ran_is_swept_too(
    redis_client: aioredis.Redis, keys: RedisKeys
) -> None:
    store = make_store(redis_client, keys)
    issued = await store.issue_key()
    digest = key_digest(issued.api_key)
    await record(store, await begin(store, digest, "early", "t1"), "c1")
    revoker = SessionKeyRevoker(redis=redis_client, keys=keys)
    found = await revoker._open_episodes(digest)
    # Another replica binds a session between the sweep and the script.
    await record(store, await begin(store, digest, "racing", "t2"), "c2")
    first = await revoker._run(digest, found)
    assert first is not None and first.episodes_discarded == 1
    assert await revoker._open_episodes(digest) == {"racing"}

    revoked = await revoker.revoke(digest)

    assert revoked is not None and revoked.already_revoked and revoked.episodes_discarded == 1
    assert await revoker._open_episodes(digest) == set()
    assert (await stats(redis_client, keys))["open_episodes"] == 0
