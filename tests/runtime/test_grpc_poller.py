"""grpc.aio's poller thread does not block on a burst of completions once our channel factory
ran (services/runtime/grpc_poller.py); without it, it does (grpcio 1.85) — which is what can
hang grpc.aio's shutdown, and with it a test's teardown or a stopping service."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _burst(*args: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.runtime.grpc_burst", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_a_burst_does_not_block_the_poller_behind_our_channels() -> None:
    assert _burst("--unblock") == {"blocked": False, "answered": 1000}


def test_grpc_alone_blocks_its_poller_on_the_same_burst() -> None:
    # The reason for the module: should a grpcio upgrade stop blocking, this fails and
    # services/runtime/grpc_poller.py can go.
    assert _burst() == {"blocked": True, "answered": 1000}
