"""The worker process bootstrap against the real router (in-process) and the real test Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import orjson
import pytest

from protos import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from rollgate.mock_llm import MockLLM
from rollgate.redis_server import free_port
from services.router.__main__ import serving as router_serving
from services.router.settings import RouterSettings
from services.runtime.grpc_client import open_channel
from services.worker.__main__ import serving as worker_serving
from services.worker.settings import WorkerSettings
from tests.harness.poll import eventually

RPC_TIMEOUT_S = 5.0


@asynccontextmanager
async def router(
    redis_url: str, prefix: str, *, port: int = 0
) -> AsyncIterator[router_pb2_grpc.RouterStub]:
    settings = RouterSettings(
        host="127.0.0.1",
        port=port,
        redis_url=redis_url,
        redis_prefix=prefix,
        lease_s=2.0,
        heartbeat_interval_s=0.05,
        grace_s=0.5,
    )
    async with AsyncExitStack() as stack:
        server = await stack.enter_async_context(router_serving(settings))
        channel = open_channel(f"127.0.0.1:{server.port}")
        stack.push_async_callback(channel.close)
        yield router_pb2_grpc.RouterStub(channel)


def worker_settings(router_port: int, base_url: str, **overrides: object) -> WorkerSettings:
    fields: dict[str, object] = {
        "host": "127.0.0.1",
        "port": 0,
        "router_addr": f"127.0.0.1:{router_port}",
        "worker_id": "w-test",
        "upstream_base_url": base_url,
        "upstream_kind": "vllm",
        "grace_s": 0.5,
        "router_timeout_s": 1.0,
    }
    fields.update(overrides)
    return WorkerSettings(**fields)  # type: ignore[arg-type]


async def list_workers(stub: router_pb2_grpc.RouterStub) -> dict[str, router_pb2.WorkerInfo]:
    reply = await stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=RPC_TIMEOUT_S)
    return {w.worker_id: w for w in reply.workers}


async def eventually_listed(
    stub: router_pb2_grpc.RouterStub, predicate: Callable[[dict[str, router_pb2.WorkerInfo]], bool]
) -> dict[str, router_pb2.WorkerInfo]:
    async def listed() -> dict[str, router_pb2.WorkerInfo] | None:
        workers = await list_workers(stub)
        return workers if predicate(workers) else None

    found: dict[str, router_pb2.WorkerInfo] = await eventually(
        listed, timeout_s=5.0, what="the router lists the expected workers"
    )
    return found


async def test_worker_registers_its_upstream_models_heartbeats_and_deregisters_on_exit(
    redis_url: str, key_prefix: str
) -> None:
    router_port = free_port()
    async with (
        MockLLM(port=0, model="mock-model") as mock,
        router(redis_url, key_prefix, port=router_port) as stub,
    ):
        async with worker_serving(worker_settings(router_port, mock.base_url)) as worker:
            workers = await eventually_listed(stub, lambda ws: "w-test" in ws)
            info = workers["w-test"]
            assert info.address == worker.address == f"127.0.0.1:{worker.server.port}"
            # Discovered from the upstream's /models, and `default` standing for the first.
            assert list(info.models) == ["mock-model", "default"]
            assert info.live
            beats = worker.registration.heartbeats
            await eventually(lambda: worker.registration.heartbeats >= beats + 3)
        # Deregistered on exit, not merely silent: the router no longer lists it at all (a
        # lapsed lease would still list it, as not live, for a while).
        assert "w-test" not in await list_workers(stub)


async def test_configured_models_are_registered_without_asking_the_upstream(
    redis_url: str, key_prefix: str
) -> None:
    router_port = free_port()
    settings = worker_settings(router_port, "http://127.0.0.1:9/v1", upstream_models=("a", "b"))
    async with router(redis_url, key_prefix, port=router_port) as stub, worker_serving(settings):
        workers = await eventually_listed(stub, lambda ws: "w-test" in ws)
    assert list(workers["w-test"].models) == ["a", "b", "default"]


@pytest.mark.parametrize(
    ("overrides", "registered", "default_is"),
    [
        ({"default_model": "b"}, ["a", "b", "default"], "b"),
        (
            {"default_model": "qwen3", "upstream_aliases": (("qwen3", "b"),)},
            ["a", "b", "qwen3", "default"],
            "b",
        ),
        ({"default_model": "not-here"}, ["a", "b"], None),
        ({"serve_default_model": False}, ["a", "b"], None),
        ({"upstream_aliases": (("default", "b"),)}, ["a", "b", "default"], "b"),
    ],
    ids=["named", "through-an-alias", "not-served-here", "off", "explicit-alias"],
)
async def test_default_is_registered_only_where_it_is_served(
    redis_url: str,
    key_prefix: str,
    overrides: dict[str, Any],
    registered: list[str],
    default_is: str | None,
) -> None:
    router_port = free_port()
    settings = worker_settings(
        router_port, "http://127.0.0.1:9/v1", upstream_models=("a", "b"), **overrides
    )
    async with (
        router(redis_url, key_prefix, port=router_port) as stub,
        worker_serving(settings) as worker,
    ):
        workers = await eventually_listed(stub, lambda ws: "w-test" in ws)
        aliases = dict(worker.runner.policy.aliases)
    assert list(workers["w-test"].models) == registered
    assert aliases.get("default") == default_is


async def test_an_unreachable_upstream_at_start_registers_for_any_model(
    redis_url: str, key_prefix: str
) -> None:
    router_port = free_port()
    unused = free_port()
    settings = worker_settings(router_port, f"http://127.0.0.1:{unused}/v1")
    async with router(redis_url, key_prefix, port=router_port) as stub, worker_serving(settings):
        workers = await eventually_listed(stub, lambda ws: "w-test" in ws)
    assert list(workers["w-test"].models) == []


async def test_worker_registers_again_when_the_router_forgets_it(
    redis_url: str, key_prefix: str
) -> None:
    router_port = free_port()
    async with (
        MockLLM(port=0) as mock,
        router(redis_url, key_prefix, port=router_port) as stub,
        worker_serving(worker_settings(router_port, mock.base_url)) as worker,
    ):
        await eventually(lambda: worker.registration.registrations == 1)
        await stub.DeregisterWorker(
            router_pb2.DeregisterWorkerRequest(worker_id="w-test"), timeout=RPC_TIMEOUT_S
        )
        await eventually(lambda: worker.registration.registrations == 2)
        await eventually_listed(stub, lambda ws: "w-test" in ws and ws["w-test"].live)


async def test_worker_keeps_trying_until_the_router_comes_up(
    redis_url: str, key_prefix: str
) -> None:
    router_port = free_port()
    async with (
        MockLLM(port=0) as mock,
        worker_serving(worker_settings(router_port, mock.base_url)) as worker,
    ):
        assert worker.registration.registrations == 0
        async with router(redis_url, key_prefix, port=router_port) as stub:
            await eventually(lambda: worker.registration.registrations == 1, timeout_s=10.0)
            await eventually_listed(stub, lambda ws: "w-test" in ws and ws["w-test"].live)


async def test_heartbeats_report_the_turns_in_flight(redis_url: str, key_prefix: str) -> None:
    router_port = free_port()
    async with (
        MockLLM(port=0, token_interval_ms=50) as mock,
        router(redis_url, key_prefix, port=router_port) as stub,
        worker_serving(worker_settings(router_port, mock.base_url)) as worker,
    ):
        channel = open_channel(worker.address)
        try:
            body = orjson.dumps(
                {"messages": [{"role": "user", "content": " ".join(["w"] * 20)}], "stream": True}
            )
            call = worker_pb2_grpc.WorkerStub(channel).Generate(
                worker_pb2.GenerateRequest(body_json=body)
            )
            await call.read()
            await eventually_listed(stub, lambda ws: ws["w-test"].in_flight == 1)
            call.cancel()
            await eventually_listed(stub, lambda ws: ws["w-test"].in_flight == 0)
        finally:
            await channel.close()
