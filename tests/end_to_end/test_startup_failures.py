"""Every service that cannot start says so in one line that names the fix, never a traceback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

pytestmark = pytest.mark.e2e

DEAD_REDIS = "redis://127.0.0.1:1/0"


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something else is listening on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _run(service: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    base = {
        "PATH": os.environ.get("PATH", ""),
        "ROLLGATE_ADMIN_KEY": "rg-admin-startup-test-0123456789",
        "ROLLGATE_LOG_JSON": "1",
        "ROLLGATE_METRICS_PORT": "0",
    }
    return subprocess.run(
        [sys.executable, "-m", f"services.{service}", *args],
        env=base | env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def _assert_one_line(done: subprocess.CompletedProcess[str], *, says: str) -> None:
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "Traceback" not in output, output
    # Our lines are JSON; grpc's C core may add its own (not JSON) about the failed bind.
    lines = [json.loads(raw) for raw in done.stderr.splitlines() if raw.startswith("{")]
    errors = [line for line in lines if line.get("level") == "error"]
    assert len(errors) == 1, output
    assert errors[0]["event"] == "startup_failed"
    message = errors[0]["error"]
    assert says in message and "\n" not in message, message
    assert "rg-admin-startup-test" not in output


@pytest.mark.parametrize("service", ["dataproxy", "router"])
def test_a_service_that_cannot_reach_redis_says_which_setting_to_check(service: str) -> None:
    done = _run(service, {"ROLLGATE_REDIS_URL": DEAD_REDIS}, "--port", "0")
    _assert_one_line(done, says="check ROLLGATE_REDIS_URL")


def test_a_gateway_on_a_busy_port_says_to_choose_another(busy_port: int) -> None:
    done = _run("gateway", {}, "--port", str(busy_port))
    _assert_one_line(done, says="choose another --port")


def test_a_worker_on_a_busy_port_says_to_choose_another(busy_port: int) -> None:
    env = {
        "ROLLGATE_UPSTREAM_BASE_URL": "http://127.0.0.1:1/v1",
        "ROLLGATE_UPSTREAM_MODELS": "m",
        "ROLLGATE_ROUTER_ADDR": "127.0.0.1:1",
    }
    done = _run("worker", env, "--port", str(busy_port))
    _assert_one_line(done, says="choose another --port")


def test_a_configuration_mistake_is_one_line_naming_the_setting() -> None:
    done = _run("gateway", {"ROLLGATE_HEADER_TIMEOUT_S": "-1"}, "--port", "0")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().count("\n") == 0
    assert "ROLLGATE_HEADER_TIMEOUT_S" in done.stderr
