"""/rl/end_session when the dataproxy replica it reached was stopping: grpcio fails such a call
CANCELLED without serving it (grpc/grpc#41785); ending is idempotent, so the gateway sends it
once more instead of answering 503 — against a real gRPC dataproxy that fails the first call
that way, and a real gateway."""

from __future__ import annotations

from typing import Any

import aiohttp
import grpc

from protos import dataproxy_pb2, dataproxy_pb2_grpc
from services.gateway.app import GatewayServer
from tests.gateway.conftest import gateway_settings
from tests.harness.inprocess import scripted_dataproxy


class _StoppingOnce(dataproxy_pb2_grpc.DataProxyServicer):
    """Fails the first `cancelled` EndSession calls CANCELLED unserved, then answers."""

    def __init__(self, cancelled: int) -> None:
        self.calls = 0
        self._cancelled = cancelled

    async def EndSession(
        self,
        request: dataproxy_pb2.EndSessionRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> dataproxy_pb2.EndSessionResponse:
        self.calls += 1
        if self.calls <= self._cancelled:
            await context.abort(grpc.StatusCode.CANCELLED, "the server is shutting down")
        return dataproxy_pb2.EndSessionResponse(
            session_id="ep-1", trajectory_id="t-1", interaction_count=3
        )


async def _end(cancelled: int, session_key: str) -> tuple[int, dict[str, Any], int]:
    servicer = _StoppingOnce(cancelled)
    server = scripted_dataproxy(servicer)
    async with server:
        address = f"127.0.0.1:{server.port}"
        settings = gateway_settings(router_addr=address, dataproxy_addr=address)
        async with GatewayServer(settings) as gateway, aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{gateway.port}/rl/end_session"
            auth = {"Authorization": f"Bearer {session_key}"}
            async with http.post(url, headers=auth, json={}) as resp:
                return resp.status, await resp.json(), servicer.calls


async def test_a_call_cancelled_by_a_stopping_replica_is_sent_once_more(session_key: str) -> None:
    status, body, calls = await _end(1, session_key)

    assert (status, calls) == (200, 2)
    assert body["trajectory_id"] == "t-1" and body["interaction_count"] == 3


async def test_a_second_cancel_is_the_clients_503(session_key: str) -> None:
    status, body, calls = await _end(2, session_key)

    assert (status, calls) == (503, 2)
    assert body["error"]["code"] == "dataproxy_cancelled"
