"""bench/micro.py, one service's hot path in-process: the ledger against a real Redis and a
worker's streamed turns against the mock upstream, each stage, and OpenClaw-sized records over a
framed stream, as a user runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _micro(redis_url: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "micro.py"), *args],
        env={**os.environ, "REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout


def _cpu(line: str) -> float:
    found = re.search(r"([0-9.]+) µs CPU per", line)
    assert found, line
    return float(found.group(1))


def test_the_ledger_costs_some_cpu_per_turn(redis_url: str) -> None:
    out = _micro(redis_url, "ledger", "--turns", "64", "--batch", "4")
    assert out.startswith("ledger (") and "per turn" in out
    assert _cpu(out) > 0


@pytest.mark.parametrize("stage", ["raw", "events", "stream", "turn"])
def test_each_worker_stage_reads_whole_answers(redis_url: str, stage: str) -> None:
    out = _micro(
        redis_url,
        "worker", "--streams", "4", "--clients", "2", "--tokens", "16",
        "--interval-ms", "0", "--stage", stage,
    )  # fmt: skip
    assert out.startswith(f"worker {stage} (") and "per chunk" in out
    assert _cpu(out) > 0


def test_the_framed_stream_answers_every_record(redis_url: str) -> None:
    # Each answer is matched to its record by id (a lost or unknown one fails the run).
    out = _micro(redis_url, "framed", "--messages", "64", "--request-kb", "20", "--ids", "3000")
    assert out.startswith("framed (") and "per message" in out
    assert _cpu(out) > 0
