"""The suite's hard per-test deadline (tests/conftest.py): a test that hangs where
pytest-timeout cannot reach ends the run, and what is printed names the test and the phase it
hung in before every thread's stack."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

HANGS = """
import threading

import pytest


@pytest.fixture
def stuck_on_the_way_out():
    yield
    threading.Event().wait()  # a teardown that never returns


def test_fine():
    pass


def test_hangs_in_teardown(stuck_on_the_way_out):
    pass
"""

ASYNC_HANG = """
import asyncio

import pytest


async def wait_for_what_never_comes(event):
    await event.wait()


@pytest.fixture
async def stuck_on_the_way_out():
    yield
    event = asyncio.Event()
    waiter = asyncio.get_running_loop().create_task(wait_for_what_never_comes(event))
    await waiter  # an async teardown waiting for a task that never ends


async def test_hangs_in_async_teardown(stuck_on_the_way_out):
    pass
"""


def _run_hanging(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_hangs.py").write_text(source)
    plugins = ["-p", "no:timeout", "-p", "no:cacheprovider", "-p", "tests.conftest"]
    alone = ["--rootdir", str(tmp_path), "-c", os.devnull, "-o", "asyncio_mode=auto"]
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *plugins, *alone, str(tmp_path / "test_hangs.py")],
        cwd=REPO,
        env={**os.environ, "ROLLGATE_TEST_HARD_DEADLINE_S": "2"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_hang_is_named_and_ends_the_run(tmp_path: Path) -> None:
    done = _run_hanging(tmp_path, HANGS)
    assert done.returncode == 3, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    named = "test_hangs.py::test_hangs_in_teardown hung in teardown for 2.0 s"
    assert named in done.stderr
    # the last line says it again, below the stacks, which name the hanging frame
    assert done.stderr.rstrip().splitlines()[-1].endswith(f"{named}: run ended +++")
    assert "stuck_on_the_way_out" in done.stderr
    assert "test_fine" not in done.stderr


def test_the_end_of_the_output_shows_what_an_async_hang_waits_for(tmp_path: Path) -> None:
    done = _run_hanging(tmp_path, ASYNC_HANG)
    assert done.returncode == 3, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    # CI keeps only the end: the main thread's innermost frames, then the pending task and
    # what it awaits, come just above the last line.
    tail = done.stderr.rstrip().splitlines()
    assert tail[-1].endswith(
        "test_hangs_in_async_teardown hung in teardown for 2.0 s: run ended +++"
    )
    end = "\n".join(tail[-60:])
    assert "asyncio tasks not done" in end
    # every thread's kernel wait (a poller blocked writing shows `sock_alloc_send_pskb`)
    assert "--- threads: where each waits in the kernel ---" in end
    kernel = end[end.index("where each waits in the kernel") :].splitlines()[1]
    assert len(kernel.split()) >= 1 and all(":" in word for word in kernel.split())
    assert "wait_for_what_never_comes" in end
    assert "await event.wait()" in end
    main = end[end.index("--- the main thread") : end.index("asyncio tasks not done")]
    assert "select" in main  # the event loop, idle: the hang is an await, not a blocked call
