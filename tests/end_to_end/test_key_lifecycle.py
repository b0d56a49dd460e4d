"""Key lifecycle across real processes (two gateways, two dataproxies on one Redis): a revoked
key is refused on every route the gateway registers, and admin and trainer keys rotate
(add new, move clients, revoke old) with zero failed requests."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import msgpack  # type: ignore[import-untyped]
import orjson
import pytest
import redis

from protos import keys_pb2, keys_pb2_grpc
from rollgate.stack import Stack
from rollgate.trainer_client import TrainerClient, TrainerError
from services.gateway.app import build_app
from services.gateway.settings import GatewaySettings
from services.runtime.grpc_client import open_channel
from services.runtime.secret import Secret
from tests.harness.processes import log_level_env, stack_config

MODEL = "rollgate-mock"
T = 30.0
# No key at all: these answer anyone.
PUBLIC = {"/health", "/ready", "/metrics"}
# Registered only to say they are not served (a 404 for anyone, as an unknown path is).
NOT_SERVED = ("/v1/messages/count_tokens",)
# Only an admin key opens these (and every /console route): a session key, revoked or not, is
# not an admin key.
ADMIN_ONLY = {"/rl/start_session", "/rl/keys", "/rl/keys/revoke"}


@pytest.fixture(scope="module")
def keys_stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two gateways and two dataproxies (replicas share Redis), one worker, the mock."""
    config = stack_config(
        redis_url,
        Path(tmp_path_factory.mktemp("keys-stack")),
        prefix="rgkeys",
        workers=1,
        replicas={"gateway": 2, "dataproxy": 2},
        mock_token_interval_ms=2.0,
        extra_env=log_level_env(),
        start_timeout_s=180.0,
    )
    with Stack(config) as running:
        yield running


def gateways(stack: Stack) -> list[str]:
    return [f"http://{stack.services[n].address}" for n in ("gateway", "gateway-2")]


def chat_body(text: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}]}


async def call(
    http: aiohttp.ClientSession,
    method: str,
    url: str,
    key: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    all_headers = {"Authorization": f"Bearer {key}", **(headers or {})}
    async with http.request(method, url, json=body, headers=all_headers) as resp:
        raw = await resp.read()
        try:
            payload: dict[str, Any] = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError:
            payload = {"raw": raw.decode(errors="replace")}
        return resp.status, payload


def registered_routes() -> list[tuple[str, str]]:
    """(method, path) of every route the gateway app registers (routes added later are here)."""
    app = build_app(GatewaySettings(admin_key=Secret("enumeration-only")))
    found = []
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter") or ""
        if route.method != "HEAD" and path:
            found.append((route.method, str(path)))
    return sorted(set(found))


def concrete_path(path: str) -> str:
    """A registered route's path with its placeholders filled in."""
    concrete = path.replace("{response_id}", "resp_" + uuid.uuid4().hex)
    for name, value in (
        ("{session_id}", "s-1"),
        ("{rollout_id}", "s"),
        ("{attempt_id}", "1"),
        ("{stream_id}", "1-1"),
        ("{name}", "console.css"),
    ):
        concrete = concrete.replace(name, value)
    return concrete


def trajectories_of(stack: Stack, key_id: str) -> list[dict[str, Any]]:
    client = redis.Redis.from_url(stack.redis_url)
    try:
        entries: Any = client.xrange(f"{stack.config.redis_prefix}trajectories")
    finally:
        client.close()
    decoded = [msgpack.unpackb(fields[b"data"], raw=False) for _id, fields in entries]
    return [t for t in decoded if t.get("key_id") == key_id]


async def ws_connect_answer(http: aiohttp.ClientSession, gateway: str, key: str) -> Any:
    """The `connect` answer for `key` and how the socket ended."""
    async with http.ws_connect(gateway.replace("http://", "ws://") + "/ws") as ws:
        await ws.receive(timeout=T)  # connect.challenge
        params = {
            "minProtocol": 4,
            "maxProtocol": 4,
            "client": {"id": "cli", "version": "2026.9.6", "platform": "linux", "mode": "cli"},
            "auth": {"token": key},
        }
        frame = {"type": "req", "id": "1", "method": "connect", "params": params}
        await ws.send_str(orjson.dumps(frame).decode())
        answer = orjson.loads((await ws.receive(timeout=T)).data)
        closing = await ws.receive(timeout=T)
        return answer, closing.type, ws.close_code


async def test_a_revoked_key_is_refused_on_every_route_the_gateway_registers(
    keys_stack: Stack,
) -> None:
    admin = keys_stack.config.admin_key
    gw1, gw2 = gateways(keys_stack)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        status, started = await call(http, "POST", f"{gw1}/rl/start_session", admin, {})
        assert status == 200, started
        session_key = started["api_key"]
        assert (await call(http, "POST", f"{gw1}/v1/chat/completions", session_key,
                           chat_body("hi")))[0] == 200  # fmt: skip
        status, issued = await call(http, "POST", f"{gw2}/rl/keys", admin, {"mode": "header"})
        assert status == 200, issued
        header_key = issued["api_key"]
        sid = {"X-Session-Id": "s-1"}
        assert (await call(http, "POST", f"{gw2}/v1/chat/completions", header_key,
                           chat_body("hi"), sid))[0] == 200  # fmt: skip
        # Both keys in use on both gateways (whatever a replica remembers about a key, e.g. that
        # it is a header-mode key, is warm there) before the revocation on one of them.
        for gateway in (gw1, gw2):
            status, answer = await call(
                http, "POST", f"{gateway}/sessions/s-1/v1/chat/completions", header_key,
                chat_body("warm"),
            )  # fmt: skip
            assert status == 200, answer
            status, answer = await call(http, "GET", f"{gateway}/v1/models", session_key)
            assert status == 200, answer
        # A connection opened before the revocation is refused after it.
        ws_url = gw2.replace("http://", "ws://") + "/ws"
        open_ws = await http.ws_connect(ws_url)
        await open_ws.receive(timeout=T)
        params = {"minProtocol": 4, "maxProtocol": 4, "auth": {"token": session_key},
                  "client": {"id": "cli", "version": "1", "platform": "linux", "mode": "cli"}}  # fmt: skip
        await open_ws.send_str(
            orjson.dumps({"type": "req", "id": "1", "method": "connect", "params": params}).decode()
        )
        assert orjson.loads((await open_ws.receive(timeout=T)).data)["ok"]

        status, revoked = await call(
            http, "POST", f"{gw1}/rl/keys/revoke", admin, {"api_key": session_key}
        )
        assert status == 200, revoked
        assert (revoked["kind"], revoked["episodes_discarded"]) == ("session", 1)
        status, revoked_h = await call(
            http, "POST", f"{gw2}/rl/keys/revoke", admin, {"key_id": issued["key_id"]}
        )
        assert status == 200, revoked_h
        assert (revoked_h["kind"], revoked_h["episodes_discarded"]) == ("header", 1)

        await open_ws.send_str(
            orjson.dumps(
                {"type": "req", "id": "2", "method": "sessions.list", "params": {}}
            ).decode()
        )
        refused = orjson.loads((await open_ws.receive(timeout=T)).data)
        assert refused["ok"] is False and refused["error"]["details"]["code"] == "key_revoked"
        assert (await open_ws.receive(timeout=T)).type == aiohttp.WSMsgType.CLOSE
        await open_ws.close()

        routes = registered_routes()
        assert ("POST", "/v1/chat/completions") in routes and ("GET", "/ws") in routes
        checked = 0
        for method, path in routes:
            if path in PUBLIC or path == "/ws":
                continue
            concrete = concrete_path(path)
            for gateway in (gw1, gw2):
                for key, headers in ((session_key, {}), (header_key, sid)):
                    # Valid for every POST route: chat (messages), Responses (input), reward,
                    # Anthropic Messages (max_tokens).
                    body = {**chat_body("after"), "input": "after", "reward": 1.0, "max_tokens": 8}
                    status, answer = await call(
                        http,
                        method,
                        gateway + concrete,
                        key,
                        body if method == "POST" else None,
                        headers,
                    )
                    what = f"{method} {path} on {gateway}"
                    if path.endswith(NOT_SERVED):
                        # Nothing to refuse: the same 404 for any key, revoked or not.
                        assert status == 404, (what, status, answer)
                        assert answer["error"]["code"] == "count_tokens_not_served", what
                        continue
                    assert status == 401, (what, status, answer)
                    admin_only = path in ADMIN_ONLY or path.startswith("/console")
                    expected = "admin_key_required" if admin_only else "key_revoked"
                    assert answer["error"]["code"] == expected, (what, answer)
                    assert answer["error"]["message"], what
                    checked += 1
        assert checked >= 4 * 10
        for gateway in (gw1, gw2):
            for key in (session_key, header_key):
                answer, closed, code = await ws_connect_answer(http, gateway, key)
                assert answer["ok"] is False and answer["error"]["details"]["code"] == "key_revoked"
                assert "revoked" in answer["error"]["message"]
                assert closed == aiohttp.WSMsgType.CLOSE and code == 1008
            # An admin refreshing the revoked key is refused too: no replacement key is minted.
            status, answer = await call(
                http, "POST", f"{gateway}/rl/start_session", admin, {"api_key": session_key}
            )
            assert status == 401 and answer["error"]["code"] == "key_revoked"
    assert trajectories_of(keys_stack, revoked["key_id"]) == []
    assert trajectories_of(keys_stack, issued["key_id"]) == []


class Rotation:
    """Clients that keep calling with whatever key they were last given, counting failures."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.calls: dict[str, int] = {}
        self.failures: list[str] = []
        self.stop = asyncio.Event()
        self.called = asyncio.Event()

    def note(self, key: str, ok: bool, what: str) -> None:
        self.calls[key] = self.calls.get(key, 0) + 1
        self.called.set()
        if not ok:
            self.failures.append(what)

    async def until(self, key: str, count: int) -> None:
        """Waits until `count` calls were made with `key` (bounded by the test's deadline)."""
        async with asyncio.timeout(120):
            while self.calls.get(key, 0) < count:
                self.called.clear()
                await self.called.wait()


async def admin_client(
    http: aiohttp.ClientSession, gateways: list[str], rotation: Rotation, n: int
) -> None:
    """start_session → chat → end_session in a loop, alternating gateways."""
    for i in range(400):
        if rotation.stop.is_set():
            return
        key, gateway = rotation.key, gateways[(n + i) % 2]
        status, started = await call(http, "POST", f"{gateway}/rl/start_session", key, {})
        rotation.note(key, status == 200, f"start_session {status} {started}")
        if status != 200:
            continue
        other = gateways[(n + i + 1) % 2]
        session = started["api_key"]
        status, answer = await call(
            http, "POST", f"{other}/v1/chat/completions", session, chat_body("hi")
        )
        rotation.note(key, status == 200, f"chat {status} {answer}")
        status, models = await call(http, "GET", f"{gateway}/v1/models", key)
        rotation.note(key, status == 200, f"models {status} {models}")
        status, ended = await call(http, "POST", f"{gateway}/rl/end_session", session, {})
        rotation.note(key, status == 200, f"end_session {status} {ended}")


async def trainer_client(addresses: list[str], rotation: Rotation) -> None:
    """GetStats on both dataproxies in a loop, with a fresh client per key."""
    for _ in range(2000):
        if rotation.stop.is_set():
            return
        key = rotation.key
        for address in addresses:
            async with TrainerClient(address, key) as trainer:
                try:
                    await trainer.stats()
                    rotation.note(key, True, "")
                except TrainerError as err:
                    rotation.note(key, False, f"stats on {address}: {err}")


async def test_admin_and_trainer_keys_rotate_across_replicas_with_zero_failed_requests(
    keys_stack: Stack,
) -> None:
    admin = keys_stack.config.admin_key
    gws = gateways(keys_stack)
    dataproxies = [keys_stack.services[n].address for n in ("dataproxy", "dataproxy-2")]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:

        async def issue(gateway: str, using: str, kind: str) -> dict[str, Any]:
            status, got = await call(
                http, "POST", f"{gateway}/rl/keys", using, {"kind": kind, "label": "rotation"}
            )
            assert status == 200, got
            return got

        old_admin = await issue(gws[0], admin, "admin")
        old_trainer = await issue(gws[0], admin, "trainer")
        admins = Rotation(old_admin["api_key"])
        trainers = Rotation(old_trainer["api_key"])
        clients = [asyncio.create_task(admin_client(http, gws, admins, n)) for n in range(3)] + [
            asyncio.create_task(trainer_client(dataproxies, trainers))
        ]
        try:
            await admins.until(old_admin["api_key"], 12)
            await trainers.until(old_trainer["api_key"], 6)
            # 1. Add the new keys (on the other gateway: another replica's work).
            new_admin = await issue(gws[1], old_admin["api_key"], "admin")
            new_trainer = await issue(gws[1], old_admin["api_key"], "trainer")
            # 2. Move the clients.
            admins.key, trainers.key = new_admin["api_key"], new_trainer["api_key"]
            await admins.until(new_admin["api_key"], 12)
            await trainers.until(new_trainer["api_key"], 6)
            # 3. Remove the old keys; the clients keep going on the new ones.
            for old in (old_admin, old_trainer):
                status, revoked = await call(
                    http, "POST", f"{gws[0]}/rl/keys/revoke", new_admin["api_key"],
                    {"key_id": old["key_id"]},
                )  # fmt: skip
                assert status == 200 and not revoked["already_revoked"], revoked
            await admins.until(new_admin["api_key"], 24)
            await trainers.until(new_trainer["api_key"], 12)
        finally:
            admins.stop.set()
            trainers.stop.set()
            await asyncio.gather(*clients)
        assert admins.failures == [] and trainers.failures == []

        status, listed = await call(http, "GET", f"{gws[1]}/rl/keys", new_admin["api_key"])
        assert status == 200
        ids = {k["key_id"] for k in listed["keys"]}
        assert {new_admin["key_id"], new_trainer["key_id"]} <= ids
        assert not {old_admin["key_id"], old_trainer["key_id"]} & ids
        assert all("api_key" not in k for k in listed["keys"])
        for gateway in gws:
            for method, path in (("POST", "/rl/start_session"), ("GET", "/v1/models")):
                status, answer = await call(
                    http, method, gateway + path, old_admin["api_key"],
                    {} if method == "POST" else None,
                )  # fmt: skip
                assert status == 401 and answer["error"]["code"] == "key_revoked", answer
        for address in dataproxies:
            async with TrainerClient(address, old_trainer["api_key"]) as trainer:
                with pytest.raises(TrainerError) as refused:
                    await trainer.stats()
            assert refused.value.code == "key_revoked"
        # The configured admin key keeps working throughout, and cannot be revoked by API.
        status, answer = await call(
            http, "POST", f"{gws[0]}/rl/keys/revoke", admin, {"api_key": admin}
        )
        assert status == 409 and answer["error"]["code"] == "configured_key"
        assert (await call(http, "GET", f"{gws[0]}/v1/models", admin))[0] == 200


async def test_the_keys_service_mints_nothing_for_a_caller_without_an_admin_key(
    keys_stack: Stack,
) -> None:
    """A trainer pod reaches the dataproxy's port: it must not issue itself an admin key."""
    gw1, _ = gateways(keys_stack)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        status, trainer = await call(
            http, "POST", f"{gw1}/rl/keys", keys_stack.config.admin_key, {"kind": "trainer"}
        )
        assert status == 200, trainer
        status, answer = await call(http, "POST", f"{gw1}/rl/keys", trainer["api_key"], {})
        assert status == 401 and answer["error"]["code"] == "admin_key_required"
    async with open_channel(keys_stack.trainer_address) as channel:
        stub = keys_pb2_grpc.KeysStub(channel)
        for metadata in ((), (("authorization", f"Bearer {trainer['api_key']}"),)):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.IssueAccessKey(
                    keys_pb2.IssueAccessKeyRequest(kind="admin"), metadata=metadata, timeout=10
                )
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "needs an admin key" in (refused.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.RevokeKey(
                    keys_pb2.RevokeKeyRequest(key_id=trainer["key_id"]),
                    metadata=metadata,
                    timeout=10,
                )
        admin = (("authorization", f"Bearer {keys_stack.config.admin_key}"),)
        listed = await stub.ListAccessKeys(keys_pb2.ListAccessKeysRequest(), metadata=admin)
        assert trainer["key_id"] in {k.key_id for k in listed.keys}, "nothing was revoked"


# Routes an admin key opens (besides ADMIN_ONLY and /console): a revoked one is told so there.
ADMIN_OR_SESSION = ("/models",)


async def test_a_revoked_admin_key_is_refused_on_every_route_the_gateway_registers(
    keys_stack: Stack,
) -> None:
    admin = keys_stack.config.admin_key
    gw1, gw2 = gateways(keys_stack)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        status, issued = await call(http, "POST", f"{gw1}/rl/keys", admin, {"kind": "admin"})
        assert status == 200, issued
        leaked = issued["api_key"]
        # In use on both gateways (and the Trainer service) right up to the revocation.
        for gateway in (gw1, gw2):
            assert (await call(http, "GET", f"{gateway}/rl/keys", leaked))[0] == 200
        async with TrainerClient(keys_stack.trainer_address, leaked) as trainer:
            await trainer.stats()
        status, revoked = await call(
            http, "POST", f"{gw2}/rl/keys/revoke", admin, {"key_id": issued["key_id"]}
        )
        assert status == 200 and revoked["kind"] == "admin", revoked

        checked = 0
        for method, path in registered_routes():
            if path in PUBLIC or path == "/ws" or path.endswith(NOT_SERVED):
                continue
            if path == "/console/login" or path.startswith("/console/static"):
                continue  # the login form itself and its stylesheet: open to anyone
            for gateway in (gw1, gw2):
                body = {**chat_body("after"), "input": "after", "reward": 1.0, "max_tokens": 8,
                        "kind": "admin", "key_id": issued["key_id"]}  # fmt: skip
                status, answer = await call(
                    http,
                    method,
                    gateway + concrete_path(path),
                    leaked,
                    body if method == "POST" else None,
                    {"X-Session-Id": "s-1"},
                )
                what = f"{method} {path} on {gateway}"
                assert status == 401, (what, status, answer)
                opens_for_admin = (
                    path in ADMIN_ONLY
                    or path.startswith("/console")
                    or path.endswith(ADMIN_OR_SESSION)
                ) and not path.startswith(("/sessions/", "/rollout/"))
                if opens_for_admin:
                    assert answer["error"]["code"] == "key_revoked", (what, answer)
                assert answer["error"]["message"], what
                checked += 1
        assert checked >= 2 * 10
        # Logging in to the console with it fails too.
        async with http.post(f"{gw1}/console/login", data={"admin_key": leaked},
                             allow_redirects=False) as resp:  # fmt: skip
            assert resp.status == 401
        async with TrainerClient(keys_stack.trainer_address, leaked) as trainer:
            with pytest.raises(TrainerError) as refused:
                await trainer.stats()
        assert refused.value.code == "key_revoked"
