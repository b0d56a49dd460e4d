"""The Router gRPC service in-process, on port 0, against the real test Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import grpc
import msgpack  # type: ignore[import-untyped]
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import router_pb2, router_pb2_grpc
from services.router.__main__ import SERVICE_NAME, serving
from services.router.settings import RouterSettings
from services.runtime.errors import NotFound, Unavailable, from_rpc_error
from services.runtime.grpc_client import open_channel
from services.runtime.grpc_server import GrpcServer
from tests.harness.poll import eventually

RPC_TIMEOUT_S = 5.0


@dataclass
class RunningRouter:
    server: GrpcServer
    channel: grpc.aio.Channel
    stub: router_pb2_grpc.RouterStub

    async def register(self, worker_id: str, models: Sequence[str] = ("m",)) -> None:
        await self.stub.RegisterWorker(
            router_pb2.RegisterWorkerRequest(
                worker_id=worker_id, address=f"{worker_id}.local:7000", models=list(models)
            ),
            timeout=RPC_TIMEOUT_S,
        )

    async def heartbeat(self, worker_id: str, in_flight: int = 0) -> bool:
        reply = await self.stub.Heartbeat(
            router_pb2.HeartbeatRequest(worker_id=worker_id, in_flight=in_flight),
            timeout=RPC_TIMEOUT_S,
        )
        return bool(reply.known)

    async def route(self, session: str, model: str = "m", avoid: str = "") -> str:
        reply = await self.stub.Route(
            router_pb2.RouteRequest(session=session, model=model, avoid_worker_id=avoid),
            timeout=RPC_TIMEOUT_S,
        )
        assert reply.address == f"{reply.worker_id}.local:7000"
        return str(reply.worker_id)

    async def workers(self) -> dict[str, router_pb2.WorkerInfo]:
        reply = await self.stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=RPC_TIMEOUT_S)
        return {w.worker_id: w for w in reply.workers}


@asynccontextmanager
async def running_router(
    redis_url: str, prefix: str, *, lease_s: float = 6.0, heartbeat_interval_s: float = 1.0
) -> AsyncIterator[RunningRouter]:
    settings = RouterSettings(
        host="127.0.0.1",
        port=0,
        redis_url=redis_url,
        redis_prefix=prefix,
        lease_s=lease_s,
        heartbeat_interval_s=heartbeat_interval_s,
        grace_s=0.5,
    )
    async with AsyncExitStack() as stack:
        server = await stack.enter_async_context(serving(settings))
        channel = open_channel(f"127.0.0.1:{server.port}")
        stack.push_async_callback(channel.close)
        yield RunningRouter(server, channel, router_pb2_grpc.RouterStub(channel))


@pytest.fixture
async def router(redis_url: str, key_prefix: str) -> AsyncIterator[RunningRouter]:
    async with running_router(redis_url, key_prefix) as running:
        yield running


async def rpc_error(call: Awaitable[object]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


async def test_register_returns_the_heartbeat_interval_and_lease(router: RunningRouter) -> None:
    reply = await router.stub.RegisterWorker(
        router_pb2.RegisterWorkerRequest(worker_id="w1", address="w1.local:7000", models=["m"]),
        timeout=RPC_TIMEOUT_S,
    )
    assert (reply.heartbeat_interval_s, reply.lease_s) == (1.0, 6.0)


async def test_a_registered_worker_is_known_to_heartbeat_and_gets_routed(
    router: RunningRouter,
) -> None:
    await router.register("w1")
    assert await router.heartbeat("w1", in_flight=2)
    assert await router.route("session-a") == "w1"


async def test_the_same_session_stays_on_its_worker_even_when_it_gets_busier(
    router: RunningRouter,
) -> None:
    await router.register("w1")
    await router.register("w2")
    first = await router.route("session-a")
    await router.heartbeat(first, in_flight=50)
    for _ in range(3):
        assert await router.route("session-a") == first
    # A new session, by contrast, goes to the idle worker.
    assert await router.route("session-b") != first


async def test_stickiness_is_per_model(router: RunningRouter) -> None:
    await router.register("w1", models=())
    await router.register("w2", models=())
    assert await router.route("session-a", model="m1") == "w1"
    assert await router.route("session-a", model="m2") == "w2"
    assert await router.route("session-a", model="m1") == "w1"


async def test_a_new_session_gets_the_least_loaded_live_worker(router: RunningRouter) -> None:
    for worker_id, in_flight in (("w1", 3), ("w2", 1), ("w3", 2)):
        await router.register(worker_id)
        await router.heartbeat(worker_id, in_flight=in_flight)
    assert await router.route("session-new") == "w2"


async def test_new_sessions_spread_over_equally_busy_workers(router: RunningRouter) -> None:
    await router.register("w1")
    await router.register("w2")
    chosen = [await router.route(f"session-{i}") for i in range(4)]
    assert chosen == ["w1", "w2", "w1", "w2"]
    sessions = {w.worker_id: w.sessions for w in (await router.workers()).values()}
    assert sessions == {"w1": 2, "w2": 2}


async def test_two_routers_sharing_redis_agree_on_every_session(
    redis_url: str, key_prefix: str
) -> None:
    async with (
        running_router(redis_url, key_prefix) as a,
        running_router(redis_url, key_prefix) as b,
    ):
        await a.register("w1")
        await b.register("w2")
        first = await a.route("session-a")
        assert await b.route("session-a") == first
        # Routers racing on fresh sessions: each session still ends up on one worker.
        sessions = [f"race-{i}" for i in range(10)]
        answers = await asyncio.gather(
            *(router.route(s) for s in sessions for router in (a, b, a, b))
        )
        by_session: dict[str, set[str]] = {}
        for index, worker_id in enumerate(answers):
            by_session.setdefault(sessions[index // 4], set()).add(worker_id)
        assert all(len(chosen) == 1 for chosen in by_session.values()), by_session
        # Each session was counted once, by the router that won it.
        assert sum(w.sessions for w in (await b.workers()).values()) == 11


async def test_a_lapsed_worker_is_not_chosen_and_its_sessions_move(
    redis_url: str, key_prefix: str
) -> None:
    async with running_router(
        redis_url, key_prefix, lease_s=0.5, heartbeat_interval_s=0.1
    ) as router:
        await router.register("w1")
        await router.register("w2")
        assert await router.route("session-a") == "w1"
        # w2 keeps heartbeating, w1 falls silent: once its lease lapses the session moves.

        async def moved() -> bool:
            assert await router.heartbeat("w2")
            return await router.route("session-a") == "w2"

        await eventually(
            moved, timeout_s=5.0, interval_s=0.05, what="session-a left the silent worker"
        )
        assert await router.route("session-b") == "w2"
        assert await router.route("session-a") == "w2"
        workers = await router.workers()
        assert not workers["w1"].live
        assert workers["w1"].last_heartbeat_age_s > 0.5
        assert workers["w2"].live


async def test_a_deregistered_worker_is_not_chosen_and_must_register_again(
    router: RunningRouter,
) -> None:
    await router.register("w1")
    await router.register("w2")
    assert await router.route("session-a") == "w1"
    await router.stub.DeregisterWorker(
        router_pb2.DeregisterWorkerRequest(worker_id="w1"), timeout=RPC_TIMEOUT_S
    )
    assert await router.route("session-a") == "w2"
    assert await router.route("session-b") == "w2"
    assert "w1" not in await router.workers()
    assert not await router.heartbeat("w1")
    await router.register("w1")
    assert await router.heartbeat("w1")


async def test_avoiding_the_sticky_worker_moves_the_session_for_good(
    router: RunningRouter,
) -> None:
    await router.register("w1")
    await router.register("w2")
    assert await router.route("session-a") == "w1"
    assert await router.route("session-a", avoid="w1") == "w2"
    assert await router.route("session-a") == "w2"
    sessions = {w.worker_id: w.sessions for w in (await router.workers()).values()}
    assert sessions == {"w1": 0, "w2": 1}


async def test_an_unserved_model_is_not_found_and_the_message_lists_the_models(
    router: RunningRouter,
) -> None:
    await router.register("w1", models=("qwen", "llama"))
    await router.register("w2", models=("gemma",))
    err = await rpc_error(router.route("session-a", model="gpt-9"))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    rebuilt = from_rpc_error(err, hop="router")
    assert isinstance(rebuilt, NotFound)
    assert rebuilt.code == "model_not_found"
    assert rebuilt.message == (
        "model 'gpt-9' is not served here; available models: gemma, llama, qwen"
    )


async def test_a_worker_with_no_model_list_serves_any_model(router: RunningRouter) -> None:
    await router.register("w1", models=())
    assert await router.route("session-a", model="whatever") == "w1"


async def test_no_worker_at_all_is_unavailable_with_retry_after(router: RunningRouter) -> None:
    err = await rpc_error(router.route("session-a"))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    rebuilt = from_rpc_error(err, hop="router")
    assert isinstance(rebuilt, Unavailable)
    assert rebuilt.retry_after_s == 1
    assert rebuilt.message.startswith("no live worker: start a worker")


async def test_an_empty_session_is_an_invalid_argument(router: RunningRouter) -> None:
    await router.register("w1")
    err = await rpc_error(router.route(""))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_list_workers_reports_every_field(router: RunningRouter) -> None:
    await router.register("w1", models=("a", "b"))
    await router.register("w2", models=())
    await router.heartbeat("w1", in_flight=4)
    await router.route("session-a")
    workers = await router.workers()
    assert sorted(workers) == ["w1", "w2"]
    w1, w2 = workers["w1"], workers["w2"]
    assert (w1.address, list(w1.models), w1.in_flight, w1.live) == (
        "w1.local:7000",
        ["a", "b"],
        4,
        True,
    )
    assert (list(w2.models), w2.in_flight, w2.sessions, w1.sessions) == ([], 0, 1, 0)
    assert 0 <= w1.last_heartbeat_age_s < 5


async def test_heartbeat_from_an_unknown_worker_is_not_known(router: RunningRouter) -> None:
    assert not await router.heartbeat("never-registered", in_flight=1)
    assert await router.workers() == {}


async def test_health_is_serving_then_not_after_stop(redis_url: str, key_prefix: str) -> None:
    async with running_router(redis_url, key_prefix) as router:
        health = health_pb2_grpc.HealthStub(router.channel)
        reply = await health.Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=RPC_TIMEOUT_S
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        await router.server.stop()
        try:
            reply = await health.Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=RPC_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE
        else:
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_router_state_lives_under_the_documented_keys(
    router: RunningRouter, redis_client: aioredis.Redis, key_prefix: str
) -> None:
    await router.register("w1", models=("m",))
    await router.route("session-a", model="m")
    keys = {k.decode() async for k in redis_client.scan_iter(match=f"{key_prefix}*")}
    names = {k.removeprefix(key_prefix) for k in keys}
    assert names == {
        "workers",
        "workers:hb",
        "workers:inflight",
        "workers:sessions:w1",
        "aff:session-a:m",
    }
    record = msgpack.unpackb(await redis_client.hget(f"{key_prefix}workers", "w1"))
    assert record["address"] == "w1.local:7000"
    assert record["models"] == ["m"]
    # Each use refreshes the affinity's 24 h expiry.
    await redis_client.expire(f"{key_prefix}aff:session-a:m", 60)
    await router.route("session-a", model="m")
    assert await redis_client.ttl(f"{key_prefix}aff:session-a:m") > 24 * 3600 - 60
