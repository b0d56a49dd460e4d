"""Gateway fixtures: a real gateway on port 0 and an HTTP client for it."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import aiohttp
import pytest

from services.gateway.app import GatewayServer
from services.gateway.settings import GatewaySettings
from services.runtime.keys import new_session_key
from services.runtime.metrics import MetricsEndpoint
from services.runtime.secret import Secret

ADMIN_KEY = "rg-admin-test-key-0123456789"


@pytest.fixture
def dead_address() -> Iterator[str]:
    """host:port on which nothing listens (bound once, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    yield f"127.0.0.1:{port}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Gateway:
    """A running gateway and a client session pointed at it."""

    url: str
    http: aiohttp.ClientSession
    settings: GatewaySettings
    server: GatewayServer


def gateway_settings(
    *, router_addr: str, dataproxy_addr: str, max_body_bytes: int = 1024 * 1024
) -> GatewaySettings:
    """Test settings: port 0, short readiness deadline, small body limit."""
    return GatewaySettings(
        admin_key=Secret(ADMIN_KEY),
        port=0,
        router_addr=router_addr,
        dataproxy_addr=dataproxy_addr,
        max_body_bytes=max_body_bytes,
        request_timeout_s=30.0,
        ready_timeout_s=1.0,
        grace_s=1.0,
        metrics=MetricsEndpoint(port=0),
    )


@pytest.fixture
async def gateway_without_backends(dead_address: str) -> AsyncIterator[Gateway]:
    """A gateway whose router and dataproxy addresses point at nothing."""
    settings = gateway_settings(router_addr=dead_address, dataproxy_addr=dead_address)
    async with GatewayServer(settings) as server, aiohttp.ClientSession() as http:
        yield Gateway(
            url=f"http://127.0.0.1:{server.port}", http=http, settings=settings, server=server
        )


@pytest.fixture
def session_key() -> str:
    """A well-formed session key (not known to any dataproxy)."""
    return new_session_key()
