"""The console in a real headless Chromium (Debian's `chromium`, driven over DevTools): log in
through the form, watch the live page fill in from a scripted workload, open a trajectory in
the viewer; screenshots of each page; no key in any page, URL or cookie."""

from __future__ import annotations

import os
import struct
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgpack  # type: ignore[import-untyped]
import pytest
import redis.asyncio as aioredis

from protos import trainer_pb2, trainer_pb2_grpc
from services.dataproxy.redis_keys import RedisKeys
from services.gateway.console_auth import CONFIGURED, COOKIE_NAME, ConsoleCookies
from services.runtime.secret import Secret
from tests.gateway.conftest import ADMIN_KEY
from tests.harness.browser import Browser, Page
from tests.harness.inprocess import MOCK_MODEL, Upstream, running_full_chain

AUTH = (("authorization", f"Bearer {ADMIN_KEY}"),)
REWARDS = (0.25, 0.5, 1.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    url: str
    session_keys: list[str]
    open_session: str
    stream_ids: list[str]
    trajectories: list[dict[str, Any]]


async def _post(http: aiohttp.ClientSession, url: str, key: str, body: Any) -> Any:
    async with http.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
        return resp.status, await resp.json()


async def _run_workload(
    url: str, http: aiohttp.ClientSession, trainer: trainer_pb2_grpc.TrainerStub
) -> tuple[list[str], str]:
    """Three published episodes (the third after a version change), one left open, one chat
    with an unknown key, one the upstream refuses (429); a trainer pulls two and acks one."""
    keys = []
    for i, reward in enumerate(REWARDS):
        if i == 2:
            await trainer.SetWeightVersion(
                trainer_pb2.SetWeightVersionRequest(version=1), metadata=AUTH, timeout=5
            )
        _, started = await _post(http, url + "/rl/start_session", ADMIN_KEY, {"task_id": "math"})
        key = started["api_key"]
        keys.append(key)
        for turn in range(2):
            body = {
                "model": MOCK_MODEL,
                "messages": [{"role": "user", "content": f"question {i}.{turn} <b>bold?</b>"}],
                "stream": turn == 1,
            }
            async with http.post(
                url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            ) as resp:
                assert resp.status == 200
                await resp.read()
        assert (await _post(http, url + "/rl/set_reward", key, {"reward": reward}))[0] == 200
        assert (await _post(http, url + "/rl/end_session", key, {}))[0] == 200
    _, started = await _post(http, url + "/rl/start_session", ADMIN_KEY, {"task_id": "open"})
    keys.append(started["api_key"])
    body = {"model": MOCK_MODEL, "messages": [{"role": "user", "content": "still going"}]}
    assert (await _post(http, url + "/v1/chat/completions", started["api_key"], body))[0] == 200
    unknown = "sk-sess-" + "u" * 43
    assert (await _post(http, url + "/v1/chat/completions", unknown, body))[0] == 401
    # Refused by the upstream, behind the worker: the gateway reports it with the release.
    refused = {"model": MOCK_MODEL, "messages": [{"role": "user", "content": "please /fail-429"}]}
    assert (await _post(http, url + "/v1/chat/completions", started["api_key"], refused))[0] == 429
    pull = trainer.PullTrajectories(
        trainer_pb2.PullTrajectoriesRequest(
            include_history=True, group="g1", consumer="c", max_count=2, idle_timeout_s=2
        ),
        metadata=AUTH,
        timeout=20,
    )
    pulled = [m.stream_id async for m in pull]
    await trainer.Ack(trainer_pb2.AckRequest(group="g1", stream_ids=pulled[:1]), metadata=AUTH)
    return keys, started["session_id"]


@pytest.fixture
async def workload(
    redis_url: str, key_prefix: str, redis_client: aioredis.Redis
) -> AsyncIterator[Workload]:
    async with running_full_chain(
        redis_url,
        key_prefix,
        admin_key=ADMIN_KEY,
        upstreams=[Upstream(worker_id="w-1", kind="vllm"), Upstream(worker_id="w-2", kind="vllm")],
    ) as chain:
        keys, open_session = await _run_workload(chain.url, chain.http, chain.trainer)
        entries: Any = await redis_client.xrange(RedisKeys(key_prefix).trajectories)
        yield Workload(
            url=chain.url,
            session_keys=keys,
            open_session=open_session,
            stream_ids=[e[0].decode() for e in entries],
            trajectories=[msgpack.unpackb(e[1][b"data"]) for e in entries],
        )


def _secrets(workload: Workload) -> list[str]:
    return [ADMIN_KEY, *workload.session_keys]


async def _no_secret_in(page: Page, workload: Workload) -> None:
    html = await page.html()
    urls = "\n".join(page.requested_urls) + "\n" + await page.url()
    for secret in _secrets(workload):
        assert secret not in html
        assert secret not in urls


def _screenshot_dir(tmp_path: Path) -> Path:
    """Where the screenshots go: $ROLLGATE_SCREENSHOT_DIR if set (to look at them), else tmp."""
    return Path(os.environ.get("ROLLGATE_SCREENSHOT_DIR") or tmp_path / "screenshots")


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


async def _text(page: Page, selector: str) -> str:
    return str(await page.evaluate(f"document.querySelector({selector!r}).textContent"))


async def test_live_page_and_viewer_in_headless_chromium(
    workload: Workload, tmp_path: Path
) -> None:
    shots = _screenshot_dir(tmp_path)
    async with Browser() as browser:
        page = await browser.new_page()
        await page.goto(workload.url + "/console")
        assert await page.url() == workload.url + "/console/login"
        login_png = await page.screenshot(shots / "console-login.png")
        assert _png_size(login_png)[0] >= 1000

        # A wrong key: refused, no cookie.
        await page.evaluate(
            "document.getElementById('admin_key').value = 'not-the-key';"
            "document.querySelector('form').submit()"
        )
        await page.wait_for(
            "document.getElementById('error')?.textContent.includes('not an admin key')"
        )
        assert not [c for c in await page.cookies() if c["name"] == COOKIE_NAME]

        # The admin key, typed into the form as a person would.
        await page.evaluate(
            f"document.getElementById('admin_key').value = {ADMIN_KEY!r};"
            "document.querySelector('form').submit()"
        )
        await page.wait_for(f"location.href === {workload.url + '/console'!r}")
        (cookie,) = [c for c in await page.cookies() if c["name"] == COOKIE_NAME]
        assert cookie["httpOnly"] is True and cookie["sameSite"] == "Strict"
        assert cookie["path"] == "/console" and ADMIN_KEY not in cookie["value"]
        # The page fills itself from the API; every number is what the workload did.
        await page.wait_for("document.getElementById('c-published').textContent === '3'")
        assert await _text(page, "#c-consumed") == "1"
        assert await _text(page, "#c-sessions") == "1"
        assert await _text(page, "#c-workers") == "2"
        assert await _text(page, "#c-weight_version") == "1"
        assert await _text(page, "#c-exact") == "100.0 %"
        assert await _text(page, "#c-in_flight") == "0"
        groups = await page.evaluate(
            "[...document.querySelectorAll('#groups tbody tr')].map(r => [...r.cells].map(c => c.textContent))"
        )
        assert [row[:4] for row in groups] == [["g1", "1", "1", "1"]]
        workers = await page.evaluate(
            "[...document.querySelectorAll('#workers tbody tr')].map(r => r.cells[0].textContent + ' ' + r.cells[1].textContent)"
        )
        assert sorted(workers) == ["w-1 live", "w-2 live"]
        sessions = await page.evaluate(
            "[...document.querySelectorAll('#sessions tbody tr')].map(r => [r.cells[0].textContent, r.cells[2].textContent, r.cells[3].textContent])"
        )
        assert sessions == [[workload.open_session, "active", "1"]]
        recent = await page.evaluate("document.querySelectorAll('#recent tbody tr').length")
        assert recent == 3
        await page.wait_for("document.getElementById('errors').textContent.includes('Worker')")
        rows = await page.evaluate(
            "[...document.querySelectorAll('#errors tbody tr')].map(r => [...r.cells].slice(1).map(c => c.textContent))"
        )
        assert ["Ledger.begin", "UNAUTHENTICATED"] in [row[:2] for row in rows]
        (upstream,) = [row for row in rows if row[0] == "Worker.Complete"]
        assert upstream[1] == "RESOURCE_EXHAUSTED"
        assert upstream[2].startswith("upstream_rate_limited: the upstream is rate limiting")
        # One dot per published trajectory on the rewards chart.
        assert await page.evaluate("document.querySelectorAll('#chart-rewards circle').length") == 3
        # It keeps updating by itself.
        first = await page.evaluate("document.body.dataset.updated")
        await page.wait_for(f"document.body.dataset.updated !== {first!r}", timeout_s=10)
        live_png = await page.screenshot(shots / "console-live.png")
        assert _png_size(live_png)[0] >= 1000 and len(live_png) > 20_000
        await _no_secret_in(page, workload)

        # The viewer: the newest trajectory opens first; each sampled token is a coloured chip.
        await page.goto(workload.url + "/console/trajectories")
        await page.wait_for("document.querySelectorAll('#list li').length === 3")
        newest = workload.stream_ids[-1]
        await page.wait_for(f"document.body.dataset.shown === {newest!r}")
        trajectory = workload.trajectories[-1]
        tokens = [len(i["output_token_ids"]) // 4 for i in trajectory["interactions"]]
        chips = await page.evaluate(
            "[...document.querySelectorAll('section.turn')].map(s => s.querySelectorAll('.tok').length)"
        )
        assert chips == tokens and all(n > 0 for n in tokens)
        first_turn = trajectory["interactions"][0]
        first_id = struct.unpack("<i", first_turn["output_token_ids"][:4])[0]
        first_logprob = struct.unpack("<f", first_turn["output_logprobs"][:4])[0]
        chip = await page.evaluate(
            "(() => { const t = document.querySelector('section.turn .tok');"
            " return {text: t.textContent, title: t.title, bg: t.style.background}; })()"
        )
        assert chip["text"] == str(first_id)
        assert f"logprob {round(first_logprob, 4)}" in chip["title"]
        assert "weight version 1" in chip["title"] and "exact id" in chip["title"]
        assert chip["bg"].startswith("rgb")  # coloured by its probability
        badges = await _text(page, "section.turn h3")
        assert "exact ids" in badges and "reward" in badges
        assert await _text(page, "#final-reward") == "1.000"
        # Messages are shown as text, never as HTML.
        assert await page.evaluate("document.querySelectorAll('.msg b').length") == 0
        assert "<b>bold?</b>" in await _text(page, "section.turn details")
        viewer_png = await page.screenshot(shots / "console-viewer.png")
        assert _png_size(viewer_png)[0] >= 1000 and len(viewer_png) > 20_000
        # Another trajectory, picked from the list.
        oldest = workload.stream_ids[0]
        await page.evaluate(
            f"document.querySelector('#list li[data-stream-id=\"{oldest}\"]').click()"
        )
        await page.wait_for(f"document.body.dataset.shown === {oldest!r}")
        assert await _text(page, "#final-reward") == "0.250"
        assert "weight version 0" in await page.evaluate("document.querySelector('.tok').title")
        await _no_secret_in(page, workload)
        assert page.console_errors == []

        # An expired cookie (as if the tab stayed shut past its life): back to the login page.
        expired = ConsoleCookies(Secret(ADMIN_KEY), session_s=900, max_login_s=3600).issue(
            CONFIGURED, now=time.time() - 1000
        )
        await page.set_cookie(COOKIE_NAME, expired, workload.url)
        await page.goto(workload.url + "/console")
        assert await page.url() == workload.url + "/console/login"
        # Logged in again, then logged out: the cookie is gone.
        await page.evaluate(
            f"document.getElementById('admin_key').value = {ADMIN_KEY!r};"
            "document.querySelector('form').submit()"
        )
        await page.wait_for(f"location.href === {workload.url + '/console'!r}")
        await page.evaluate("document.getElementById('logout').click()")
        await page.wait_for(f"location.href === {workload.url + '/console/login'!r}")
        assert not [c for c in await page.cookies() if c["name"] == COOKIE_NAME]
