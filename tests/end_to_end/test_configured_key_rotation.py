"""The configured keys rotate by a rolling restart with zero failed requests (real processes:
two gateways, two dataproxies on one Redis): ROLLGATE_ADMIN_KEY and ROLLGATE_TRAINER_KEY go
old -> old,new -> new,old -> new one replica at a time, while clients start sessions, chat,
log in to the console on one gateway and use the cookie on the other, and call the Trainer
service on both dataproxies; the clients move to the new keys half-way."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from rollgate.stack import Stack
from rollgate.trainer_client import TrainerClient, TrainerError
from tests.harness.processes import log_level_env, stack_config
from tests.harness.secret_scan import ISSUED

MODEL = "rollgate-mock"
GATEWAYS = ("gateway", "gateway-2")
DATAPROXIES = ("dataproxy", "dataproxy-2")
OLD_ADMIN, NEW_ADMIN = (f"rg-admin-{secrets.token_hex(16)}" for _ in range(2))
OLD_TRAINER, NEW_TRAINER = (f"rg-trainer-{secrets.token_hex(16)}" for _ in range(2))


@pytest.fixture(scope="module")
def rolling_stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two gateways and two dataproxies with the old configured keys, one worker, the mock."""
    config = stack_config(
        redis_url,
        Path(tmp_path_factory.mktemp("rolling-keys")),
        prefix="rgroll",
        workers=1,
        replicas={"gateway": 2, "dataproxy": 2},
        admin_key=OLD_ADMIN,
        mock_token_interval_ms=2.0,
        extra_env={**log_level_env(), "ROLLGATE_TRAINER_KEY": OLD_TRAINER},
        start_timeout_s=180.0,
    )
    # The end-of-run scan looks for every key in every log line the processes wrote.
    ISSUED.add(OLD_ADMIN, NEW_ADMIN, OLD_TRAINER, NEW_TRAINER)
    with Stack(config) as running:
        yield running


class Clients:
    """What the clients call with and where: the keys they were last given, the replicas in
    rotation (a load balancer takes a replica out before it restarts), calls in flight per
    replica, and every failure."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.admin_key = OLD_ADMIN
        self.trainer_key = OLD_TRAINER
        self.out: set[str] = set()
        self.in_flight = dict.fromkeys((*GATEWAYS, *DATAPROXIES), 0)
        self.calls: dict[str, int] = {}
        self.failures: list[str] = []
        self.stop = asyncio.Event()
        self.progress = asyncio.Event()

    def live(self, names: tuple[str, ...], turn: int) -> str:
        choices = [name for name in names if name not in self.out]
        return choices[turn % len(choices)]

    def url(self, name: str) -> str:
        return f"http://{self.stack.services[name].address}"

    def note(self, what: str, ok: bool, detail: str) -> None:
        self.calls[what] = self.calls.get(what, 0) + 1
        self.progress.set()
        if not ok:
            self.failures.append(f"{what}: {detail}")

    async def until(self, count: int) -> None:
        """Waits until every kind of call was made `count` more times."""
        target = {kind: self.calls.get(kind, 0) + count for kind in KINDS}
        async with asyncio.timeout(120):
            while any(self.calls.get(kind, 0) < n for kind, n in target.items()):
                self.progress.clear()
                await self.progress.wait()

    async def restart(self, name: str, **env: str) -> None:
        """Takes `name` out of rotation, lets its calls finish, restarts it with `env`."""
        self.out.add(name)
        async with asyncio.timeout(60):
            while self.in_flight[name]:
                self.progress.clear()
                await self.progress.wait()
        await asyncio.to_thread(self.stack.stop_service, name)
        self.stack.services[name].env.update(env)
        await asyncio.to_thread(self.stack.restart_service, name)
        self.out.discard(name)


KINDS = ("start_session", "chat", "models", "end_session", "console", "trainer")


async def request(
    clients: Clients, http: aiohttp.ClientSession, name: str, method: str, path: str, **kw: Any
) -> tuple[int, Any, aiohttp.ClientResponse]:
    clients.in_flight[name] += 1
    try:
        async with http.request(method, clients.url(name) + path, **kw) as resp:
            raw = await resp.read()
            try:
                payload = orjson.loads(raw) if raw else {}
            except orjson.JSONDecodeError:
                payload = raw.decode(errors="replace")[:300]
            return resp.status, payload, resp
    finally:
        clients.in_flight[name] -= 1
        clients.progress.set()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def agent(clients: Clients, http: aiohttp.ClientSession, n: int) -> None:
    """start_session (admin key) -> chat on the other gateway -> models -> end_session."""
    turn = n
    while not clients.stop.is_set():
        turn += 1
        key, here = clients.admin_key, clients.live(GATEWAYS, turn)
        status, started, _ = await request(
            clients, http, here, "POST", "/rl/start_session", json={}, headers=bearer(key)
        )
        clients.note("start_session", status == 200, f"{here} {status} {started}")
        if status != 200:
            continue
        session = started["api_key"]
        there = clients.live(GATEWAYS, turn + 1)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        status, answer, _ = await request(
            clients, http, there, "POST", "/v1/chat/completions", json=body, headers=bearer(session)
        )
        clients.note("chat", status == 200, f"{there} {status} {answer}")
        # Each call picks a replica in rotation afresh (one may have left since the last).
        here = clients.live(GATEWAYS, turn)
        status, models, _ = await request(
            clients, http, here, "GET", "/v1/models", headers=bearer(key)
        )
        clients.note("models", status == 200, f"{here} {status} {models}")
        here = clients.live(GATEWAYS, turn + 1)
        status, ended, _ = await request(
            clients, http, here, "POST", "/rl/end_session", json={}, headers=bearer(session)
        )
        clients.note("end_session", status == 200, f"{here} {status} {ended}")


async def operator(clients: Clients, http: aiohttp.ClientSession) -> None:
    """Logs in to the console on one gateway and reads the overview on both with the cookie
    (signed by one replica, checked by the other; the overview is a gateway->dataproxy call
    carrying the gateway's current admin key)."""
    turn = 0
    while not clients.stop.is_set():
        turn += 1
        here = clients.live(GATEWAYS, turn)
        status, _, resp = await request(
            clients, http, here, "POST", "/console/login",
            data={"admin_key": clients.admin_key}, allow_redirects=False,
        )  # fmt: skip
        cookie = resp.cookies.get("rollgate_console")
        clients.note("console", status == 303 and cookie is not None, f"login {here} {status}")
        if cookie is None:
            continue
        for step in (1, 2):
            there = clients.live(GATEWAYS, turn + step)
            status, overview, _ = await request(
                clients, http, there, "GET", "/console/api/overview",
                headers={"Cookie": f"rollgate_console={cookie.value}"},
            )  # fmt: skip
            clients.note("console", status == 200, f"overview {there} {status} {overview}")


async def trainer(clients: Clients) -> None:
    """GetStats on the dataproxies in rotation, a fresh client per call."""
    turn = 0
    while not clients.stop.is_set():
        turn += 1
        name = clients.live(DATAPROXIES, turn)
        key = clients.trainer_key
        clients.in_flight[name] += 1
        try:
            async with TrainerClient(clients.stack.services[name].address, key) as client:
                await client.stats()
            clients.note("trainer", True, "")
        except TrainerError as err:
            clients.note("trainer", False, f"stats on {name}: {err}")
        finally:
            clients.in_flight[name] -= 1
            clients.progress.set()


async def test_configured_keys_rotate_by_a_rolling_restart_with_zero_failed_requests(
    rolling_stack: Stack,
) -> None:
    clients = Clients(rolling_stack)
    phases = (
        (f"{OLD_ADMIN},{NEW_ADMIN}", f"{OLD_TRAINER},{NEW_TRAINER}"),  # 1. add the new key
        (f"{NEW_ADMIN},{OLD_ADMIN}", f"{NEW_TRAINER},{OLD_TRAINER}"),  # 2. make it current
        (NEW_ADMIN, NEW_TRAINER),  # 4. remove the old one
    )
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        tasks = [asyncio.create_task(agent(clients, http, n)) for n in range(2)]
        tasks += [asyncio.create_task(operator(clients, http))]
        tasks += [asyncio.create_task(trainer(clients))]
        try:
            await clients.until(3)
            for number, (admin, trainer_key) in enumerate(phases):
                if number == 2:
                    # 3. Move the clients to the new keys (every replica accepts them now).
                    clients.admin_key, clients.trainer_key = NEW_ADMIN, NEW_TRAINER
                    await clients.until(3)
                # Gateways and dataproxies alternate, so each phase has mismatched pods.
                for name in ("gateway-2", "dataproxy", "gateway", "dataproxy-2"):
                    env = {"ROLLGATE_ADMIN_KEY": admin}
                    if name in DATAPROXIES:
                        env["ROLLGATE_TRAINER_KEY"] = trainer_key
                    await clients.restart(name, **env)
                    await clients.until(2)
        finally:
            clients.stop.set()
            await asyncio.gather(*tasks)
        assert clients.failures == [], clients.failures[:10]
        assert all(clients.calls[kind] >= 20 for kind in KINDS), clients.calls

        # The old keys are gone everywhere: refused by both gateways and both dataproxies.
        for name in GATEWAYS:
            status, answer, _ = await request(
                clients, http, name, "GET", "/v1/models", headers=bearer(OLD_ADMIN)
            )
            assert status == 401, answer
            status, page, _ = await request(
                clients, http, name, "POST", "/console/login",
                data={"admin_key": OLD_ADMIN}, allow_redirects=False,
            )  # fmt: skip
            assert status == 401, page
        for name in DATAPROXIES:
            for old in (OLD_ADMIN, OLD_TRAINER):
                async with TrainerClient(rolling_stack.services[name].address, old) as client:
                    with pytest.raises(TrainerError) as refused:
                        await client.stats()
                assert refused.value.code == "invalid_trainer_key"
