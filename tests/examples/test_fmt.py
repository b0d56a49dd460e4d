"""examples/openclaw/_fmt.py: AReaL-style output, colour rules, resolution, the HTTP helper."""

from __future__ import annotations

import io
import json
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import ModuleType
from typing import Any

import pytest

ANSI_ESC = "\033["


class _TtyBuffer(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def fmt(load_example: Callable[[str], ModuleType]) -> ModuleType:
    return load_example("_fmt")


def test_lines_have_arealstyle_prefixes_and_no_colour_when_not_a_tty(
    fmt: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    fmt.info("hello")
    fmt.success("done")
    fmt.error("broke")
    fmt.arrow("Session ID : s-1")
    out = capsys.readouterr().out.splitlines()
    assert out == ["  \u2139  hello", "  ✔  done", "  ✘  broke", "  → Session ID : s-1"]


def test_colour_is_used_on_a_terminal(fmt: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    tty = _TtyBuffer()
    monkeypatch.setattr("sys.stdout", tty)
    fmt.success("done")
    assert ANSI_ESC in tty.getvalue()
    assert "done" in tty.getvalue()


def test_no_color_turns_colour_off_even_on_a_terminal(
    fmt: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    tty = _TtyBuffer()
    monkeypatch.setattr("sys.stdout", tty)
    monkeypatch.setenv("NO_COLOR", "1")
    fmt.success("done")
    assert tty.getvalue() == "  ✔  done\n"


def test_use_color_follows_the_stream_and_the_environment(fmt: ModuleType) -> None:
    assert fmt.use_color(_TtyBuffer(), {}) is True
    assert fmt.use_color(_TtyBuffer(), {"NO_COLOR": "yes"}) is False
    assert fmt.use_color(io.StringIO(), {}) is False
    # NO_COLOR set to the empty string does not count (no-color.org).
    assert fmt.use_color(_TtyBuffer(), {"NO_COLOR": ""}) is True


def test_header_is_a_box_as_wide_as_its_title(
    fmt: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    fmt.header("Start Session")
    lines = [line for line in capsys.readouterr().out.splitlines() if line]
    assert lines[1] == "║  Start Session  ║"
    assert lines[0].startswith("╔═") and lines[2].startswith("╚═")
    assert len(lines[0]) == len(lines[1]) == len(lines[2])


def test_show_request_masks_the_bearer_token(
    fmt: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    fmt.show_request("POST", "http://gw/rl/start_session", "super-secret-admin")
    out = capsys.readouterr().out
    assert out.splitlines() == ["  POST http://gw/rl/start_session", "  Auth: Bearer ***"]
    assert "super-secret" not in out


def test_show_response_prints_the_status_and_pretty_json(
    fmt: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    fmt.show_response(200, {"session_id": "demo-task-1", "api_key": "sk-sess-x"})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "  HTTP 200"
    assert json.loads("\n".join(lines[1:])) == {"session_id": "demo-task-1", "api_key": "sk-sess-x"}
    assert '      "session_id": "demo-task-1",' in lines


def test_die_prints_the_error_and_hints_then_exits_1(
    fmt: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        fmt.die("no admin key given.", "run `rollgate up`")
    assert exited.value.code == 1
    assert capsys.readouterr().out.splitlines() == [
        "  ✘  no admin key given.",
        "  \u2139  run `rollgate up`",
    ]


def test_emit_vars_writes_key_value_lines_to_stderr_only(
    fmt: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    fmt.emit_vars(SESSION_API_KEY="sk-sess-abc", SESSION_ID="t-1")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == ["SESSION_API_KEY=sk-sess-abc", "SESSION_ID=t-1"]


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("http://127.0.0.1:8080", "http://127.0.0.1:8080"),
        ("http://127.0.0.1:8080/", "http://127.0.0.1:8080"),
        ("http://127.0.0.1:8080/v1", "http://127.0.0.1:8080"),
        ("http://127.0.0.1:8080/v1/", "http://127.0.0.1:8080"),
        ("localhost:9000", "http://localhost:9000"),
        ("https://gw.example/prefix", "https://gw.example/prefix"),
    ],
)
def test_gateway_url_is_normalized_to_the_root(fmt: ModuleType, given: str, expected: str) -> None:
    assert fmt.normalize_gateway_url(given) == expected


def test_gateway_url_comes_from_the_argument_then_the_environment_then_the_default(
    fmt: ModuleType,
) -> None:
    env = {"ROLLGATE_GATEWAY_URL": "http://env:1/"}
    assert fmt.resolve_gateway_url("http://cli:2", env) == "http://cli:2"
    assert fmt.resolve_gateway_url(None, env) == "http://env:1"
    assert fmt.resolve_gateway_url(None, {}) == "http://127.0.0.1:8080"


def test_admin_key_prefers_the_flag_then_rollgate_admin_key_then_arealstyle_admin_key(
    fmt: ModuleType,
) -> None:
    both = {"ROLLGATE_ADMIN_KEY": "rg", "ADMIN_KEY": "areal"}
    assert fmt.resolve_admin_key("cli", both) == "cli"
    assert fmt.resolve_admin_key(None, both) == "rg"
    assert fmt.resolve_admin_key(None, {"ADMIN_KEY": "areal"}) == "areal"
    assert fmt.resolve_admin_key(None, {}) is None
    assert fmt.resolve_admin_key("", {"ROLLGATE_ADMIN_KEY": ""}) is None


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            {"error": {"message": "use a session key", "type": "auth", "code": "x"}},
            "use a session key",
        ),
        (
            {"detail": "Session demo-1 already ended or expired"},
            "Session demo-1 already ended or expired",
        ),
        ({"error": "plain"}, "plain"),
        ("Invalid session key", "Invalid session key"),
        ("", "(empty response body)"),
        ({"other": 1}, '{"other": 1}'),
    ],
)
def test_error_message_reads_rollgate_areal_and_text_errors(
    fmt: ModuleType, body: Any, expected: str
) -> None:
    assert fmt.error_message(body) == expected


def test_retry_after_is_read_in_seconds(fmt: ModuleType) -> None:
    assert fmt.retry_after_s({"retry-after": "3"}) == 3.0
    assert fmt.retry_after_s({"retry-after": "0.5"}) == 0.5
    assert fmt.retry_after_s({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) is None
    assert fmt.retry_after_s({}) is None


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_an_unreachable_gateway_ends_the_script_with_a_hint_to_start_it(
    fmt: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    port = _closed_port()
    with pytest.raises(SystemExit) as exited:
        fmt.post_json(f"http://127.0.0.1:{port}/rl/start_session", {}, "k", 2.0)
    assert exited.value.code == 1
    out = capsys.readouterr().out
    assert f"cannot reach the gateway at http://127.0.0.1:{port}: is `make run` running?" in out


class _EchoHandler(BaseHTTPRequestHandler):
    """Answers with the status the path names and echoes what it received."""

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length).decode() if length else ""
        status = int(self.path.rsplit("/", 1)[-1])
        if self.path.startswith("/text/"):
            payload = b"plain failure"
            ctype = "text/plain"
        else:
            payload = json.dumps(
                {
                    "method": self.command,
                    "authorization": self.headers.get("Authorization"),
                    "content_type": self.headers.get("Content-Type"),
                    "body": raw,
                }
            ).encode()
            ctype = "application/json"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        if status == 429:
            self.send_header("Retry-After", "7")
        self.end_headers()
        self.wfile.write(payload)

    do_GET = _answer
    do_POST = _answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def echo_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _EchoHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_post_json_sends_a_json_body_with_the_bearer_token(fmt: ModuleType, echo_url: str) -> None:
    status, body, headers = fmt.post_json(
        f"{echo_url}/json/200", {"task_id": "t", "reward": 1.0}, "sk-sess-abc", 5.0
    )
    assert status == 200
    assert body["method"] == "POST"
    assert body["authorization"] == "Bearer sk-sess-abc"
    assert body["content_type"] == "application/json"
    assert json.loads(body["body"]) == {"task_id": "t", "reward": 1.0}
    assert headers["content-type"] == "application/json"


def test_http_errors_come_back_as_replies_with_their_headers(
    fmt: ModuleType, echo_url: str
) -> None:
    status, body, headers = fmt.post_json(f"{echo_url}/json/429", {}, "k", 5.0)
    assert status == 429
    assert body["authorization"] == "Bearer k"
    assert fmt.retry_after_s(headers) == 7.0


def test_a_text_error_body_is_returned_as_text(fmt: ModuleType, echo_url: str) -> None:
    status, body, _ = fmt.get_json(f"{echo_url}/text/401")
    assert (status, body) == (401, "plain failure")


def test_get_json_sends_no_body_and_no_auth_when_none_is_given(
    fmt: ModuleType, echo_url: str
) -> None:
    status, body, _ = fmt.get_json(f"{echo_url}/json/200")
    assert status == 200
    assert body == {"method": "GET", "authorization": None, "content_type": None, "body": ""}


def test_the_admin_key_is_the_first_of_a_listed_variable(fmt: ModuleType) -> None:
    # During a rotation ROLLGATE_ADMIN_KEY lists the new key first, then the old one.
    assert fmt.resolve_admin_key(None, {"ROLLGATE_ADMIN_KEY": "new-key, old-key"}) == "new-key"
    assert fmt.resolve_admin_key("given", {"ROLLGATE_ADMIN_KEY": "a,b"}) == "given"
    assert fmt.resolve_admin_key(None, {"ADMIN_KEY": "k"}) == "k"
    assert fmt.resolve_admin_key(None, {}) is None
