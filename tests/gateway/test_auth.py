"""Keys: where the gateway reads them, how it tells them apart, and the 401s it answers."""

from __future__ import annotations

from typing import Any

import pytest
from multidict import CIMultiDict

from services.gateway.auth import (
    ADMIN_KEY_ON_SESSION_ROUTE_MESSAGE,
    ADMIN_KEY_REQUIRED_MESSAGE,
    MISSING_KEY_MESSAGE,
    NOT_A_SESSION_KEY_MESSAGE,
    KeyKind,
    classify,
    read_key,
)
from services.runtime.secret import Secret
from tests.gateway.conftest import ADMIN_KEY, Gateway

SESSION_ROUTES = ("/v1/chat/completions", "/chat/completions", "/rl/set_reward", "/rl/end_session")
UPSTREAM_KEY = "sk-proj-abcdefghijklmnopqrstuvwxyz0123456789"
CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_read_key_accepts_any_case_of_bearer_and_strips_it() -> None:
    assert read_key(CIMultiDict({"Authorization": "bearer   sk-sess-x  "})) == "sk-sess-x"
    assert read_key(CIMultiDict({"authorization": "BEARER k"})) == "k"


def test_read_key_falls_back_to_x_api_key() -> None:
    assert read_key(CIMultiDict({"X-Api-Key": " k2 "})) == "k2"
    assert read_key(CIMultiDict({"Authorization": "Bearer ", "x-api-key": "k3"})) == "k3"


def test_read_key_is_none_without_a_bearer_token() -> None:
    assert read_key(CIMultiDict()) is None
    assert read_key(CIMultiDict({"Authorization": "Basic dXNlcjpwYXNz"})) is None
    assert read_key(CIMultiDict({"Authorization": "Bearer    "})) is None


def test_classify_tells_admin_session_and_other_keys_apart(session_key: str) -> None:
    assert classify(ADMIN_KEY, Secret(ADMIN_KEY)) is KeyKind.ADMIN
    assert classify(session_key, Secret(ADMIN_KEY)) is KeyKind.SESSION
    assert classify("sk-sess-tooshort", Secret(ADMIN_KEY)) is KeyKind.OTHER
    assert classify(UPSTREAM_KEY, Secret(ADMIN_KEY)) is KeyKind.OTHER


async def _post(gateway: Gateway, path: str, headers: dict[str, str]) -> tuple[int, str, Any]:
    async with gateway.http.post(gateway.url + path, json=CHAT_BODY, headers=headers) as resp:
        return resp.status, resp.content_type, await resp.json()


def _assert_auth_error(status: int, content_type: str, body: Any, message: str) -> None:
    assert status == 401
    assert content_type == "application/json"
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "code"}
    assert body["error"]["type"] == "authentication_error"
    assert body["error"]["message"] == message


@pytest.mark.parametrize("path", SESSION_ROUTES)
async def test_session_route_without_a_key_says_to_send_the_session_key(
    gateway_without_backends: Gateway, path: str
) -> None:
    status, content_type, body = await _post(gateway_without_backends, path, {})
    _assert_auth_error(status, content_type, body, MISSING_KEY_MESSAGE)
    assert body["error"]["code"] == "missing_api_key"


@pytest.mark.parametrize("path", SESSION_ROUTES)
async def test_session_route_with_the_admin_key_says_to_use_the_session_key(
    gateway_without_backends: Gateway, path: str
) -> None:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    status, content_type, body = await _post(gateway_without_backends, path, headers)
    _assert_auth_error(status, content_type, body, ADMIN_KEY_ON_SESSION_ROUTE_MESSAGE)


@pytest.mark.parametrize("path", SESSION_ROUTES)
async def test_session_route_with_an_upstream_key_says_it_is_not_a_session_key(
    gateway_without_backends: Gateway, path: str
) -> None:
    headers = {"Authorization": f"Bearer {UPSTREAM_KEY}"}
    status, content_type, body = await _post(gateway_without_backends, path, headers)
    _assert_auth_error(status, content_type, body, NOT_A_SESSION_KEY_MESSAGE)
    assert "sk-sess-" in body["error"]["message"]


async def test_x_api_key_header_is_checked_like_a_bearer_token(
    gateway_without_backends: Gateway,
) -> None:
    headers = {"x-api-key": ADMIN_KEY}
    status, content_type, body = await _post(
        gateway_without_backends, "/v1/chat/completions", headers
    )
    _assert_auth_error(status, content_type, body, ADMIN_KEY_ON_SESSION_ROUTE_MESSAGE)


@pytest.mark.parametrize("key", ["", "session", "upstream"])
async def test_start_session_without_the_admin_key_is_refused(
    gateway_without_backends: Gateway, session_key: str, key: str
) -> None:
    token = {"": None, "session": session_key, "upstream": UPSTREAM_KEY}[key]
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    status, content_type, body = await _post(gateway_without_backends, "/rl/start_session", headers)
    _assert_auth_error(status, content_type, body, ADMIN_KEY_REQUIRED_MESSAGE)


@pytest.mark.parametrize("path", ["/v1/models", "/models"])
async def test_models_with_an_upstream_key_is_refused(
    gateway_without_backends: Gateway, path: str
) -> None:
    gateway = gateway_without_backends
    headers = {"Authorization": f"Bearer {UPSTREAM_KEY}"}
    async with gateway.http.get(gateway.url + path, headers=headers) as resp:
        _assert_auth_error(
            resp.status, resp.content_type, await resp.json(), NOT_A_SESSION_KEY_MESSAGE
        )
