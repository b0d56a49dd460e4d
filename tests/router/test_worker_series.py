"""Per-worker metric series last as long as the worker is in the registry: a worker that
deregisters loses them at once, a killed one (no goodbye) once it has been silent for
`forget_after_s`, so restarts (each a new worker id) never grow the `worker` label."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import aiohttp
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from protos import router_pb2, router_pb2_grpc
from rollgate.mock_llm import MockLLM
from rollgate.redis_server import free_port
from services.router.__main__ import serving
from services.router.metrics import registry_values
from services.router.registry import Registry, RouterKeys
from services.router.settings import RouterSettings
from services.runtime.grpc_client import open_channel
from services.runtime.metrics import MetricsEndpoint
from tests.harness.poll import eventually

REPO_ROOT = Path(__file__).resolve().parents[2]
RPC_TIMEOUT_S = 5.0
LEASE_S = 0.5
FORGET_AFTER_S = 1.5

# The router's series labelled by worker id.
PER_WORKER = (
    "rollgate_worker_live",
    "rollgate_worker_session_affinities",
    "rollgate_worker_reported_turns_in_flight",
    "rollgate_worker_heartbeat_age_seconds",
)


@asynccontextmanager
async def router_with_metrics(
    redis_url: str, prefix: str
) -> AsyncIterator[tuple[router_pb2_grpc.RouterStub, int, int]]:
    """A router (its gRPC port and metrics port) that forgets silent workers quickly."""
    metrics_port = free_port()
    settings = RouterSettings(
        host="127.0.0.1",
        port=0,
        redis_url=redis_url,
        redis_prefix=prefix,
        lease_s=LEASE_S,
        heartbeat_interval_s=0.1,
        forget_after_s=FORGET_AFTER_S,
        grace_s=0.5,
        metrics=MetricsEndpoint(port=metrics_port),
    )
    async with AsyncExitStack() as stack:
        server = await stack.enter_async_context(serving(settings))
        channel = open_channel(f"127.0.0.1:{server.port}")
        stack.push_async_callback(channel.close)
        yield router_pb2_grpc.RouterStub(channel), int(server.port or 0), metrics_port


@asynccontextmanager
async def worker_process(
    worker_id: str, router_port: int, base_url: str
) -> AsyncIterator[asyncio.subprocess.Process]:
    """`python -m services.worker` registered with the router (killed on the way out)."""
    env = {
        **os.environ,
        "ROLLGATE_ROUTER_ADDR": f"127.0.0.1:{router_port}",
        "ROLLGATE_WORKER_ID": worker_id,
        "ROLLGATE_UPSTREAM_BASE_URL": base_url,
        "ROLLGATE_UPSTREAM_KIND": "vllm",
        "ROLLGATE_METRICS_PORT": "off",
        "ROLLGATE_GRACE_S": "0.5",
        "ROLLGATE_LOG_JSON": "1",
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.worker", "--host", "127.0.0.1", "--port", str(free_port()),
        cwd=REPO_ROOT, env=env, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def per_worker(metrics_port: int) -> dict[str, set[str]]:
    """Each per-worker metric's `worker` label values on the router's /metrics page."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{metrics_port}/metrics") as resp,
    ):
        text = await resp.text()
    found: dict[str, set[str]] = {name: set() for name in PER_WORKER}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in found:
                found[sample.name].add(sample.labels["worker"])
    return found


async def test_a_killed_worker_and_a_deregistered_one_leave_the_per_worker_series(
    redis_url: str, key_prefix: str, redis_client: aioredis.Redis
) -> None:
    async with (
        MockLLM(port=0) as mock,
        router_with_metrics(redis_url, key_prefix) as (stub, router_port, metrics_port),
        worker_process("w-killed", router_port, mock.base_url) as killed,
        worker_process("w-stopped", router_port, mock.base_url) as stopped,
    ):
        both = {"w-killed", "w-stopped"}

        async def registered() -> bool:
            assert killed.returncode is None and stopped.returncode is None
            return all(ids == both for ids in (await per_worker(metrics_port)).values())

        await eventually(registered, timeout_s=60.0, interval_s=0.2, what="both workers listed")
        # A worker that stops deregisters: its series go at the next scrape.
        stopped.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(stopped.wait(), timeout=20.0) == 0

        async def only_killed_left() -> bool:
            return all(ids == {"w-killed"} for ids in (await per_worker(metrics_port)).values())

        await eventually(only_killed_left, timeout_s=10.0, interval_s=0.1, what="w-stopped gone")
        # A killed worker says no goodbye: listed as not live once its lease lapses ...
        killed.kill()
        await killed.wait()
        reply = await stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=RPC_TIMEOUT_S)
        assert [w.worker_id for w in reply.workers] == ["w-killed"]

        async def workers_listed() -> list[str]:
            reply = await stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=RPC_TIMEOUT_S)
            return [f"{w.worker_id}:{'live' if w.live else 'stale'}" for w in reply.workers]

        await eventually(
            workers_listed, want=["w-killed:stale"], timeout_s=10.0, interval_s=0.05,
            what="w-killed stale",
        )  # fmt: skip
        # ... then forgotten, with every series and every registry key of it.
        await eventually(
            lambda: per_worker(metrics_port), want={name: set() for name in PER_WORKER},
            timeout_s=15.0, interval_s=0.1, what="no series of the killed worker",
        )  # fmt: skip
        assert await workers_listed() == []
        for key in ("workers", "workers:inflight"):
            assert not await redis_client.hexists(f"{key_prefix}{key}", "w-killed"), key
        assert await redis_client.zscore(f"{key_prefix}workers:hb", "w-killed") is None
        assert not await redis_client.exists(f"{key_prefix}workers:sessions:w-killed")
        # Were it only partitioned away, its next heartbeat is refused and it registers again.
        known = await stub.Heartbeat(
            router_pb2.HeartbeatRequest(worker_id="w-killed"), timeout=RPC_TIMEOUT_S
        )
        assert not known.known


async def test_a_worker_without_a_recorded_heartbeat_has_no_heartbeat_age_sample(
    redis_client: aioredis.Redis, key_prefix: str
) -> None:
    keys = RouterKeys(key_prefix)
    registry = Registry(
        redis_client, keys=keys, lease_s=6.0, affinity_ttl_s=60.0, forget_after_s=60.0
    )
    for worker_id in ("w1", "w2"):
        await registry.register(
            worker_id=worker_id, address=f"{worker_id}:1", models=["m"], timeout_s=5
        )
    # w2's heartbeat record is gone (a partial flush, a hand edit): its age is unknown.
    await redis_client.zrem(keys.heartbeats, "w2")
    families = {f.name: f for f in await registry_values(registry)()}
    ages = {
        s.labels["worker"]: s.value
        for s in families["rollgate_worker_heartbeat_age_seconds"].samples
    }
    assert list(ages) == ["w1"] and 0 <= ages["w1"] < 5
    live = {s.labels["worker"]: s.value for s in families["rollgate_worker_live"].samples}
    assert live == {"w1": 1.0, "w2": 0.0}
    assert all(s.value >= 0 for f in families.values() for s in f.samples)
