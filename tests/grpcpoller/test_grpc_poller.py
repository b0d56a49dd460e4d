"""grpc.aio's poller thread does not block on a burst of completions once our channel factory
or the TrainerClient ran (grpcpoller/); without them it does (grpcio 1.85) — which is what can
hang grpc.aio's shutdown, and with it a test's teardown, a stopping service or a trainer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _burst(*args: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.grpcpoller.grpc_burst", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_a_burst_does_not_block_the_poller_behind_our_channels() -> None:
    assert _burst("--unblock") == {"blocked": False, "answered": 600}


def test_a_burst_does_not_block_the_poller_in_a_trainer_process() -> None:
    assert _burst("--trainer-client") == {"blocked": False, "answered": 600}


def test_grpc_alone_blocks_its_poller_on_the_same_burst() -> None:
    # The reason for the module: should a grpcio upgrade stop blocking, this fails and
    # grpcpoller/ can go.
    assert _burst() == {"blocked": True, "answered": 600}
