"""Shared fixtures: a real Redis (REDIS_URL, else our own redis-server), never a skip."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import os
import sys
import threading
import traceback
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import redis.asyncio as aioredis

from rollgate.redis_server import RedisServer
from tests.harness.secret_scan import ISSUED, scan

# Service processes the tests start bind their metrics port anywhere free: the per-service
# defaults (9051, 9052, …) would collide between test runs sharing a machine. Tests that need
# a metrics port set it explicitly (the stack gives every process its own).
os.environ.setdefault("ROLLGATE_METRICS_PORT", "0")

# The real-engine suite (tests/engine) needs vLLM's own venv: `make test-engine` builds it and
# names its python here. `make test` leaves the suite out.
collect_ignore = [] if os.environ.get("ROLLGATE_ENGINE_PYTHON") else ["engine"]

# A hang pytest-timeout cannot break ends the run with every thread's stack instead of using up
# CI's time in silence: its SIGALRM needs the main thread to run Python, which a C extension
# holding the GIL or a wait that retries on EINTR never lets it. A watchdog thread first names
# the test and its phase (setup, call, teardown: CI shows the end of the output, and a dump
# alone does not say which test hung), dumps every thread's stack and ends the run; should the
# GIL never come free for it, faulthandler's C watchdog does the dump and the exit a minute
# later. Both write to the terminal's stderr, dup'ed before capture hides it.
# Per test, setup and teardown included; pytest-timeout's is 300. The variable is for the
# watchdog's own test.
HARD_DEADLINE_S = float(os.environ.get("ROLLGATE_TEST_HARD_DEADLINE_S", "420"))
_terminal_stderr: list[int] = []
_running: dict[str, str] = {}


def pytest_configure(config: pytest.Config) -> None:
    # Capture is suspended while plugins configure; resuming it here would hand the terminal
    # reporter (configured after this conftest) the captured stdout: no progress, no header.
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is None:
        _terminal_stderr.append(os.dup(2))
        return
    with capture.global_and_fixture_disabled():
        _terminal_stderr.append(os.dup(2))


def _hung(nodeid: str) -> None:
    fd = _terminal_stderr[0]
    phase = _running.get("phase", "?")
    os.write(fd, f"\n+++ {nodeid} hung in {phase} for {HARD_DEADLINE_S} s +++\n".encode())
    faulthandler.dump_traceback(file=fd, all_threads=True)
    # CI keeps the end of the output: what is waiting, innermost frame last, goes there.
    with contextlib.suppress(Exception):
        os.write(fd, _waiting_now().encode(errors="replace"))
    os.write(fd, f"+++ {nodeid} hung in {phase} for {HARD_DEADLINE_S} s: run ended +++\n".encode())
    os._exit(3)


def _waiting_now(main_frames: int = 12, tasks: int = 20, frames: int = 6) -> str:
    """Where each thread waits in the kernel, the main thread's innermost frames, then the
    asyncio tasks not done and what each awaits; innermost frame last."""
    lines = ["--- threads: where each waits in the kernel ---", _kernel_waits()]
    lines.append("--- the main thread (innermost frame last) ---")
    main = sys._current_frames().get(threading.main_thread().ident or 0)
    if main is not None:
        lines += traceback.format_list(traceback.extract_stack(main)[-main_frames:])
    lines.append("--- asyncio tasks not done (innermost frame last) ---")
    pending = [t for t in list(asyncio.tasks._all_tasks) if not t.done()]  # type: ignore[attr-defined]
    for task in pending[:tasks]:
        lines.append(f"task {task.get_name()}:")
        stack, awaited = _await_chain(task.get_coro())
        lines += traceback.format_list(
            traceback.StackSummary.extract((frame, frame.f_lineno) for frame in stack[-frames:])
        )
        lines.append(f"    awaiting {awaited!r:.300}")
    if len(pending) > tasks:
        lines.append(f"... and {len(pending) - tasks} more tasks")
    return "\n".join(line.rstrip("\n") for line in lines) + "\n"


def _kernel_waits() -> str:
    """Each thread's name and kernel wait channel (`sock_alloc_send_pskb`: blocked writing to
    a full socket, as grpc.aio's poller does: grpcpoller/)."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return "(no /proc here)"
    waits = []
    for task in sorted(tasks.iterdir(), key=lambda path: int(path.name)):
        with contextlib.suppress(OSError):
            name = (task / "comm").read_text().strip()
            waits.append(f"{name}:{(task / 'wchan').read_text().strip() or '-'}")
    return " ".join(waits)


def _await_chain(awaitable: Any) -> tuple[list[FrameType], Any]:
    """The frames of a suspended coroutine down the chain of what each awaits (a task's own
    stack stops at its coroutine's frame), and the awaitable at the bottom (a future)."""
    frames: list[FrameType] = []
    for _ in range(100):
        frame = getattr(awaitable, "cr_frame", None) or getattr(awaitable, "gi_frame", None)
        frame = frame or getattr(awaitable, "ag_frame", None)
        if frame is None:
            break
        frames.append(frame)
        awaitable = (
            getattr(awaitable, "cr_await", None)
            or getattr(awaitable, "gi_yieldfrom", None)
            or getattr(awaitable, "ag_await", None)
        )
    return frames, awaitable


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    watchdog = threading.Timer(HARD_DEADLINE_S, _hung, args=(item.nodeid,))
    watchdog.daemon = True
    watchdog.start()
    faulthandler.dump_traceback_later(HARD_DEADLINE_S + 60, exit=True, file=_terminal_stderr[0])
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        watchdog.cancel()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    _running["phase"] = "setup"
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    _running["phase"] = "call"
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    _running["phase"] = "teardown"
    yield


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A Redis URL for the whole test session: REDIS_URL if set, else a private redis-server."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    with RedisServer() as server:
        yield server.url


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A client for the test; the database is flushed first when it is our own server."""
    client = aioredis.Redis.from_url(redis_url)
    if not os.environ.get("REDIS_URL"):
        await client.flushdb()
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
def key_prefix() -> str:
    """A unique Redis key prefix per test, so tests never see each other's data."""
    return f"rgtest:{uuid.uuid4().hex[:8]}:"


@pytest.fixture(scope="session", autouse=True)
def no_key_in_any_log() -> Iterator[None]:
    """After the run: no key a test issued (nor any session key) in any real process's log."""
    yield
    scanned = scan(ISSUED)
    assert not scanned.leaks, (
        f"secrets in {len(scanned.leaks)} of {scanned.lines} log lines: "
        + "; ".join(
            f"{leak.path.name}:{leak.line_number} has {leak.what}" for leak in scanned.leaks[:20]
        )
    )
    assert not scanned.silent, f"no log line to scan in {scanned.silent[:5]}"
