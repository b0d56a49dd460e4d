"""Every error leaves the gateway as JSON with the right status: bodies, paths, limits."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from services.gateway.chat import parse_chat_body
from services.gateway.http_errors import error_response, method_not_allowed_message
from services.gateway.session_api import parse_set_reward, parse_start_session
from services.runtime.errors import InvalidRequest, TooManyRequests, Unavailable
from services.runtime.secret import Secret
from tests.gateway.conftest import ADMIN_KEY, Gateway


async def _post_raw(
    gateway: Gateway, path: str, data: bytes, key: str | None
) -> tuple[int, str, dict[str, str], Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    headers["Content-Type"] = "application/json"
    async with gateway.http.post(gateway.url + path, data=data, headers=headers) as resp:
        return resp.status, resp.content_type, dict(resp.headers), await resp.json()


def _assert_invalid(status: int, content_type: str, body: Any, fragment: str) -> None:
    assert status == 400, body
    assert content_type == "application/json"
    assert body["error"]["type"] == "invalid_request_error"
    assert fragment in body["error"]["message"]


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"{not json", "not valid JSON"),
        (b"", "empty"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"model": "m"}', "`messages` must be a non-empty list"),
        (b'{"model": "m", "messages": []}', "`messages` must be a non-empty list"),
        (b'{"model": "m", "messages": ["hi"]}', "messages[0] must be an object"),
        (b'{"model": "m", "messages": [{"content": "x"}]}', "string `role`"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "`model` is required"),
        (b'{"model": 3, "messages": [{"role": "user"}]}', "`model` is required"),
        (b'{"model": "m", "stream": "yes", "messages": [{"role": "user"}]}', "`stream`"),
    ],
)
async def test_chat_with_a_bad_body_is_400_saying_what_is_wrong(
    gateway_without_backends: Gateway, session_key: str, data: bytes, fragment: str
) -> None:
    status, content_type, _, body = await _post_raw(
        gateway_without_backends, "/v1/chat/completions", data, session_key
    )
    _assert_invalid(status, content_type, body, fragment)


def test_parse_chat_body_reads_model_and_stream() -> None:
    call = parse_chat_body(b'{"model": "qwen", "stream": true, "messages": [{"role": "user"}]}')
    assert (call.model, call.stream) == ("qwen", True)
    call = parse_chat_body(b'{"model": "qwen", "stream": null, "messages": [{"role": "user"}]}')
    assert call.stream is False


async def test_oversize_body_is_413_json(
    gateway_without_backends: Gateway, session_key: str
) -> None:
    limit = gateway_without_backends.settings.max_body_bytes
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * limit}]})
    status, content_type, _, payload = await _post_raw(
        gateway_without_backends, "/v1/chat/completions", body, session_key
    )
    assert status == 413
    assert content_type == "application/json"
    assert payload["error"]["code"] == "request_too_large"
    assert "too large" in payload["error"]["message"]


async def test_unknown_path_is_404_json(gateway_without_backends: Gateway) -> None:
    gateway = gateway_without_backends
    async with gateway.http.get(gateway.url + "/v2/nothing") as resp:
        assert resp.status == 404
        assert resp.content_type == "application/json"
        body = await resp.json()
    assert body["error"]["type"] == "not_found_error"
    assert body["error"]["code"] == "not_found"


async def test_wrong_method_is_405_json_with_allow(gateway_without_backends: Gateway) -> None:
    gateway = gateway_without_backends
    async with gateway.http.get(gateway.url + "/v1/chat/completions") as resp:
        assert resp.status == 405
        assert resp.content_type == "application/json"
        assert resp.headers["Allow"] == "POST"
        body = await resp.json()
    assert body["error"]["code"] == "method_not_allowed"
    assert body["error"]["message"] == "/v1/chat/completions does not accept GET; use POST"


def test_method_not_allowed_message_lists_every_allowed_method() -> None:
    message = method_not_allowed_message("PUT", "/v1/x", {"POST", "GET"})
    assert message == "/v1/x does not accept PUT; use GET or POST"


@pytest.mark.parametrize(
    "data",
    [
        b'{"reward": true}',
        b'{"reward": "1.0"}',
        b'{"reward": NaN}',
        b'{"reward": Infinity}',
        b'{"reward": -Infinity}',
        b'{"reward": 1e999}',
        b'{"reward": null}',
        b"{}",
    ],
)
async def test_set_reward_with_a_non_finite_reward_is_400(
    gateway_without_backends: Gateway, session_key: str, data: bytes
) -> None:
    status, content_type, _, body = await _post_raw(
        gateway_without_backends, "/rl/set_reward", data, session_key
    )
    _assert_invalid(status, content_type, body, "reward must be a finite number")


def test_parse_set_reward_keeps_integers_and_the_interaction_id() -> None:
    call = parse_set_reward(b'{"reward": 1, "interaction_id": "chatcmpl-1"}')
    assert (call.reward, call.interaction_id) == (1.0, "chatcmpl-1")
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        parse_set_reward(b"{oops")


async def test_start_session_refuses_the_admin_key_as_api_key(
    gateway_without_backends: Gateway,
) -> None:
    data = orjson.dumps({"task_id": "t", "api_key": ADMIN_KEY})
    status, content_type, _, body = await _post_raw(
        gateway_without_backends, "/rl/start_session", data, ADMIN_KEY
    )
    _assert_invalid(status, content_type, body, "api_key is the admin key")


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"[]", "must be a JSON object"),
        (b'{"task_id": 5}', "`task_id` must be a string"),
        (b'{"api_key": 5}', "`api_key` must be a string"),
        (b'{"api_key": "sk-upstream"}', "sk-sess-"),
    ],
)
async def test_start_session_with_a_bad_body_is_400(
    gateway_without_backends: Gateway, data: bytes, fragment: str
) -> None:
    status, content_type, _, body = await _post_raw(
        gateway_without_backends, "/rl/start_session", data, ADMIN_KEY
    )
    _assert_invalid(status, content_type, body, fragment)


def test_parse_start_session_accepts_an_empty_body_and_null_api_key() -> None:
    assert parse_start_session(b"", Secret(ADMIN_KEY)).api_key == ""
    call = parse_start_session(b'{"task_id": "t1", "api_key": null}', Secret(ADMIN_KEY))
    assert (call.task_id, call.api_key) == ("t1", "")


def test_error_response_rounds_retry_after_up_to_whole_seconds() -> None:
    response = error_response(Unavailable("between episodes", retry_after_s=1.2))
    assert response.status == 503
    assert response.headers["Retry-After"] == "2"
    assert response.content_type == "application/json"
    assert orjson.loads(response.body)["error"]["type"] == "service_unavailable"  # type: ignore[arg-type]
    assert "Retry-After" not in error_response(TooManyRequests("slow down")).headers


async def test_chat_when_the_backends_are_unreachable_is_503_with_retry_after(
    gateway_without_backends: Gateway, session_key: str
) -> None:
    data = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    for stream in (False, True):
        body = orjson.loads(data) | {"stream": stream}
        status, content_type, headers, payload = await _post_raw(
            gateway_without_backends, "/v1/chat/completions", orjson.dumps(body), session_key
        )
        assert status == 503
        assert content_type == "application/json"
        assert int(headers["Retry-After"]) >= 1
        # Admission (the dataproxy's ledger) is the turn's first hop, before the router.
        assert payload["error"]["code"] == "dataproxy_unavailable"


async def test_start_session_when_the_dataproxy_is_unreachable_is_503(
    gateway_without_backends: Gateway,
) -> None:
    status, _, headers, body = await _post_raw(
        gateway_without_backends, "/rl/start_session", b"{}", ADMIN_KEY
    )
    assert status == 503
    assert headers["Retry-After"] == "1"
    assert body["error"]["code"] == "dataproxy_unavailable"
