""".ci/run prepares what `make test` needs (Python >= 3.11, a working venv, a headless Chromium)
and then runs exactly the README's `make test` and `make test-engine`: run here with stand-ins
for python3, apt-get, make and chromium on PATH."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CI_RUN = REPO / ".ci" / "run"
RUN_TIMEOUT_S = 60.0

# python3: the version in FAKE_VERSION; `-m venv DIR` works once apt-get installed a venv package.
FAKE_PYTHON = """#!/bin/bash
if [ "$1" = "-c" ]; then
  case "$2" in
    *print*) echo "$FAKE_VERSION"; exit 0 ;;
    *exit*) minor="${FAKE_VERSION#3.}"; [ "$minor" -ge 11 ]; exit $? ;;
  esac
fi
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then [ -e "$FAKE_STATE/venv-ok" ]; exit $?; fi
exit 2
"""
FAKE_APT = """#!/bin/bash
echo "$*" >> "$FAKE_STATE/apt.log"
case "$*" in *install*-venv*) touch "$FAKE_STATE/venv-ok" ;; esac
case "$*" in *install*chromium*) touch "$FAKE_STATE/chromium-ok" ;; esac
"""
# chromium: works once apt-get installed it (or from the start).
FAKE_CHROMIUM = """#!/bin/bash
[ -e "$FAKE_STATE/chromium-ok" ]
"""
FAKE_MAKE = """#!/bin/bash
echo "$*" >> "$FAKE_STATE/make.log"
"""
FAKE_ID = """#!/bin/bash
echo 0
"""


def _run(
    tmp_path: Path, *, version: str, venv_ok: bool, chromium_ok: bool = True
) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    state = tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    for name, text in (
        ("python3", FAKE_PYTHON),
        ("apt-get", FAKE_APT),
        ("make", FAKE_MAKE),
        ("id", FAKE_ID),
        ("chromium", FAKE_CHROMIUM),
    ):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(0o755)
    if venv_ok:
        (state / "venv-ok").touch()
    if chromium_ok:
        (state / "chromium-ok").touch()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "CHROMIUM")}
    env.update(
        PATH=f"{bin_dir}:/usr/bin:/bin",
        FAKE_VERSION=version,
        FAKE_STATE=str(state),
        # The stand-in, even where a real chromium is installed in /usr/bin.
        CHROMIUM=str(bin_dir / "chromium"),
    )
    return subprocess.run(
        ["bash", str(CI_RUN)],
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )


def _log(tmp_path: Path, name: str) -> list[str]:
    path = tmp_path / "state" / name
    return path.read_text().splitlines() if path.exists() else []


def test_python_older_than_3_11_fails_with_a_clear_message_before_make(tmp_path: Path) -> None:
    done = _run(tmp_path, version="3.10", venv_ok=True)
    assert done.returncode != 0
    assert "needs Python >= 3.11" in done.stderr and "3.10" in done.stderr
    assert _log(tmp_path, "make.log") == []


@pytest.mark.parametrize("venv_ok", [True, False])
def test_a_broken_venv_is_fixed_with_apt_get_then_exactly_the_two_test_targets_run(
    tmp_path: Path, venv_ok: bool
) -> None:
    done = _run(tmp_path, version="3.12", venv_ok=venv_ok)
    assert done.returncode == 0, done.stderr
    assert _log(tmp_path, "make.log") == ["test", "test-engine"]
    installs = [line for line in _log(tmp_path, "apt.log") if "install" in line]
    if venv_ok:
        assert installs == []  # nothing to install
    else:
        assert installs == ["install -y -qq python3.12-venv"]


def test_a_missing_chromium_is_installed_with_apt_get_before_make_test(tmp_path: Path) -> None:
    done = _run(tmp_path, version="3.11", venv_ok=True, chromium_ok=False)
    assert done.returncode == 0, done.stderr
    installs = [line for line in _log(tmp_path, "apt.log") if "install" in line]
    assert installs == ["install -y -qq chromium"]
    assert _log(tmp_path, "make.log") == ["test", "test-engine"]


def _make_chromium(tmp_path: Path, *, installable: bool) -> subprocess.CompletedProcess[str]:
    """`make chromium` (what `make test` runs first) with stand-ins for apt-get and chromium."""
    bin_dir = tmp_path / "bin"
    state = tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    apt = FAKE_APT if installable else '#!/bin/bash\necho "$*" >> "$FAKE_STATE/apt.log"\n'
    for name, text in (("apt-get", apt), ("id", FAKE_ID), ("chromium", FAKE_CHROMIUM)):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "CHROMIUM"}
    env.update(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        FAKE_STATE=str(state),
        CHROMIUM=str(bin_dir / "chromium"),
    )
    return subprocess.run(
        ["make", "--no-print-directory", "-C", str(REPO), "chromium"],
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )


def test_make_test_installs_a_missing_chromium_with_apt_get_first(tmp_path: Path) -> None:
    # `make test` alone on a new machine: the console's browser tests need it too.
    done = _make_chromium(tmp_path, installable=True)
    assert done.returncode == 0, done.stderr
    installs = [line for line in _log(tmp_path, "apt.log") if "install" in line]
    assert installs == ["install -y -qq chromium"]


def test_make_test_stops_with_a_clear_message_when_chromium_cannot_be_installed(
    tmp_path: Path,
) -> None:
    done = _make_chromium(tmp_path, installable=False)
    assert done.returncode != 0
    assert "chromium is still missing" in done.stderr and "CHROMIUM" in done.stderr
