"""Every `ROLLGATE_*` variable the docs, the README, docker-compose.yml and the Kubernetes
manifests name is still read by something: a service's settings (seen by recording which
variables `load` looks up), the CLI and trainer adapters, the examples, or Compose itself."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import Any

import pytest

from services.dataproxy.settings import DataProxySettings
from services.gateway.settings import GatewaySettings
from services.router.settings import RouterSettings
from services.worker.settings import WorkerSettings
from stackconfig import Sources

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bROLLGATE_[A-Z0-9_]*[A-Z0-9]\b")
# Read by the `rollgate` CLI, the trainer adapters and the examples (not services).
USER_CODE = ("rollgate", "examples")


class RecordingEnviron(dict[str, str]):
    """An environment that remembers every variable looked up in it."""

    def __init__(self, values: dict[str, str]) -> None:
        super().__init__(values)
        self.looked_up: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.looked_up.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> str:
        self.looked_up.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.looked_up.add(key)
        return super().__contains__(key)


@functools.cache
def documented_names() -> dict[str, list[str]]:
    """Name → the files that mention it."""
    files = [
        ROOT / "README.md",
        ROOT / "docker-compose.yml",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "deploy" / "k8s").rglob("*.yaml")),
    ]
    found: dict[str, list[str]] = {}
    for path in files:
        for name in set(NAME.findall(path.read_text())):
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


@functools.cache
def names_read_by_service_settings() -> set[str]:
    """The variables the four services' settings look up (all of them, set or not)."""
    required = {
        "ROLLGATE_ADMIN_KEY": "admin",
        "ROLLGATE_UPSTREAM_BASE_URL": "http://127.0.0.1:9/v1",
    }
    read: set[str] = set()
    for settings in (GatewaySettings, RouterSettings, DataProxySettings, WorkerSettings):
        environ = RecordingEnviron(dict(required))
        settings.load(Sources(environ=environ))
        read |= environ.looked_up
    return read


@functools.cache
def string_literals(packages: tuple[str, ...]) -> set[str]:
    found: set[str] = set()
    for package in packages:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    found.update(NAME.findall(node.value))
    return found


@functools.cache
def compose_interpolations() -> set[str]:
    """`${ROLLGATE_…}` Compose substitutes from the shell when it reads the file."""
    text = (ROOT / "docker-compose.yml").read_text()
    return set(re.findall(r"\$\{(ROLLGATE_[A-Z0-9_]+)", text))


def test_the_documents_name_the_variables_this_test_looks_for() -> None:
    names = documented_names()
    # The test reads the documents it means to: a broken glob would make it pass vacuously.
    assert {"ROLLGATE_ADMIN_KEY", "ROLLGATE_SESSION_IDLE_TIMEOUT_S", "ROLLGATE_LOG_JSON"} <= set(
        names
    )
    assert len(names) > 50


def test_the_recorder_sees_what_a_service_reads() -> None:
    read = names_read_by_service_settings()
    assert {"ROLLGATE_PAUSE_WAIT_S", "ROLLGATE_WS_MODEL", "ROLLGATE_UPSTREAM_ALIASES"} <= read
    assert "ROLLGATE_NOT_A_SETTING" not in read


@pytest.mark.parametrize("name", sorted(documented_names()))
def test_every_documented_variable_is_still_read(name: str) -> None:
    readers = {
        "a service's settings": names_read_by_service_settings(),
        "the CLI, adapters or examples": string_literals(USER_CODE),
        "docker compose (interpolation)": compose_interpolations(),
    }
    assert any(name in names for names in readers.values()), (
        f"{name} (in {', '.join(documented_names()[name])}) is read by nothing: "
        "read it again, or take it out of the documents"
    )
