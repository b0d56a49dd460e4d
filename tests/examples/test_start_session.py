"""examples/openclaw/start_session.py: flags and environment, the body, failure and success text."""

from __future__ import annotations

import socket
from collections.abc import Callable
from types import ModuleType

import pytest

KEY = "sk-sess-" + "a" * 43


@pytest.fixture
def ss(load_example: Callable[[str], ModuleType]) -> ModuleType:
    return load_example("start_session")


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_defaults_give_a_new_session_on_the_local_gateway(ss: ModuleType) -> None:
    options = ss.parse_options([], {})
    assert options.gateway_url == "http://127.0.0.1:8080"
    assert options.admin_key is None
    assert options.task_id == "demo-task"
    assert options.api_key is None
    assert options.is_refresh is False


def test_environment_fills_in_what_the_flags_leave_out(ss: ModuleType) -> None:
    env = {
        "ROLLGATE_GATEWAY_URL": "http://gw:9/v1",
        "ADMIN_KEY": "areal-admin",
        "TASK_ID": "math",
        "SESSION_API_KEY": KEY,
    }
    options = ss.parse_options([], env)
    assert options.gateway_url == "http://gw:9"
    assert options.admin_key == "areal-admin"
    assert options.task_id == "math"
    assert options.api_key == KEY
    assert options.is_refresh and options.api_key_from_env


def test_flags_win_over_the_environment(ss: ModuleType) -> None:
    env = {"ROLLGATE_ADMIN_KEY": "env-admin", "TASK_ID": "env-task", "SESSION_API_KEY": "env-key"}
    options = ss.parse_options(
        ["http://cli:1", "--admin-key", "cli-admin", "--task-id", "t2", "--api-key", KEY], env
    )
    assert (options.gateway_url, options.admin_key, options.task_id, options.api_key) == (
        "http://cli:1",
        "cli-admin",
        "t2",
        KEY,
    )
    assert options.api_key_from_env is False


def test_new_flag_ignores_an_exported_session_key(ss: ModuleType) -> None:
    options = ss.parse_options(["--new"], {"SESSION_API_KEY": KEY})
    assert options.api_key is None
    assert options.is_refresh is False


def test_body_carries_the_key_only_for_a_refresh(ss: ModuleType) -> None:
    assert ss.request_body("demo-task", None) == {"task_id": "demo-task"}
    assert ss.request_body("demo-task", KEY) == {"task_id": "demo-task", "api_key": KEY}


def test_the_wait_defaults_to_the_gateways_default_refresh_timeout_plus_ten(
    ss: ModuleType,
) -> None:
    assert ss.parse_options([], {}).timeout_s == 130.0


def test_the_wait_follows_the_refresh_timeout_from_the_environment(ss: ModuleType) -> None:
    options = ss.parse_options(["--api-key", KEY], {"ROLLGATE_REFRESH_TIMEOUT_S": "300"})
    assert options.timeout_s == 310.0


def test_timeout_flag_wins_over_the_environment(ss: ModuleType) -> None:
    options = ss.parse_options(["--timeout-s", "42.5"], {"ROLLGATE_REFRESH_TIMEOUT_S": "300"})
    assert options.timeout_s == 42.5


@pytest.mark.parametrize(
    ("argv", "env", "fragment"),
    [
        (["--timeout-s", "0"], {}, "positive"),
        (["--timeout-s", "soon"], {}, "not a number"),
        ([], {"ROLLGATE_REFRESH_TIMEOUT_S": "-5"}, "ROLLGATE_REFRESH_TIMEOUT_S"),
        ([], {"ROLLGATE_REFRESH_TIMEOUT_S": "two minutes"}, "ROLLGATE_REFRESH_TIMEOUT_S"),
    ],
)
def test_an_unusable_timeout_is_refused_with_its_name(
    ss: ModuleType,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    env: dict[str, str],
    fragment: str,
) -> None:
    with pytest.raises(SystemExit) as exited:
        ss.parse_options(argv, env)
    assert exited.value.code == 2
    assert fragment in capsys.readouterr().err


def test_refresh_timeout_says_the_key_stays_valid_and_when_to_retry(ss: ModuleType) -> None:
    body = {"error": {"message": "no capacity after 120 s", "type": "capacity", "code": "x"}}
    lines = ss.explain_failure((429, body, {"retry-after": "5"}), True)
    assert lines[0] == (
        "Refresh timed out — the training pipeline hasn't cycled yet. Retry in a few seconds "
        "with the same --api-key (the key stays valid)."
    )
    assert "Gateway says: no capacity after 120 s" in lines
    assert "Retry-After: 5 s" in lines


def test_no_capacity_for_a_new_session_is_explained(ss: ModuleType) -> None:
    lines = ss.explain_failure((429, {"detail": "no capacity"}, {}), False)
    assert lines[0].startswith("No capacity for a new session")
    assert not any(line.startswith("Retry-After") for line in lines)


def test_other_failures_print_the_gateways_message(ss: ModuleType) -> None:
    body = {"error": {"message": "invalid admin key", "type": "auth", "code": "bad_admin"}}
    lines = ss.explain_failure((401, body, {}), False)
    assert lines[0] == "start_session failed (HTTP 401): invalid admin key"
    assert any("rollgate up" in line for line in lines[1:])


def test_new_session_success_prints_ids_exports_and_the_refresh_command(
    ss: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    options = ss.parse_options(["http://gw:8080", "--admin-key", "a"], {})
    ss.print_success(options, ss.Session(session_id="demo-task-3", api_key=KEY))
    out = capsys.readouterr().out
    assert "  ✔  Session started!" in out
    assert "  → Session ID : demo-task-3" in out
    assert f"  → API Key    : {KEY}" in out
    assert f"export OPENAI_API_KEY={KEY}" in out
    assert "export OPENAI_BASE_URL=http://gw:8080/v1" in out
    assert f"examples/openclaw/start_session.py http://gw:8080 --api-key {KEY}" in out


def test_refresh_success_prints_no_exports_and_warns_when_the_key_changed(
    ss: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    options = ss.parse_options(["--admin-key", "a", "--api-key", KEY], {})
    ss.print_success(options, ss.Session(session_id="demo-task-4", api_key=KEY))
    same = capsys.readouterr().out
    assert "export OPENAI_API_KEY" not in same
    assert "NEW key" not in same
    other = "sk-sess-" + "b" * 43
    ss.print_success(options, ss.Session(session_id="demo-task-5", api_key=other))
    assert "NEW key" in capsys.readouterr().out


def test_without_an_admin_key_it_exits_1_before_calling_the_gateway(
    ss: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        ss.main([_closed_port_url()], {})
    assert exited.value.code == 1
    captured = capsys.readouterr()
    assert "no admin key given" in captured.out
    assert "`rollgate up`" in captured.out
    assert "cannot reach" not in captured.out
    assert captured.err == ""


def test_help_names_every_flag(ss: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        ss.main(["--help"], {})
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for flag in ("gateway_url", "--admin-key", "--task-id", "--api-key", "--new"):
        assert flag in out
