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


def test_a_hang_is_named_and_ends_the_run(tmp_path: Path) -> None:
    (tmp_path / "test_hangs.py").write_text(HANGS)
    plugins = ["-p", "no:timeout", "-p", "no:cacheprovider", "-p", "tests.conftest"]
    alone = ["--rootdir", str(tmp_path), "-c", os.devnull]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *plugins, *alone, str(tmp_path / "test_hangs.py")],
        cwd=REPO,
        env={**os.environ, "ROLLGATE_TEST_HARD_DEADLINE_S": "2"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    named = "test_hangs.py::test_hangs_in_teardown hung in teardown for 2.0 s"
    assert named in done.stderr
    # the last line says it again, below the stacks, which name the hanging frame
    assert done.stderr.rstrip().splitlines()[-1].endswith(f"{named}: run ended +++")
    assert "stuck_on_the_way_out" in done.stderr
    assert "test_fine" not in done.stderr
