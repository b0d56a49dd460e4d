"""The real `python -m services.router` process: health, then a graceful SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollgate.redis_server import free_port
from services.router.__main__ import SERVICE_NAME
from services.runtime.grpc_client import open_channel
from tests.harness.poll import eventually

REPO_ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 2.0


async def wait_serving(address: str, process: asyncio.subprocess.Process, timeout_s: float) -> None:
    async with open_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)

        async def serving() -> bool:
            assert process.returncode is None, "the router exited during start-up"
            try:
                reply = await health.Check(
                    health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=1.0
                )
            except grpc.aio.AioRpcError:
                return False
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

        await eventually(
            serving, timeout_s=timeout_s, interval_s=0.1, what=f"the router at {address} SERVING"
        )


async def test_the_router_process_serves_health_and_exits_0_on_sigterm(
    redis_url: str, key_prefix: str
) -> None:
    port = free_port()
    env = {
        **os.environ,
        "ROLLGATE_REDIS_URL": redis_url,
        "ROLLGATE_REDIS_PREFIX": key_prefix,
        "ROLLGATE_GRACE_S": str(GRACE_S),
        "ROLLGATE_LOG_JSON": "1",
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.router", "--host", "127.0.0.1", "--port", str(port),
        cwd=REPO_ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        await wait_serving(f"127.0.0.1:{port}", process, timeout_s=20.0)
        process.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(process.communicate(), timeout=GRACE_S + 5.0)
        assert process.returncode == 0, stderr.decode()
        assert b"service_stopped" in stderr
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
