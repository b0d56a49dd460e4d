"""Sessions named in the URL path (`/sessions/<id>/v1/...`, rLLM / verl / miles style): a stock
client whose base_url names the session, with a header-mode key, through the gateway in front
of the real router, dataproxy, worker and mock LLM."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from services.gateway.app import PROTOCOLS, build_app
from services.gateway.protocols import Twins, routes_of
from services.gateway.url_sessions import ATTEMPT_PREFIX, SESSION_PREFIX
from tests.gateway.conftest import ADMIN_KEY, gateway_settings
from tests.gateway.test_header_mode import issue, trajectories
from tests.gateway.test_lifecycle import MODEL, Chain, ChainFactory, chain

__all__ = ["chain"]


async def call(
    c: Chain,
    method: str,
    path: str,
    key: str | None,
    body: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    all_headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with c.http.request(
        method, c.url + path, json=body, headers=all_headers | (headers or {})
    ) as resp:
        return resp.status, await resp.json()


def chat_body(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}


async def test_an_sdk_whose_base_url_names_the_session_is_recorded_in_that_episode(
    chain: ChainFactory,
) -> None:
    async with chain() as c:
        key = (await issue(c))["api_key"]
        sdk = openai.AsyncOpenAI(
            base_url=f"{c.url}/sessions/agent-7/v1", api_key=key, max_retries=0
        )
        models = await sdk.models.list()
        assert [m.id for m in models.data] == ["default", MODEL]
        plain = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "plain"}]
        )
        stream = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "streamed"}], stream=True
        )
        streamed_id = ""
        async for chunk in stream:
            streamed_id = chunk.id
        response = await sdk.responses.create(model=MODEL, input="a response")
        assert (await sdk.responses.retrieve(response.id)).id == response.id
        # Another session of the same key stays apart.
        other = openai.AsyncOpenAI(
            base_url=f"{c.url}/sessions/agent-8/v1", api_key=key, max_retries=0
        )
        await other.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "elsewhere"}]
        )
        assert await c.redis.xlen(c.keys.trajectories) == 0

        status, rewarded = await call(
            c, "POST", "/sessions/agent-7/rl/set_reward", key, {"reward": 0.5}
        )
        assert status == 200 and rewarded["interaction_id"] == response.id
        status, ended = await call(c, "POST", "/sessions/agent-7/rl/end_session", key, {})
        assert status == 200 and ended["interaction_count"] == 3, ended

        (trajectory,) = await trajectories(c)
        assert trajectory["session_id"] == "agent-7"
        ids = [i["interaction_id"] for i in trajectory["interactions"]]
        assert ids == [plain.id, streamed_id, response.id]
        assert trajectory["final_reward"] == 0.5


async def test_the_path_ends_the_episode_with_x_session_done_as_the_header_would(
    chain: ChainFactory,
) -> None:
    async with chain() as c:
        key = (await issue(c))["api_key"]
        path = "/sessions/s:1.a_b-C/v1/chat/completions"
        assert (await call(c, "POST", path, key, chat_body("one")))[0] == 200
        done = {"X-Session-Done": "true", "X-Turn-Type": "side"}
        assert (await call(c, "POST", path, key, chat_body("two"), done))[0] == 200
        (trajectory,) = await trajectories(c)
        assert trajectory["session_id"] == "s:1.a_b-C"
        assert trajectory["end_reason"] == "session_done"
        assert [i["turn_type"] for i in trajectory["interactions"]] == ["main", "side"]


async def test_a_per_episode_key_on_a_session_path_is_400_saying_to_use_a_header_mode_key(
    chain: ChainFactory,
) -> None:
    async with chain() as c:
        status, started = await call(c, "POST", "/rl/start_session", ADMIN_KEY, {"task_id": "t"})
        assert status == 200
        key = started["api_key"]
        for method, path, body in [
            ("POST", "/sessions/s/v1/chat/completions", chat_body("hi")),
            ("POST", "/sessions/s/v1/responses", {"model": MODEL, "input": "hi"}),
            ("GET", "/sessions/s/v1/models", None),
            ("POST", "/sessions/s/rl/set_reward", {"reward": 1.0}),
            ("POST", "/sessions/s/rl/end_session", {}),
        ]:
            status, error = await call(c, method, path, key, body)
            assert status == 400, (path, error)
            assert error["error"]["code"] == "session_path_needs_header_key"
            assert "header-mode key" in error["error"]["message"]
            assert "POST /rl/keys" in error["error"]["message"]
        # Nothing was recorded, and the same key still works without the path.
        assert (await call(c, "POST", "/v1/chat/completions", key, chat_body("hi")))[0] == 200
        status, ended = await call(c, "POST", "/rl/end_session", key, {})
        assert status == 200 and ended["interaction_count"] == 1


async def test_a_path_id_that_disagrees_with_x_session_id_or_the_body_is_400(
    chain: ChainFactory,
) -> None:
    async with chain() as c:
        key = (await issue(c))["api_key"]
        path = "/sessions/a/v1/chat/completions"
        status, error = await call(c, "POST", path, key, chat_body("x"), {"X-Session-Id": "b"})
        assert status == 400 and error["error"]["code"] == "session_id_conflict"
        assert "'a'" in error["error"]["message"] and "'b'" in error["error"]["message"]
        # The same id in both is fine.
        assert (await call(c, "POST", path, key, chat_body("x"), {"X-Session-Id": "a"}))[0] == 200
        for route in ("/sessions/a/rl/set_reward", "/sessions/a/rl/end_session"):
            status, error = await call(c, "POST", route, key, {"reward": 1, "session_id": "b"})
            assert status == 400 and error["error"]["code"] == "session_id_conflict", error
        status, _ = await call(
            c, "POST", "/sessions/a/rl/set_reward", key, {"reward": 1, "session_id": "a"}
        )
        assert status == 200
        assert await c.redis.xlen(c.keys.trajectories) == 0  # the refused end ended nothing


@pytest.mark.parametrize(
    "session_id", ["", "x" * 129, "with%20space", "caf%C3%A9", "semi;colon", "a%2Fb", "q%3Fx"]
)
async def test_a_malformed_path_session_id_is_400_saying_what_an_id_may_be(
    chain: ChainFactory, session_id: str
) -> None:
    async with chain() as c:
        key = (await issue(c))["api_key"]
        status, error = await call(
            c, "POST", f"/sessions/{session_id}/v1/chat/completions", key, chat_body("x")
        )
        assert status == 400, error
        assert error["error"]["code"] == "invalid_session_id"
        assert "1 to 128 characters" in error["error"]["message"]


async def test_the_longest_allowed_path_id_names_the_episode(chain: ChainFactory) -> None:
    async with chain() as c:
        key = (await issue(c))["api_key"]
        sid = "A-z0.9_:" * 16
        assert len(sid) == 128
        path = f"/sessions/{sid}/v1/chat/completions"
        assert (await call(c, "POST", path, key, chat_body("x")))[0] == 200
        status, ended = await call(c, "POST", f"/sessions/{sid}/rl/end_session", key)
        assert status == 200 and ended["session_id"] == sid


async def test_keys_on_a_session_path_are_checked_as_on_the_plain_routes(
    chain: ChainFactory,
) -> None:
    async with chain() as c:
        path = "/sessions/s/v1/chat/completions"
        status, error = await call(c, "POST", path, None, chat_body("x"))
        assert status == 401 and error["error"]["code"] == "missing_api_key"
        status, error = await call(c, "POST", path, ADMIN_KEY, chat_body("x"))
        assert status == 401 and error["error"]["code"] == "admin_key_not_allowed"
        unknown = "sk-sess-" + "u" * 43
        status, error = await call(c, "POST", path, unknown, chat_body("x"))
        assert status == 401, error
        # The models list takes the admin key on a session path as it does without one.
        status, listed = await call(c, "GET", "/sessions/s/v1/models", ADMIN_KEY)
        assert status == 200 and [m["id"] for m in listed["data"]] == ["default", MODEL]


# The session-key routes (the protocols in services/gateway/app.py declare them).
SCOPED_PATHS = {
    "/v1/chat/completions",
    "/chat/completions",
    "/v1/responses",
    "/responses",
    "/v1/responses/{response_id}",
    "/responses/{response_id}",
    "/v1/messages",
    "/v1/models",
    "/models",
    "/rl/set_reward",
    "/rl/end_session",
}


def test_every_session_key_route_has_a_twin_under_the_session_prefix() -> None:
    app = build_app(gateway_settings(router_addr="127.0.0.1:1", dataproxy_addr="127.0.0.1:1"))
    routes = {
        (route.method, route.resource.canonical)
        for route in app.router.routes()
        if route.resource is not None
    }
    plain = {(method, path) for method, path in routes if path in SCOPED_PATHS}
    assert {path for _, path in plain} == SCOPED_PATHS
    twinned = {(r.method, r.path) for r in routes_of(PROTOCOLS) if r.twins is Twins.SESSION}
    assert twinned == plain
    for prefix in (SESSION_PREFIX, ATTEMPT_PREFIX):
        canonical = prefix.replace(":[^{}/]*", "")
        for method, path in plain:
            assert (method, canonical + path) in routes
        # Nothing else is twinned but the count_tokens 404, which needs no key.
        under = {(m, p.removeprefix(canonical)) for m, p in routes if p.startswith(canonical)}
        assert under == plain | {("POST", "/v1/messages/count_tokens")}


async def test_a_revoked_key_on_a_session_path_is_401_key_revoked_whatever_its_mode(
    chain: ChainFactory,
) -> None:
    async with chain() as c:
        header_key = (await issue(c))["api_key"]
        status, started = await call(c, "POST", "/rl/start_session", ADMIN_KEY, {"task_id": "t"})
        episode_key = started["api_key"]
        path = "/sessions/s/v1/chat/completions"
        # Both modes are seen (and the header mode remembered) before the revocation.
        assert (await call(c, "POST", path, header_key, chat_body("x")))[0] == 200
        assert (await call(c, "POST", path, episode_key, chat_body("x")))[0] == 400
        for key in (header_key, episode_key):
            status, _ = await call(c, "POST", "/rl/keys/revoke", ADMIN_KEY, {"api_key": key})
            assert status == 200
            status, error = await call(c, "POST", path, key, chat_body("x"))
            assert status == 401 and error["error"]["code"] == "key_revoked", error


async def test_an_agent_lightning_attempt_path_names_the_episode_rollout_colon_attempt(
    chain: ChainFactory,
) -> None:
    async with chain() as c:
        key = (await issue(c))["api_key"]
        base = f"{c.url}/rollout/ro-7f3a/attempt/at-0001/v1"
        sdk = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0)
        answer = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "attempt one"}]
        )
        path = "/rollout/ro-7f3a/attempt/at-0001/rl/end_session"
        status, ended = await call(c, "POST", path, key, {})
        assert status == 200 and ended["session_id"] == "ro-7f3a:at-0001", ended
        (trajectory,) = await trajectories(c)
        assert trajectory["session_id"] == "ro-7f3a:at-0001"
        assert [i["interaction_id"] for i in trajectory["interactions"]] == [answer.id]
        bad = "/rollout/ro 1/attempt/at-1/v1/chat/completions"
        status, error = await call(c, "POST", bad, key, chat_body("x"))
        assert status == 400 and error["error"]["code"] == "invalid_session_id"
        long_ids = f"/rollout/{'r' * 64}/attempt/{'a' * 64}/v1/chat/completions"
        status, error = await call(c, "POST", long_ids, key, chat_body("x"))
        assert status == 400 and error["error"]["code"] == "invalid_session_id"
