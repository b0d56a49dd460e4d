"""Channels to several replicas: calls go only to replicas whose health is SERVING, and a call
made while none is waits for one within its deadline (a rolling restart fails no call)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from protos import router_pb2, router_pb2_grpc
from services.runtime.grpc_client import open_channel
from services.runtime.grpc_server import GrpcServer, ServerSpec
from tests.harness.poll import eventually


class _Named(router_pb2_grpc.RouterServicer):
    """Route answers the replica's name."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def Route(self, request: router_pb2.RouteRequest, context: Any) -> Any:
        return router_pb2.RouteResponse(worker_id=self.name, address="a:1")


@contextlib.asynccontextmanager
async def _replica(name: str) -> AsyncIterator[GrpcServer]:
    spec = ServerSpec(
        name="router", host="127.0.0.1", port=0, service_names=("rollgate.v1.Router",),
        grace_s=0.5,
    )  # fmt: skip
    server = GrpcServer(spec)
    router_pb2_grpc.add_RouterServicer_to_server(_Named(name), server.server)
    async with server:
        await server.set_serving()
        yield server


@contextlib.asynccontextmanager
async def _replicas() -> AsyncIterator[tuple[GrpcServer, GrpcServer, grpc.aio.Channel]]:
    """Replicas "a" and "b", and one channel listing both (as the stack's multi-replica
    addresses do)."""
    async with (
        _replica("a") as a,
        _replica("b") as b,
        open_channel(f"ipv4:127.0.0.1:{a.port},127.0.0.1:{b.port}") as channel,
    ):
        yield a, b, channel


async def _route(channel: grpc.aio.Channel, deadline_s: float = 5.0) -> str:
    stub = router_pb2_grpc.RouterStub(channel)
    answer = await stub.Route(router_pb2.RouteRequest(session="s"), timeout=deadline_s)
    return str(answer.worker_id)


async def _until_answered_by(channel: grpc.aio.Channel, want: set[str]) -> None:
    """Calls in rounds of 10 until one round is answered by exactly `want`."""

    async def answered_by() -> set[str]:
        return {await _route(channel) for _ in range(10)}

    await eventually(answered_by, want=want, timeout_s=10, what=f"answered by {want}")


async def test_a_replica_that_is_not_serving_gets_no_calls_until_it_serves_again() -> None:
    async with _replicas() as (_, b, channel):
        await _until_answered_by(channel, {"a", "b"})
        # Health first, as GrpcServer.stop does before it refuses RPCs.
        await b.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        await _until_answered_by(channel, {"a"})
        assert {await _route(channel) for _ in range(40)} == {"a"}
        await b.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await _until_answered_by(channel, {"a", "b"})


async def test_a_call_made_while_no_replica_serves_waits_for_one_within_its_deadline() -> None:
    async with _replicas() as (a, b, channel):
        assert await _route(channel) in {"a", "b"}
        for server in (a, b):
            await server.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        # Nobody serves (once the channel has seen it): a call waits, within its deadline,
        # where it would have failed UNAVAILABLE at once.

        async def waited_for_its_deadline() -> bool:
            try:
                await _route(channel, deadline_s=0.5)
            except grpc.aio.AioRpcError as err:
                assert err.code() is grpc.StatusCode.DEADLINE_EXCEEDED, err
                return True
            return False

        await eventually(waited_for_its_deadline, timeout_s=10, what="a call waiting")
        # ... and is answered once a replica serves again.
        waiting = asyncio.create_task(_route(channel, deadline_s=10))
        await asyncio.sleep(0)  # the call is made before "a" serves
        await a.health.set("", health_pb2.HealthCheckResponse.SERVING)
        assert await waiting == "a"


async def test_a_stopping_server_serves_the_calls_that_still_come_until_they_stop() -> None:
    # A client that has not seen NOT_SERVING yet (or has no other replica) still calls; once
    # the server stops, such a call would fail CANCELLED or UNAVAILABLE unserved.
    async with _replica("a") as a, open_channel(f"127.0.0.1:{a.port}") as channel:
        assert await _route(channel) == "a"
        stopping = asyncio.create_task(a.stop())
        await eventually(lambda: a.draining, timeout_s=5, what="the stop begun")
        for _ in range(3):
            assert await _route(channel) == "a"
        assert not stopping.done()
        await asyncio.wait_for(stopping, timeout=5)  # quiet now: it stops
        with contextlib.suppress(grpc.aio.AioRpcError):
            await _route(channel, deadline_s=1.0)
            raise AssertionError("a stopped server answered")
