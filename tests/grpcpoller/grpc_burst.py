"""Run as a script by test_grpc_poller.py, in a process of its own (grpc.aio's poller is one
per process): a burst of completions while the event loop is busy. Prints one JSON line: did
the poller thread block in write(), how many calls were answered."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rollgate.trainer_client import TrainerClient
from services.runtime.grpc_client import open_channel

CALLS = 1000
# How long the loop stays busy at most: the burst's answers arrive within it.
BUSY_S = 3.0


def _poller_blocked() -> bool:
    """A thread of this process asleep in a socket write that waits for buffer space."""
    return any(
        (task / "wchan").read_text() == "sock_alloc_send_pskb"
        for task in Path("/proc/self/task").iterdir()
    )


def _busy_loop() -> bool:
    """Keeps the event loop from turning (a blocking wait, on purpose: the burst's answers
    pile up for it) until the poller blocks, or BUSY_S; whether it blocked."""
    due = time.monotonic() + BUSY_S
    while time.monotonic() < due:
        if _poller_blocked():
            return True
        time.sleep(0.05)
    return False


async def _burst(address: str, how: str) -> dict[str, object]:
    if how == "--trainer-client":
        # The TrainerClient's channel (the poller is one per process: the burst's channel,
        # opened after it, shares it).
        async with TrainerClient(address, "unused"):
            return await _burst(address, "")
    channel = open_channel(address) if how == "--unblock" else grpc.aio.insecure_channel(address)
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        calls = [
            asyncio.ensure_future(stub.Check(health_pb2.HealthCheckRequest(), timeout=30))
            for _ in range(CALLS)
        ]
        await asyncio.sleep(0)  # one turn: every call is sent
        blocked = _busy_loop()
        answers = await asyncio.gather(*calls, return_exceptions=True)
    answered = sum(1 for a in answers if isinstance(a, health_pb2.HealthCheckResponse))
    return {"blocked": blocked, "answered": answered}


def main() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        how = sys.argv[1] if sys.argv[1:] else ""
        result = asyncio.run(_burst(f"127.0.0.1:{port}", how))
    finally:
        server.stop(None)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
