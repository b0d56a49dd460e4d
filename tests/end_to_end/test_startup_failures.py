"""Every service that cannot start says so in one line that names the fix, never a traceback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

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


@pytest.mark.parametrize("service", ["gateway", "router", "dataproxy", "worker"])
def test_a_log_level_that_does_not_exist_is_one_line_naming_the_setting(service: str) -> None:
    env = {
        "ROLLGATE_LOG_LEVEL": "verbose",
        "ROLLGATE_UPSTREAM_BASE_URL": "http://127.0.0.1:1/v1",
        "ROLLGATE_UPSTREAM_MODELS": "m",
    }
    done = _run(service, env, "--port", "0")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.strip().count("\n") == 0, done.stderr
    assert "ROLLGATE_LOG_LEVEL='verbose'" in done.stderr and "debug, info" in done.stderr


def test_a_configuration_file_that_is_not_yaml_is_one_line_naming_where(tmp_path: Path) -> None:
    config = tmp_path / "rollgate.yaml"
    config.write_text("gateway:\n  port: 8080\n extra: [1\n")
    done = _run("gateway", {}, "--port", "0", "--config", str(config))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.strip().count("\n") == 0, done.stderr
    assert f"{config} is not valid YAML" in done.stderr and "line 3" in done.stderr


# `rollgate up` starts the four services and the embedded Redis: whatever stops it is one line
# naming the process and the fix, never a traceback or a dump of a log.
ROLLGATE = str(Path(sys.executable).parent / "rollgate")


def _up(tmp_path: Path, *args: str, redis_url: str | None = None) -> tuple[int, list[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLGATE_", "REDIS_URL"))}
    if redis_url is not None:
        env["REDIS_URL"] = redis_url
        env["ROLLGATE_REDIS_PREFIX"] = f"rgupfail:{os.getpid()}:"
    done = subprocess.run(
        [ROLLGATE, "up", "--state-dir", str(tmp_path / "state"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    output = done.stdout + done.stderr
    assert "Traceback" not in output and '"event"' not in output, output
    said = [line for line in done.stderr.splitlines() if line.strip()]
    return done.returncode, said


def test_up_on_a_busy_port_says_in_one_line_which_service_and_what_to_change(
    busy_port: int, redis_url: str, tmp_path: Path
) -> None:
    code, said = _up(tmp_path, "--port", str(busy_port), "--workers", "1", redis_url=redis_url)
    assert code == 1 and len(said) == 1, said
    assert said[0].startswith("rollgate: failed to start: gateway could not start: "), said
    assert "choose another --port" in said[0]
    assert str(tmp_path / "state" / "logs" / "gateway.log") in said[0]
    # A second failure names only its own run's reason (logs are appended run after run).
    code, again = _up(tmp_path, "--port", str(busy_port), "--workers", "1", redis_url=redis_url)
    assert code == 1 and again == said


def test_up_without_a_usable_state_directory_says_which_option_to_change(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    done = subprocess.run(
        [ROLLGATE, "up", "--state-dir", str(blocker / "state")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    said = done.stderr.strip().splitlines()
    assert len(said) == 1 and "choose a writable directory (--state-dir DIR" in said[0], said


def test_up_whose_embedded_redis_cannot_read_its_data_says_what_redis_said(
    tmp_path: Path,
) -> None:
    (tmp_path / "state" / "redis").mkdir(parents=True)
    (tmp_path / "state" / "redis" / "appendonly.aof").write_text("*3\r\n$3\r\nSET\r\ntruncated")
    code, said = _up(tmp_path, "--port", "0")
    assert code == 1 and len(said) == 1, said
    assert said[0].startswith("rollgate: failed to start: the embedded Redis could not start"), said
    assert "redis-check-aof" in said[0] and "redis.log" in said[0]


def test_up_with_no_worker_is_refused_before_anything_starts(tmp_path: Path) -> None:
    code, said = _up(tmp_path, "--workers", "0")
    assert code == 2 and said[-1].endswith("argument --workers: '0': expected an integer >= 1")
    assert not (tmp_path / "state").exists(), "nothing was started"


@pytest.mark.parametrize("service", ["gateway", "router", "dataproxy", "worker"])
def test_a_port_out_of_range_is_refused_in_one_line(service: str) -> None:
    env = {"ROLLGATE_UPSTREAM_BASE_URL": "http://127.0.0.1:1/v1", "ROLLGATE_UPSTREAM_MODELS": "m"}
    # 99999 used to be bound silently as 99999 % 65536 (34463).
    done = _run(service, env, "--port", "99999")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == (
        f"python -m services.{service}: --port 99999 is not a port: use 1-65535, or 0 for any "
        "free one"
    )


@pytest.mark.parametrize("service", ["dataproxy", "router"])
def test_a_redis_url_that_does_not_parse_names_the_setting_and_not_the_url(service: str) -> None:
    done = _run(service, {"ROLLGATE_REDIS_URL": "redis://:pw-0123456789@127.0.0.1:six/0"})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and done.stderr.strip().count("\n") == 0, done.stderr
    assert "ROLLGATE_REDIS_URL" in done.stderr and "is not a Redis URL" in done.stderr
    assert "pw-0123456789" not in done.stderr
