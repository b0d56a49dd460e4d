"""The Trainer service over a real gRPC server (port 0) and a real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import msgpack
import pytest
import redis.asyncio as aioredis

from protos import trainer_pb2, trainer_pb2_grpc
from rollgate.trainer_client import PulledTrajectory, TrainerClient, TrainerError
from schema.trajectory import CODEC
from services.dataproxy.access_keys import AccessKeyStore
from services.dataproxy.redis_keys import RedisKeys
from services.dataproxy.settings import DataProxySettings
from services.dataproxy.trainer_servicer import TrainerServicer
from services.dataproxy.trajectory import EpisodeInfo, build_trajectory, encode_trajectory
from services.runtime.grpc_client import open_channel
from services.runtime.keys import key_digest
from services.runtime.secret import Secret
from tests.harness.inprocess import serving_trainer
from tests.harness.poll import eventually

ADMIN_KEY = "admin-" + "a" * 32
TRAINER_KEY = "trainer-" + "b" * 32


class Stack:
    """A Trainer server on port 0 over the test's Redis prefix, and what tests need."""

    def __init__(
        self, address: str, servicer: TrainerServicer, keys: RedisKeys, redis: aioredis.Redis
    ) -> None:
        self.address = address
        self.servicer = servicer
        self.keys = keys
        self.redis = redis

    def client(self, key: str = ADMIN_KEY) -> TrainerClient:
        return TrainerClient(self.address, key, timeout_s=5.0)

    async def publish(self, trajectory_id: str | None = None, *, prompt_len: int = 4) -> str:
        """XADDs a trajectory as publication does, and counts it as published."""
        trajectory_id = trajectory_id or uuid.uuid4().hex
        data = encode_trajectory(trajectory(trajectory_id, prompt_len=prompt_len))
        stream_id = await self.redis.xadd(
            self.keys.trajectories, {"trajectory_id": trajectory_id, "codec": CODEC, "data": data}
        )
        await self.redis.hincrby(self.keys.stats, "published", 1)
        return stream_id.decode()


def trajectory(trajectory_id: str, *, prompt_len: int) -> dict[str, object]:
    record = msgpack.packb(
        {
            "interaction_id": f"{trajectory_id}-c1",
            "request_json": b'{"messages": [{"role": "user", "content": "hi"}]}',
            "assistant_message_json": b'{"role": "assistant", "content": "yo"}',
            "prompt_token_ids": struct.pack(f"<{prompt_len}i", *range(prompt_len)),
            "output_token_ids": struct.pack("<2i", 5, 6),
            "output_logprobs": struct.pack("<2f", -0.5, -0.25),
            "exact_tokens": True,
            "weight_version": 1,
        },
        use_bin_type=True,
    )
    info = EpisodeInfo(
        trajectory_id=trajectory_id,
        session_id="task-1",
        task_id="task",
        key_id="k",
        episode="task-1",
        started_at=1.0,
        ended_at=2.0,
        end_reason="end_session",
    )
    return build_trajectory(info, [record], {f"{trajectory_id}-c1": 1.0})


StackFactory = Callable[..., Awaitable[Stack]]


@pytest.fixture
async def make_stack(redis_client: aioredis.Redis, key_prefix: str) -> AsyncIterator[StackFactory]:
    async with contextlib.AsyncExitStack() as servers:

        async def make(
            *, reclaim_idle_s: float = 60.0, redis: aioredis.Redis | None = None
        ) -> Stack:
            redis = redis or redis_client
            keys = RedisKeys(prefix=key_prefix)
            settings = DataProxySettings(
                admin_key=Secret(ADMIN_KEY), trainer_key=Secret(TRAINER_KEY)
            )
            servicer = TrainerServicer(
                redis=redis, keys=keys, settings=settings, reclaim_idle_s=reclaim_idle_s
            )
            address = await servers.enter_async_context(serving_trainer(servicer))
            return Stack(address, servicer, keys, redis)

        yield make


@pytest.fixture
async def stack(make_stack: StackFactory) -> Stack:
    return await make_stack()


async def collect(
    client: TrainerClient,
    group: str,
    consumer: str,
    *,
    max_count: int = 0,
    idle_s: float = 0.5,
    include_history: bool = True,
) -> list[PulledTrajectory]:
    """A pull; these tests publish first, so a new group reads the history unless told."""
    async with asyncio.timeout(30):
        return [
            item
            async for item in client.pull(
                group,
                consumer,
                max_count=max_count,
                idle_timeout_s=idle_s,
                include_history=include_history,
            )
        ]


async def test_a_new_group_reads_from_now_and_include_history_reads_the_whole_stream(
    stack: Stack,
) -> None:
    await stack.publish("old-0")
    await stack.publish("old-1")
    async with stack.client() as tc:
        # A fresh trainer: earlier runs' episodes are not its business.
        assert await collect(tc, "fresh", "c0", include_history=False) == []
        await stack.publish("new-0")
        fresh = await collect(tc, "fresh", "c0", include_history=False)
        # Asked for: the whole stream, from its first entry.
        everything = await collect(tc, "replayer", "c0", include_history=True)
        # An existing group goes on where it was, whatever the flag.
        await stack.publish("new-1")
        later = await collect(tc, "fresh", "c0", include_history=True)
    assert [p.trajectory.trajectory_id for p in fresh] == ["new-0"]
    assert [p.trajectory.trajectory_id for p in everything] == ["old-0", "old-1", "new-0"]
    assert [p.trajectory.trajectory_id for p in later] == ["new-1"]


async def test_on_joined_is_called_once_the_group_exists_so_nothing_after_is_missed(
    stack: Stack,
) -> None:
    joined = asyncio.Event()
    async with stack.client() as tc:
        items: list[PulledTrajectory] = []

        async def read() -> None:
            async for item in tc.pull("joined", "c0", max_count=1, on_joined=joined.set):
                items.append(item)

        reader = asyncio.create_task(read())
        async with asyncio.timeout(10):
            await joined.wait()
        # Published right after the group exists (and before the reader's first read).
        await stack.publish("just-after")
        async with asyncio.timeout(10):
            await reader
    assert [p.trajectory.trajectory_id for p in items] == ["just-after"]


async def test_calls_without_a_key_are_refused_with_an_explanation(stack: Stack) -> None:
    async with open_channel(stack.address) as channel:
        stub = trainer_pb2_grpc.TrainerStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.GetStats(trainer_pb2.GetStatsRequest(), timeout=5)

    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "needs the admin key (or the trainer key)" in (caught.value.details() or "")


async def test_a_wrong_key_is_refused_for_every_method(stack: Stack) -> None:
    async with stack.client("admin-wrong") as tc:
        with pytest.raises(TrainerError) as on_stats:
            await tc.stats()
        with pytest.raises(TrainerError) as on_pull:
            await collect(tc, "g", "c", max_count=1)
        with pytest.raises(TrainerError) as on_ack:
            await tc.ack("g", ["0-1"])
        with pytest.raises(TrainerError) as on_version:
            await tc.set_weight_version(1)

    for caught in (on_stats, on_pull, on_ack, on_version):
        assert caught.value.status == grpc.StatusCode.UNAUTHENTICATED
    assert await stack.redis.get(stack.keys.weight_version) is None


async def test_the_trainer_key_is_accepted_like_the_admin_key(stack: Stack) -> None:
    await stack.publish()
    async with stack.client(TRAINER_KEY) as tc:
        stats = await tc.stats()

    assert stats.published == 1


async def test_pull_delivers_each_published_trajectory_once_in_order(stack: Stack) -> None:
    ids = [f"t{i}" for i in range(3)]
    stream_ids = [await stack.publish(t) for t in ids]

    async with stack.client() as tc:
        pulled = await collect(tc, "ppo", "c0", max_count=5, idle_s=0.5)

    assert [p.trajectory.trajectory_id for p in pulled] == ids
    assert [p.stream_id for p in pulled] == stream_ids
    assert pulled[0].trajectory.interactions[0].output_token_ids == [5, 6]
    assert pulled[0].trajectory.final_reward == 1.0


async def test_pull_stops_after_max_count_without_reading_ahead(stack: Stack) -> None:
    for i in range(3):
        await stack.publish(f"t{i}")

    async with stack.client() as tc:
        pulled = await collect(tc, "ppo", "c0", max_count=2, idle_s=5)
        stats = await tc.stats()

    assert [p.trajectory.trajectory_id for p in pulled] == ["t0", "t1"]
    assert stats.pending == 2


async def test_ack_removes_entries_from_pending_and_counts_them_consumed(stack: Stack) -> None:
    for i in range(2):
        await stack.publish(f"t{i}")

    async with stack.client() as tc:
        pulled = await collect(tc, "ppo", "c0", max_count=2)
        before = await tc.stats()
        acked = await tc.ack("ppo", [p.stream_id for p in pulled])
        again = await tc.ack("ppo", [p.stream_id for p in pulled])
        after = await tc.stats()

    assert (before.pending, before.consumed) == (2, 0)
    assert (acked, again) == (2, 0)
    assert (after.pending, after.consumed, after.published) == (0, 2, 2)
    summary = await stack.redis.xpending(stack.keys.trajectories, "ppo")
    assert summary["pending"] == 0


async def test_a_second_consumer_does_not_get_entries_the_first_took(stack: Stack) -> None:
    for i in range(2):
        await stack.publish(f"t{i}")
    async with stack.client() as tc:
        first = await collect(tc, "ppo", "a", max_count=2)
        await tc.ack("ppo", [first[0].stream_id])  # the other stays pending with "a"

    await stack.publish("t2")
    async with stack.client() as tc:
        second = await collect(tc, "ppo", "b", idle_s=0.5)

    assert [p.trajectory.trajectory_id for p in first] == ["t0", "t1"]
    assert [p.trajectory.trajectory_id for p in second] == ["t2"]


async def test_another_group_sees_the_whole_stream(stack: Stack) -> None:
    for i in range(2):
        await stack.publish(f"t{i}")
    async with stack.client() as tc:
        await tc.ack("ppo", [p.stream_id for p in await collect(tc, "ppo", "a", max_count=2)])
        other = await collect(tc, "eval", "x", idle_s=0.5)

    assert [p.trajectory.trajectory_id for p in other] == ["t0", "t1"]


async def test_unacked_entries_come_back_to_the_same_consumer_on_the_next_pull(
    stack: Stack,
) -> None:
    await stack.publish("t0")
    async with stack.client() as tc:
        first = await collect(tc, "ppo", "a", max_count=1)
    await stack.publish("t1")

    async with stack.client() as fresh:  # a restarted trainer
        again = await collect(fresh, "ppo", "a", idle_s=0.5)

    assert [p.trajectory.trajectory_id for p in first] == ["t0"]
    assert [p.trajectory.trajectory_id for p in again] == ["t0", "t1"]


async def test_a_dead_consumers_pending_entries_are_reclaimed(make_stack: StackFactory) -> None:
    stack = await make_stack(reclaim_idle_s=0.05)
    await stack.publish("t0")
    async with stack.client() as tc:
        assert len(await collect(tc, "ppo", "dead", max_count=1)) == 1

    async with stack.client() as tc:
        reclaimed: list[PulledTrajectory] = await eventually(
            lambda: collect(tc, "ppo", "alive", max_count=1, idle_s=0.2),
            interval_s=0,
            what="t0 reclaimed",
        )

    assert [p.trajectory.trajectory_id for p in reclaimed] == ["t0"]
    consumers = await stack.redis.xinfo_consumers(stack.keys.trajectories, "ppo")
    pending = {c["name"].decode(): c["pending"] for c in consumers}
    assert pending == {"dead": 0, "alive": 1}


async def test_a_trajectory_larger_than_4_mib_arrives(stack: Stack) -> None:
    prompt_len = 1_500_000  # 6 MB of packed prompt ids
    await stack.publish("big", prompt_len=prompt_len)

    async with stack.client() as tc:
        pulled = await collect(tc, "ppo", "c0", max_count=1)

    ids = pulled[0].trajectory.interactions[0].prompt_token_ids
    assert len(ids) == prompt_len
    assert ids[-1] == prompt_len - 1


async def test_a_trajectory_published_twice_is_shown_once_and_the_copy_is_acked(
    stack: Stack,
) -> None:
    await stack.publish("same")
    await stack.publish("same")

    async with stack.client() as tc:
        pulled = await collect(tc, "ppo", "c0", max_count=2)
        stats = await tc.stats()

    assert [p.trajectory.trajectory_id for p in pulled] == ["same"]
    assert stats.pending == 1


async def test_weight_versions_only_move_forward(stack: Stack) -> None:
    async with stack.client() as tc:
        assert await tc.set_weight_version(3) == 3
        assert await tc.set_weight_version(3) == 3
        with pytest.raises(TrainerError) as caught:
            await tc.set_weight_version(2)
        stats = await tc.stats()

    assert caught.value.status == grpc.StatusCode.INVALID_ARGUMENT
    assert "older than the current one (3)" in caught.value.message
    assert "allow_rollback" in caught.value.message  # says how to go back on purpose
    assert await stack.redis.get(stack.keys.weight_version) == b"3"
    assert stats.weight_version == 3


async def test_a_trainer_restarted_from_a_checkpoint_sets_an_older_version_on_purpose(
    stack: Stack,
) -> None:
    async with stack.client() as tc:
        assert await tc.set_weight_version(9) == 9
        # slime restarted from the checkpoint of rollout 4: it says so.
        assert await tc.set_weight_version(4, allow_rollback=True) == 4
        assert (await tc.stats()).weight_version == 4
        # Forward again as usual; a rollback that is not one is just a set.
        assert await tc.set_weight_version(5) == 5
        assert await tc.set_weight_version(6, allow_rollback=True) == 6
        with pytest.raises(TrainerError):
            await tc.set_weight_version(5)
    assert await stack.redis.get(stack.keys.weight_version) == b"6"


async def test_stats_report_the_counters_and_pending_over_all_groups(stack: Stack) -> None:
    for i in range(3):
        await stack.publish(f"t{i}")
    await stack.redis.hincrby(stack.keys.stats, "empty_episodes", 2)

    async with stack.client() as tc:
        empty = await tc.stats()
        await collect(tc, "ppo", "a", max_count=2)
        await collect(tc, "eval", "b", max_count=1)
        stats = await tc.stats()

    assert (empty.published, empty.pending, empty.consumed) == (3, 0, 0)
    assert (stats.published, stats.pending, stats.empty_episodes) == (3, 3, 2)
    assert stats.open_episodes == 0


async def test_pull_ends_after_the_idle_timeout_on_an_empty_stream(stack: Stack) -> None:
    started = time.monotonic()
    async with stack.client() as tc:
        pulled = await collect(tc, "ppo", "c0", idle_s=0.3)

    assert pulled == []
    assert time.monotonic() - started < 5


async def test_pull_waits_for_a_trajectory_published_while_it_runs(stack: Stack) -> None:
    async with stack.client() as tc:
        task = asyncio.create_task(collect(tc, "ppo", "c0", max_count=1, idle_s=10))
        await wait_for_group(stack, "ppo")
        await stack.publish("late")
        pulled = await task

    assert [p.trajectory.trajectory_id for p in pulled] == ["late"]


async def test_closing_the_servicer_ends_open_pulls(stack: Stack) -> None:
    async with stack.client() as tc:
        task = asyncio.create_task(collect(tc, "ppo", "c0"))
        await wait_for_group(stack, "ppo")
        await stack.servicer.close()
        with pytest.raises(TrainerError) as caught:
            await asyncio.wait_for(task, 10)

    assert caught.value.status == grpc.StatusCode.UNAVAILABLE


async def test_pending_entries_trimmed_from_the_stream_are_skipped_and_acked(
    stack: Stack,
) -> None:
    gone = await stack.publish("gone")
    async with stack.client() as tc:
        await collect(tc, "ppo", "a", max_count=1)
    await stack.redis.xdel(stack.keys.trajectories, gone)
    await stack.publish("kept")

    async with stack.client() as fresh:
        again = await collect(fresh, "ppo", "a", idle_s=0.5)

    assert [p.trajectory.trajectory_id for p in again] == ["kept"]
    summary = await stack.redis.xpending(stack.keys.trajectories, "ppo")
    assert summary["pending"] == 1


async def test_an_unreachable_redis_is_reported_as_unavailable(make_stack: StackFactory) -> None:
    dead = aioredis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=1)
    stack = await make_stack(redis=dead)
    async with stack.client() as tc:
        with pytest.raises(TrainerError) as on_stats:
            await tc.stats()
        with pytest.raises(TrainerError) as on_pull:
            await collect(tc, "ppo", "c0", max_count=1)
    await dead.aclose()

    for caught in (on_stats, on_pull):
        assert caught.value.status == grpc.StatusCode.UNAVAILABLE
        assert caught.value.code == "state_store_unavailable"
        assert "state store unavailable" in str(caught.value)
        assert "127.0.0.1" not in str(caught.value) and "ConnectionError" not in str(caught.value)


async def wait_for_group(stack: Stack, group: str) -> None:
    async def exists() -> bool:
        groups = (
            await stack.redis.xinfo_groups(stack.keys.trajectories)
            if await stack.redis.exists(stack.keys.trajectories)
            else []
        )
        return any(g["name"].decode() == group for g in groups)

    await eventually(exists, what=f"group {group}")


async def test_an_open_pull_gets_nothing_more_once_its_issued_key_is_revoked(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(reclaim_idle_s=0.2)
    access = AccessKeyStore(redis=stack.redis, keys=stack.keys)
    trainer_key, _ = await access.issue(kind="trainer", label="leaked")
    digest = key_digest(trainer_key)
    async with stack.client(trainer_key) as tc:
        pulled: list[str] = []

        async def pull() -> None:
            async with asyncio.timeout(30):
                async for item in tc.pull("ppo", "c0", idle_timeout_s=20):
                    pulled.append(item.trajectory.trajectory_id)

        task = asyncio.create_task(pull())
        await wait_for_group(stack, "ppo")
        await stack.publish("before")
        await eventually(lambda: pulled == ["before"], timeout_s=10, what="the first one pulled")
        assert (await access.revoke(digest)) is not None
        await stack.publish("after")
        with pytest.raises(TrainerError) as refused:
            await asyncio.wait_for(task, 20)

    assert refused.value.code == "key_revoked", refused.value
    assert pulled == ["before"], "nothing reaches a revoked key's open pull"
    # The refused entry is still the group's: a consumer with a valid key is handed it.
    async with stack.client(TRAINER_KEY) as tc:
        taken = await collect(tc, "ppo", "c1", max_count=2, idle_s=5)
    assert "after" in [p.trajectory.trajectory_id for p in taken]
