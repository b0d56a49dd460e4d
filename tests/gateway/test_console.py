"""The console over HTTP: login only with an admin key (configured or issued), a signed,
short-lived, stateless cookie that any replica accepts and that is refused when expired,
forged or its key revoked; never a key in a URL, a page, a cookie or an answer."""

from __future__ import annotations

import base64
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis

from services.gateway.app import GatewayServer
from services.gateway.console_auth import CONFIGURED, COOKIE_NAME, ConsoleCookies
from services.runtime.secret import Secret
from tests.gateway.conftest import ADMIN_KEY, gateway_settings
from tests.harness.inprocess import MOCK_MODEL, Upstream, running_full_chain


@dataclass(frozen=True, slots=True, kw_only=True)
class Console:
    url: str
    other_url: str
    http: aiohttp.ClientSession
    seen: list[str]

    async def get(self, path: str, *, cookie: str | None = None, **kw: Any) -> tuple[int, Any, Any]:
        """GET without following redirects; status, headers, body (JSON when JSON)."""
        return await self._send("GET", self.url + path, cookie=cookie, **kw)

    async def post(
        self, path: str, *, cookie: str | None = None, **kw: Any
    ) -> tuple[int, Any, Any]:
        return await self._send("POST", self.url + path, cookie=cookie, **kw)

    async def _send(
        self, method: str, url: str, *, cookie: str | None, **kw: Any
    ) -> tuple[int, Any, Any]:
        headers = dict(kw.pop("headers", {}))
        if cookie is not None:
            headers["Cookie"] = f"{COOKIE_NAME}={cookie}"
        async with (
            aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as fresh,
            fresh.request(method, url, headers=headers, allow_redirects=False, **kw) as resp,
        ):
            raw = await resp.read()
            self.seen.append(str(resp.url) + str(dict(resp.headers)) + raw.decode(errors="replace"))
            body = orjson.loads(raw) if resp.content_type == "application/json" else raw.decode()
            return resp.status, resp.headers, body

    async def login(self, key: str) -> tuple[int, Any, str]:
        status, headers, body = await self.post("/console/login", data={"admin_key": key})
        return status, headers, body


@pytest.fixture
async def console(
    redis_url: str, key_prefix: str, redis_client: aioredis.Redis
) -> AsyncIterator[Console]:
    async with running_full_chain(
        redis_url, key_prefix, admin_key=ADMIN_KEY, upstreams=[Upstream(worker_id="w-console")]
    ) as chain:
        settings = gateway_settings(
            router_addr=chain.router_addr, dataproxy_addr=chain.dataproxy_addr
        )
        async with GatewayServer(settings) as other:
            yield Console(
                url=chain.url,
                other_url=f"http://127.0.0.1:{other.port}",
                http=chain.http,
                seen=[],
            )


def _cookie_of(headers: Any) -> str:
    """The console's Set-Cookie header line."""
    (line,) = [h for h in headers.getall("Set-Cookie") if h.startswith(COOKIE_NAME + "=")]
    return str(line)


def _value(set_cookie: str) -> str:
    return set_cookie.split(";", 1)[0].split("=", 1)[1]


async def test_pages_need_a_login_and_the_login_needs_the_admin_key(console: Console) -> None:
    for path in ("/console", "/console/trajectories"):
        status, headers, _ = await console.get(path)
        assert status == 303 and headers["Location"] == "/console/login"
    status, headers, body = await console.get("/console/login")
    assert status == 200 and 'type="password"' in body and 'method="post"' in body
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    assert headers["X-Frame-Options"] == "DENY" and headers["Cache-Control"] == "no-store"
    session_key = await _session_key(console)
    for wrong in ["", "nope", ADMIN_KEY + "x", session_key, "sk-admin-" + "a" * 43]:
        status, headers, body = await console.login(wrong)
        assert status == 401, wrong
        assert "That is not an admin key." in body
        assert "Set-Cookie" not in headers
        assert not wrong or wrong not in body
    # No form at all, or JSON instead of a form: refused too.
    status, _, _ = await console.post("/console/login", json={"admin_key": ADMIN_KEY})
    assert status == 400
    for path in ("/console/api/overview", "/console/api/trajectories"):
        status, _, body = await console.get(path)
        assert status == 401 and body["error"]["code"] == "console_login_required"
        status, _, body = await console.get(
            path, headers={"Authorization": f"Bearer {session_key}"}
        )
        assert status == 401


async def test_a_login_form_that_cannot_be_read_is_a_400_login_page(console: Console) -> None:
    body = f"admin_key={ADMIN_KEY}".encode()
    for content_type in (
        "multipart/form-data",  # no boundary
        "multipart/form-data; boundary=zz",  # a boundary the body does not have
        "application/x-www-form-urlencoded; charset=no-such-charset",
    ):
        status, headers, page = await console.post(
            "/console/login", data=body, headers={"Content-Type": content_type}
        )
        assert status == 400, (content_type, page)
        assert headers["Content-Type"].startswith("text/html"), content_type
        assert "The login form could not be read" in page and "Set-Cookie" not in headers
        assert ADMIN_KEY not in page


async def test_a_key_in_a_url_is_refused_and_never_logs_in(console: Console) -> None:
    status, headers, body = await console.get(f"/console/login?admin_key={ADMIN_KEY}")
    assert status == 400 and "never put a key in a URL" in body
    assert "Set-Cookie" not in headers and ADMIN_KEY not in body
    status, headers, _ = await console.post(
        f"/console/login?admin_key={ADMIN_KEY}", data={"admin_key": ADMIN_KEY}
    )
    assert status == 400 and "Set-Cookie" not in headers
    status, _, body = await console.get(f"/console/api/overview?key={ADMIN_KEY}")
    assert status == 400 and body["error"]["code"] == "key_in_url"


async def test_the_admin_key_logs_in_with_a_strict_short_lived_cookie(console: Console) -> None:
    status, headers, _ = await console.login(ADMIN_KEY)
    assert status == 303 and headers["Location"] == "/console"
    set_cookie = _cookie_of(headers)
    attributes = [a.strip().lower() for a in set_cookie.split(";")[1:]]
    assert "httponly" in attributes
    assert "samesite=strict" in attributes
    assert "path=/console" in attributes
    assert "max-age=900" in attributes
    cookie = _value(set_cookie)
    assert ADMIN_KEY not in cookie
    claims = orjson.loads(base64.urlsafe_b64decode(cookie.split(".")[1] + "=="))
    assert claims["sub"] == CONFIGURED and claims["exp"] - claims["iat"] == 900
    status, headers, body = await console.get("/console", cookie=cookie)
    assert status == 200 and "Live" in body and ADMIN_KEY not in body
    status, _, overview = await console.get("/console/api/overview", cookie=cookie)
    assert status == 200 and overview["counters"]["published"] == 0
    # The same cookie works on another gateway replica: nothing is shared but the admin key.
    async with (
        aiohttp.ClientSession() as http,
        http.get(
            console.other_url + "/console/api/overview",
            headers={"Cookie": f"{COOKIE_NAME}={cookie}"},
        ) as resp,
    ):
        assert resp.status == 200
    # The admin key as a bearer token (what `rollgate status` sends) works without a cookie.
    status, _, _ = await console.get(
        "/console/api/overview", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert status == 200
    # Logging out forgets the cookie.
    status, headers, _ = await console.post("/console/logout", cookie=cookie)
    assert status == 303 and 'rollgate_console=""' in headers["Set-Cookie"]


async def test_expired_and_forged_cookies_are_refused(console: Console) -> None:
    ours = ConsoleCookies(Secret(ADMIN_KEY), session_s=900, max_login_s=3600)
    expired = ours.issue(CONFIGURED, now=time.time() - 901)
    too_old = ours._issue(CONFIGURED, login_at=int(time.time()) - 4000, now=int(time.time()) - 10)
    future = ours.issue(CONFIGURED, now=time.time() + 3600)
    other = ConsoleCookies(Secret("another-admin-key"), session_s=900, max_login_s=3600)
    foreign = other.issue(CONFIGURED)
    good = ours.issue(CONFIGURED)
    version, payload, signature = good.split(".")
    claims = orjson.loads(base64.urlsafe_b64decode(payload + "=="))
    claims["exp"] += 10_000
    stretched = base64.urlsafe_b64encode(orjson.dumps(claims)).rstrip(b"=").decode()
    forged = [
        f"{version}.{stretched}.{signature}",  # a longer life, old signature
        f"{version}.{payload}.{signature[:-2]}AA",  # a changed signature
        foreign,  # signed under another admin key
        "v1.e30.AAAA",
        "garbage",
        f"v2.{payload}.{signature}",
    ]
    for cookie in [expired, too_old, future, *forged]:
        status, headers, _ = await console.get("/console", cookie=cookie)
        assert status == 303 and headers["Location"] == "/console/login", cookie
        status, _, _ = await console.get("/console/api/overview", cookie=cookie)
        assert status == 401, cookie
    status, _, _ = await console.get("/console/api/overview", cookie=good)
    assert status == 200


async def test_a_cookie_is_renewed_while_in_use_up_to_the_login_limit(console: Console) -> None:
    ours = ConsoleCookies(Secret(ADMIN_KEY), session_s=900, max_login_s=12 * 3600)
    half_gone = ours.issue(CONFIGURED, now=time.time() - 500)
    status, headers, _ = await console.get("/console/api/overview", cookie=half_gone)
    assert status == 200
    renewed = _value(_cookie_of(headers))
    assert ours.check(renewed).expires_at > ours.check(half_gone).expires_at
    assert ours.check(renewed).login_at == ours.check(half_gone).login_at
    fresh = ours.issue(CONFIGURED)
    status, headers, _ = await console.get("/console/api/overview", cookie=fresh)
    assert status == 200 and "Set-Cookie" not in headers


async def test_an_issued_admin_key_logs_in_until_it_is_revoked(console: Console) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    status, _, issued = await console.post("/rl/keys", json={"kind": "admin"}, headers=admin)
    assert status == 200, issued
    key = issued["api_key"]
    status, headers, _ = await console.login(key)
    assert status == 303
    cookie = _value(_cookie_of(headers))
    assert key not in cookie
    assert (await console.get("/console/api/overview", cookie=cookie))[0] == 200
    status, _, _ = await console.post("/rl/keys/revoke", json={"api_key": key}, headers=admin)
    assert status == 200

    # At once: the very next call, though the key was checked a moment ago.
    status, _, answer = await console.get("/console/api/overview", cookie=cookie)
    assert status == 401, answer
    assert (await console.login(key))[0] == 401


async def test_no_key_in_any_console_answer(console: Console) -> None:
    session_key = await _session_key(console, chat=True)
    console.seen.clear()  # start_session itself answers with the key: only console answers
    _, headers, _ = await console.login(ADMIN_KEY)
    cookie = _value(_cookie_of(headers))
    for path in (
        "/console",
        "/console/trajectories",
        "/console/api/overview",
        "/console/api/trajectories",
        "/console/static/live.js",
        "/console/static/viewer.js",
        "/console/static/console.css",
    ):
        status, _, _ = await console.get(path, cookie=cookie)
        assert status == 200, path
    status, _, _ = await console.get("/console/static/../app.py", cookie=cookie)
    assert status == 404
    text = "\n".join(console.seen)
    assert ADMIN_KEY not in text
    assert session_key not in text


async def _session_key(console: Console, *, chat: bool = False) -> str:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    _, _, started = await console.post("/rl/start_session", json={}, headers=admin)
    key = str(started["api_key"])
    if chat:
        body = {"model": MOCK_MODEL, "messages": [{"role": "user", "content": "hi"}]}
        status, _, _ = await console.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        )
        assert status == 200
    return key


async def _login_from(url: str, address: str, key: str) -> tuple[int, Any, str]:
    """POST /console/login from a given loopback address (127.0.0.x)."""
    connector = aiohttp.TCPConnector(local_addr=(address, 0))
    async with (
        aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar()) as http,
        http.post(url + "/console/login", data={"admin_key": key}, allow_redirects=False) as resp,
    ):
        return resp.status, resp.headers, await resp.text()


async def test_refused_logins_are_limited_per_client_address_with_a_429_login_page(
    dead_address: str,
) -> None:
    settings = dataclasses.replace(
        gateway_settings(router_addr=dead_address, dataproxy_addr=dead_address),
        console_login_failures_per_min=3,
    )
    async with GatewayServer(settings) as gateway:
        url = f"http://127.0.0.1:{gateway.port}"
        for _ in range(3):
            status, _, _ = await _login_from(url, "127.0.0.1", "not-the-key")
            assert status == 401
        # The budget of this address is spent: even the right key waits, told how long.
        for key in ("not-the-key", ADMIN_KEY):
            status, headers, body = await _login_from(url, "127.0.0.1", key)
            assert status == 429, body
            assert headers["Content-Type"].startswith("text/html")
            assert 'type="password"' in body  # the login page again, with the reason
            assert "Too many refused logins from your address" in body
            assert 1 <= int(headers["Retry-After"]) <= 20
            assert "Set-Cookie" not in headers and ADMIN_KEY not in body
            assert headers["X-Frame-Options"] == "DENY"
        # Another address is not held back.
        status, headers, _ = await _login_from(url, "127.0.0.2", ADMIN_KEY)
        assert status == 303 and COOKIE_NAME in headers["Set-Cookie"]
        logins = {
            sample.labels["result"]: sample.value
            for family in gateway.metrics.registry.collect()
            for sample in family.samples
            if sample.name == "rollgate_gateway_console_logins_total"
        }
        assert logins == {"refused": 3.0, "limited": 2.0, "ok": 1.0}
