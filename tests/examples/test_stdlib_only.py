"""The example scripts run on a bare python3 (>= 3.9) with the standard library only."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.examples.conftest import EXAMPLES_DIR, SCRIPT_MODULES

SCRIPTS = ("start_session.py", "set_reward.py", "end_session.py", "demo_lifecycle.py")
SYSTEM_PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else "python3"


def _bare_run(python: str, *args: str) -> subprocess.CompletedProcess[str]:
    # -S: no site-packages; -s: no user site; -E: ignore PYTHON* variables. The venv is not used.
    return subprocess.run(
        [python, "-S", "-s", "-E", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=EXAMPLES_DIR.parent,
        env={"PATH": "/usr/bin:/bin", "NO_COLOR": "1"},
        check=False,
    )


def _python39() -> str | None:
    candidates = [shutil.which("python3.9")]
    candidates += [str(p) for p in sorted(Path.home().glob(".pyenv/versions/3.9*/bin/python3"))]
    for candidate in candidates:
        if candidate and _bare_run(candidate, "-c", "import sys").returncode == 0:
            return candidate
    return None


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", sorted(EXAMPLES_DIR.glob("*.py")), ids=lambda p: p.name)
def test_every_import_is_standard_library_or_a_sibling_script(path: Path) -> None:
    allowed = set(sys.stdlib_module_names) | set(SCRIPT_MODULES) | {"__future__"}
    foreign = _imported_modules(path) - allowed
    assert not foreign, f"{path.name} imports {sorted(foreign)}"
    assert "rollgate" not in _imported_modules(path)


@pytest.mark.parametrize("path", sorted(EXAMPLES_DIR.glob("*.py")), ids=lambda p: p.name)
def test_scripts_parse_as_python_3_9(path: Path) -> None:
    ast.parse(path.read_text(encoding="utf-8"), feature_version=(3, 9))


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_runs_on_the_system_python_without_site_packages(script: str) -> None:
    proc = _bare_run(SYSTEM_PYTHON, f"openclaw/{script}", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: {script}")
    assert proc.stderr == ""


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_runs_on_python_3_9(script: str) -> None:
    python = _python39()
    if python is None:
        pytest.skip("no working python3.9 on this machine")
    proc = _bare_run(python, f"openclaw/{script}", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: {script}")


def test_scripts_are_executable_with_a_python3_shebang() -> None:
    for script in SCRIPTS:
        path = EXAMPLES_DIR / script
        assert path.read_text(encoding="utf-8").startswith("#!/usr/bin/env python3\n"), script
        assert os.access(path, os.X_OK), f"chmod +x {script}"


def test_a_missing_admin_key_exits_1_on_the_system_python() -> None:
    proc = _bare_run(SYSTEM_PYTHON, "openclaw/start_session.py", "http://127.0.0.1:9")
    assert proc.returncode == 1
    assert "no admin key given" in proc.stdout
    assert "\033[" not in proc.stdout, "no colour when stdout is not a terminal"
    assert proc.stderr == "", "stderr carries only KEY=VALUE lines, and only on success"
