"""Run as a script by test_grpc_poller.py, in a process of its own (grpc.aio's poller is one
per process): a burst of completions while the event loop is busy. The server (grpc's sync
server, in threads) holds every answer until all calls have arrived; the client then blocks
its loop and releases them, so all the answers come while the loop does not turn. Prints one
JSON line: did the poller thread block in write(), how many calls were answered."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rollgate.trainer_client import TrainerClient
from services.runtime.grpc_client import open_channel
from tests.harness.poll import eventually

# More answers than the poller's socket holds unread (≈ 200 to 300 one-byte writes).
CALLS = 600
# How long the loop stays busy at most once the answers are released.
BUSY_S = 5.0


class HeldHealth(health.HealthServicer):  # type: ignore[misc]  # untyped grpc_health
    """Answers each Check once `release` is set; counts the calls that arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self._lock = threading.Lock()
        self.arrived = 0

    def Check(self, request: Any, context: Any) -> Any:
        with self._lock:
            self.arrived += 1
        self.release.wait(timeout=60)
        return super().Check(request, context)


def _poller_blocked() -> bool:
    """A thread of this process asleep in a socket write that waits for buffer space."""
    return any(
        (task / "wchan").read_text() == "sock_alloc_send_pskb"
        for task in Path("/proc/self/task").iterdir()
    )


def _busy_loop(release: threading.Event) -> bool:
    """Releases the answers and keeps the event loop from turning meanwhile (a blocking wait,
    on purpose) until the poller blocks, or BUSY_S; whether it blocked."""
    release.set()
    due = time.monotonic() + BUSY_S
    while time.monotonic() < due:
        if _poller_blocked():
            return True
        time.sleep(0.05)
    return False


async def _burst(address: str, servicer: HeldHealth, how: str) -> dict[str, object]:
    if how == "--trainer-client":
        # The TrainerClient's channel (the poller is one per process: the burst's channel,
        # opened after it, shares it).
        async with TrainerClient(address, "unused"):
            return await _burst(address, servicer, "")
    channel = open_channel(address) if how == "--unblock" else grpc.aio.insecure_channel(address)
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        calls = [
            asyncio.ensure_future(stub.Check(health_pb2.HealthCheckRequest(), timeout=60))
            for _ in range(CALLS)
        ]
        await eventually(
            lambda: servicer.arrived == CALLS, timeout_s=30, what="every call reached the server"
        )
        blocked = _busy_loop(servicer.release)
        answers = await asyncio.gather(*calls, return_exceptions=True)
    answered = sum(1 for a in answers if isinstance(a, health_pb2.HealthCheckResponse))
    return {"blocked": blocked, "answered": answered}


def main() -> None:
    servicer = HeldHealth()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=CALLS))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        how = sys.argv[1] if sys.argv[1:] else ""
        result = asyncio.run(_burst(f"127.0.0.1:{port}", servicer, how))
    finally:
        servicer.release.set()
        server.stop(None)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
