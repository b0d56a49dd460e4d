"""The style the project holds itself to: ruff lint and format, mypy --strict (STYLE.md rule 11)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)


def test_ruff_finds_nothing() -> None:
    result = _run(str(BIN / "ruff"), "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_code_is_ruff_formatted() -> None:
    result = _run(str(BIN / "ruff"), "format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_passes_on_services_and_rollgate() -> None:
    result = _run(sys.executable, "-m", "mypy", "services", "rollgate")
    assert result.returncode == 0, result.stdout + result.stderr


def test_tests_wait_only_through_the_shared_poll_helper() -> None:
    """Deadline loops are written once (tests/harness/poll.py): `eventually` / `eventually_sync`."""
    pattern = re.compile(
        r"deadline = (time\.monotonic|asyncio\.get_running_loop\(\)\.time|loop\.time)\(\)"
    )
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("*.py")
        if path != ROOT / "tests" / "harness" / "poll.py" and pattern.search(path.read_text())
    ]
    assert offenders == [], f"hand-written deadline loops (use tests.harness.poll): {offenders}"
