"""`python -m services.gateway` as a real process: start-up event, health, clean stop."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp
import orjson

from tests.gateway.conftest import ADMIN_KEY

REPO = Path(__file__).resolve().parents[2]
START_DEADLINE_S = 20.0


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLGATE_")}
    return env | {"ROLLGATE_LOG_JSON": "1"} | extra


async def _read_started_port(stream: asyncio.StreamReader) -> int:
    async with asyncio.timeout(START_DEADLINE_S):
        while line := await stream.readline():
            event = orjson.loads(line) if line.startswith(b"{") else {}
            if event.get("event") == "service_started":
                return int(event["port"])
    raise AssertionError("the gateway exited without a service_started event")


async def test_gateway_process_reports_its_port_serves_health_and_stops_on_sigterm(
    dead_address: str,
) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.gateway",
        "--port",
        "0",
        cwd=REPO,
        env=_env(
            ROLLGATE_ADMIN_KEY=ADMIN_KEY,
            ROLLGATE_ROUTER_ADDR=dead_address,
            ROLLGATE_DATAPROXY_ADDR=dead_address,
        ),
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stderr is not None
        port = await _read_started_port(process.stderr)
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{port}/health") as resp,
        ):
            assert resp.status == 200
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(START_DEADLINE_S):
            await process.stderr.read()
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_gateway_process_without_admin_key_exits_with_a_clear_error() -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.gateway",
        cwd=REPO,
        env=_env(),
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(START_DEADLINE_S):
        _, stderr = await process.communicate()
    assert process.returncode != 0
    assert b"ROLLGATE_ADMIN_KEY is not set" in stderr
