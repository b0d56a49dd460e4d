"""/rl/start_session and /rl/end_session when the dataproxy replica they reached was stopping:
grpcio fails such a call CANCELLED without serving it (grpc/grpc#41785), so the gateway sends
it once more instead of answering 503 — against a real gRPC dataproxy that fails the first
calls that way, and a real gateway."""

from __future__ import annotations

from typing import Any

import aiohttp
import grpc
import pytest

from protos import dataproxy_pb2, dataproxy_pb2_grpc
from services.gateway.app import GatewayServer
from tests.gateway.conftest import ADMIN_KEY, gateway_settings
from tests.harness.inprocess import scripted_dataproxy


class _Stopping(dataproxy_pb2_grpc.DataProxyServicer):
    """Fails the first `cancelled` session calls CANCELLED unserved, then answers."""

    def __init__(self, cancelled: int) -> None:
        self.calls = 0
        self._cancelled = cancelled

    async def _cut(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self.calls += 1
        if self.calls <= self._cancelled:
            await context.abort(grpc.StatusCode.CANCELLED, "the server is shutting down")

    async def StartSession(
        self,
        request: dataproxy_pb2.StartSessionRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> dataproxy_pb2.StartSessionResponse:
        await self._cut(context)
        return dataproxy_pb2.StartSessionResponse(session_id="ep-1", api_key="sk-sess-" + "a" * 40)

    async def EndSession(
        self,
        request: dataproxy_pb2.EndSessionRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> dataproxy_pb2.EndSessionResponse:
        await self._cut(context)
        return dataproxy_pb2.EndSessionResponse(
            session_id="ep-1", trajectory_id="t-1", interaction_count=3
        )


async def _call(path: str, key: str, cancelled: int) -> tuple[int, dict[str, Any], int]:
    servicer = _Stopping(cancelled)
    server = scripted_dataproxy(servicer)
    async with server:
        address = f"127.0.0.1:{server.port}"
        settings = gateway_settings(router_addr=address, dataproxy_addr=address)
        async with GatewayServer(settings) as gateway, aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{gateway.port}{path}"
            body = {"task_id": "t"} if path == "/rl/start_session" else {}
            auth = {"Authorization": f"Bearer {key}"}
            async with http.post(url, headers=auth, json=body) as resp:
                return resp.status, await resp.json(), servicer.calls


@pytest.fixture(params=["/rl/start_session", "/rl/end_session"])
def call(request: pytest.FixtureRequest, session_key: str) -> tuple[str, str]:
    path = str(request.param)
    return path, ADMIN_KEY if path == "/rl/start_session" else session_key


async def test_a_call_cancelled_by_a_stopping_replica_is_sent_once_more(
    call: tuple[str, str],
) -> None:
    path, key = call
    status, body, calls = await _call(path, key, cancelled=1)

    assert (status, calls) == (200, 2), body
    if path == "/rl/start_session":
        assert body["session_id"] == "ep-1" and body["api_key"].startswith("sk-sess-")
    else:
        assert body["trajectory_id"] == "t-1" and body["interaction_count"] == 3


async def test_a_second_cancel_is_the_clients_503(call: tuple[str, str]) -> None:
    path, key = call
    status, body, calls = await _call(path, key, cancelled=2)

    assert (status, calls) == (503, 2)
    assert body["error"]["code"] == "dataproxy_cancelled"
