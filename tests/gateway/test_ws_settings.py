"""The WebSocket bridge's settings come from the environment (`ROLLGATE_WS_*`) and reach /ws."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from services.gateway.app import GatewayServer, build_app
from services.gateway.settings import GatewaySettings
from services.gateway.ws import WS_CONFIG, config_from
from services.gateway.ws_protocol import WsConfig
from tests.gateway.conftest import ADMIN_KEY
from tests.gateway.test_full_chain import MODEL, Stack, _start, stack
from tests.gateway.test_ws import open_client, published

__all__ = ["stack"]

WS_ENV = {
    "ROLLGATE_WS_MODEL": "served-model",
    "ROLLGATE_WS_SYSTEM_PROMPT": "You are the configured agent.",
    "ROLLGATE_WS_TICK_INTERVAL_MS": "250",
    "ROLLGATE_WS_MAX_PAYLOAD_BYTES": "1048576",
    "ROLLGATE_WS_MAX_BUFFERED_BYTES": "2097152",
    "ROLLGATE_WS_RUN_TIMEOUT_S": "45",
}


def test_ws_settings_are_read_from_the_environment_into_the_bridge_config() -> None:
    settings = GatewaySettings.from_env({"ROLLGATE_ADMIN_KEY": ADMIN_KEY} | WS_ENV)

    assert config_from(settings) == WsConfig(
        model="served-model",
        system_prompt="You are the configured agent.",
        tick_interval_ms=250,
        max_payload_bytes=1024 * 1024,
        max_buffered_bytes=2 * 1024 * 1024,
        run_timeout_s=45.0,
    )
    assert build_app(settings)[WS_CONFIG] == config_from(settings)


def test_without_ws_variables_the_bridge_keeps_its_defaults() -> None:
    settings = GatewaySettings.from_env({"ROLLGATE_ADMIN_KEY": ADMIN_KEY})

    assert config_from(settings) == WsConfig()
    assert settings.ws_model == ""


@pytest.mark.parametrize("name", ["ROLLGATE_WS_TICK_INTERVAL_MS", "ROLLGATE_WS_MAX_PAYLOAD_BYTES"])
def test_a_non_positive_ws_limit_is_refused_naming_the_variable(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        GatewaySettings.from_env({"ROLLGATE_ADMIN_KEY": ADMIN_KEY, name: "0"})


@pytest.fixture
async def configured_ws(stack: Stack) -> AsyncIterator[str]:
    """A second gateway on the stack, started from settings read from the environment."""
    env = WS_ENV | {
        "ROLLGATE_ADMIN_KEY": ADMIN_KEY,
        "ROLLGATE_ROUTER_ADDR": stack.router_addr,
        "ROLLGATE_DATAPROXY_ADDR": stack.dataproxy_addr,
        "ROLLGATE_WS_MODEL": "",
    }
    async with GatewayServer(GatewaySettings.from_env(env, port=0)) as server:
        yield f"ws://127.0.0.1:{server.port}/ws"


async def test_a_gateway_from_the_environment_announces_and_uses_its_ws_settings(
    stack: Stack, configured_ws: str, redis_client: aioredis.Redis
) -> None:
    key = (await _start(stack))["api_key"]
    client = await open_client(stack.http, configured_ws, key)
    policy = client.frames[-1]["payload"]["policy"]
    assert policy["tickIntervalMs"] == 250
    assert policy["maxPayload"] == 1024 * 1024
    assert policy["maxBufferedBytes"] == 2 * 1024 * 1024
    run_id = str(uuid.uuid4())
    params = {"sessionKey": "main", "message": "which prompt?", "idempotencyKey": run_id}
    assert (await client.call("chat.send", params))["ok"]
    assert (await client.chat_end(run_id))["payload"]["state"] == "final"
    await client.ws.close()

    [interaction] = (await published(stack, redis_client, key))["interactions"]
    assert interaction["messages"][0] == {
        "role": "system",
        "content": "You are the configured agent.",
    }
    # ROLLGATE_WS_MODEL empty: the first model a live worker serves.
    assert stack.mock.stats.last_body is not None
    assert stack.mock.stats.last_body["model"] == MODEL
