"""A worker's `sessions` counts its live affinities: expired ones stop counting, moved ones move."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import redis.asyncio as aioredis

from protos import router_pb2, router_pb2_grpc
from services.router.__main__ import serving
from services.router.settings import RouterSettings
from services.runtime.grpc_client import open_channel
from tests.harness.poll import eventually
from tests.router.test_router_service import RPC_TIMEOUT_S, RunningRouter

# Short enough to watch affinities expire, long enough to route a few sessions before they do.
TINY_AFFINITY_TTL_S = 1.5


@asynccontextmanager
async def router_with_affinity_ttl(
    redis_url: str, prefix: str, *, affinity_ttl_s: float
) -> AsyncIterator[RunningRouter]:
    settings = RouterSettings(
        host="127.0.0.1",
        port=0,
        redis_url=redis_url,
        redis_prefix=prefix,
        affinity_ttl_s=affinity_ttl_s,
        grace_s=0.5,
    )
    async with AsyncExitStack() as stack:
        server = await stack.enter_async_context(serving(settings))
        channel = open_channel(f"127.0.0.1:{server.port}")
        stack.push_async_callback(channel.close)
        yield RunningRouter(server, channel, router_pb2_grpc.RouterStub(channel))


async def session_counts(router: RunningRouter) -> dict[str, int]:
    return {w.worker_id: w.sessions for w in (await router.workers()).values()}


async def test_sessions_whose_affinity_expired_no_longer_count(
    redis_url: str, key_prefix: str, redis_client: aioredis.Redis
) -> None:
    async with router_with_affinity_ttl(
        redis_url, key_prefix, affinity_ttl_s=TINY_AFFINITY_TTL_S
    ) as router:
        await router.register("w1")
        await router.register("w2")
        assert [await router.route(s) for s in ("s1", "s2", "s3")] == ["w1", "w2", "w1"]
        assert await session_counts(router) == {"w1": 2, "w2": 1}
        await eventually(
            lambda: session_counts(router),
            want={"w1": 0, "w2": 0},
            interval_s=0.05,
            what="expired sessions no longer counted",
        )
        assert await redis_client.exists(f"{key_prefix}aff:s1:m") == 0
        # w1 held more sessions once, but none now: the tie breaks on the worker id.
        assert await router.route("s4") == "w1"
        assert await session_counts(router) == {"w1": 1, "w2": 0}


async def test_a_session_in_use_keeps_counting_while_an_unused_one_expires(
    redis_url: str, key_prefix: str
) -> None:
    async with router_with_affinity_ttl(
        redis_url, key_prefix, affinity_ttl_s=TINY_AFFINITY_TTL_S
    ) as router:
        await router.register("w1")
        await router.register("w2")
        assert await router.route("busy") == "w1"
        assert await router.route("quiet") == "w2"

        async def counts() -> dict[str, int]:
            found = await session_counts(router)
            if found != {"w1": 1, "w2": 0}:
                assert found == {"w1": 1, "w2": 1}, found
                # Each use pushes the busy session's expiry (and its last use) forward.
                assert await router.route("busy") == "w1"
            return found

        await eventually(
            counts, want={"w1": 1, "w2": 0}, interval_s=0.05, what="the unused session expires"
        )


async def test_sessions_of_a_deregistered_worker_count_where_they_move(
    redis_url: str, key_prefix: str, redis_client: aioredis.Redis
) -> None:
    async with router_with_affinity_ttl(redis_url, key_prefix, affinity_ttl_s=3600) as router:
        await router.register("w1")
        await router.register("w2")
        assert [await router.route(s) for s in ("a", "b", "c")] == ["w1", "w2", "w1"]
        await router.stub.DeregisterWorker(
            router_pb2.DeregisterWorkerRequest(worker_id="w1"), timeout=RPC_TIMEOUT_S
        )
        assert await redis_client.exists(f"{key_prefix}workers:sessions:w1") == 0
        assert await router.route("a") == "w2"
        assert await session_counts(router) == {"w2": 2}
        assert await router.route("c") == "w2"
        assert await session_counts(router) == {"w2": 3}
        # Back again, w1 starts with no sessions; a relocated session counts on its new worker.
        await router.register("w1")
        assert await session_counts(router) == {"w1": 0, "w2": 3}
        assert await router.route("b", avoid="w2") == "w1"
        assert await session_counts(router) == {"w1": 1, "w2": 2}
        members = await redis_client.zrange(f"{key_prefix}workers:sessions:w2", 0, -1)
        assert sorted(members) == [b"a:m", b"c:m"]
