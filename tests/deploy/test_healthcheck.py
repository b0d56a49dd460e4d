"""deploy/docker/healthcheck.py, the compose health probe, run as compose runs it: a process
against a real gRPC health service and a real HTTP server."""

from __future__ import annotations

import asyncio
import sys

from rollgate.mock_llm import MockLLM
from services.runtime.grpc_server import GrpcServer, ServerSpec
from tests.deploy.conftest import REPO

SCRIPT = REPO / "deploy" / "docker" / "healthcheck.py"
PROBE_TIMEOUT_S = 30.0


async def probe(*args: str) -> tuple[int, str]:
    """Runs the health probe; returns its exit code and stderr."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(SCRIPT),
        "--timeout-s",
        "5",
        *args,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(process.communicate(), timeout=PROBE_TIMEOUT_S)
    assert process.returncode is not None
    return process.returncode, stderr.decode()


async def test_grpc_probe_fails_until_the_named_service_is_serving() -> None:
    spec = ServerSpec(
        name="probe-target", host="127.0.0.1", port=0, service_names=("rollgate.v1.Router",)
    )
    async with GrpcServer(spec) as server:
        address = f"127.0.0.1:{server.port}"
        code, err = await probe("grpc", address, "rollgate.v1.Router")
        assert code == 1 and "NOT_FOUND" in err
        await server.set_serving()
        assert await probe("grpc", address, "rollgate.v1.Router") == (0, "")
        assert (await probe("grpc", address))[0] == 0
        code, err = await probe("grpc", address, "rollgate.v1.Worker")
        assert code == 1 and "NOT_FOUND" in err


async def test_grpc_probe_fails_when_nothing_listens() -> None:
    spec = ServerSpec(name="gone", host="127.0.0.1", port=0, service_names=())
    async with GrpcServer(spec) as server:
        address = f"127.0.0.1:{server.port}"
    code, err = await probe("grpc", address)
    assert code == 1 and "UNAVAILABLE" in err


async def test_http_probe_passes_on_2xx_and_fails_on_errors() -> None:
    async with MockLLM(host="127.0.0.1", port=0) as mock:
        assert await probe("http", f"{mock.base_url}/models") == (0, "")
        code, err = await probe("http", f"http://127.0.0.1:{mock.port}/no-such-path")
        assert code == 1 and "HTTP 404" in err
        port = mock.port
    code, err = await probe("http", f"http://127.0.0.1:{port}/v1/models")
    assert code == 1 and "unreachable" in err
