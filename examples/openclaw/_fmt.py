"""Terminal output and tiny HTTP helpers shared by the OpenClaw example scripts (stdlib only)."""

from __future__ import annotations

import json
import os
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any, NoReturn, TextIO

DEFAULT_GATEWAY_URL = "http://127.0.0.1:8080"

# The whole reply of one HTTP call: (status, parsed JSON body or raw text, lower-cased headers).
Reply = tuple[int, Any, dict[str, str]]

_RESET = "\033[0m"
_BOLD = "\033[1m"
_DIM = "\033[2m"
_RED = "\033[31m"
_GREEN = "\033[32m"
_YELLOW = "\033[33m"
_BLUE = "\033[34m"
_CYAN = "\033[36m"
INFO_MARK = "\u2139"


def use_color(stream: TextIO | None = None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether to colour output: only on a terminal, and never when NO_COLOR is set."""
    env = os.environ if environ is None else environ
    if env.get("NO_COLOR", "") != "":
        return False
    out = sys.stdout if stream is None else stream
    isatty = getattr(out, "isatty", None)
    return bool(isatty and isatty())


def paint(text: str, *codes: str) -> str:
    """Wrap text in ANSI codes when stdout takes colour, else return it unchanged."""
    if not codes or not use_color():
        return text
    return "".join(codes) + text + _RESET


def info(msg: str) -> None:
    """An informational line: '  \u2139  msg' (INFORMATION SOURCE)."""
    print(f"  {paint(INFO_MARK, _BLUE)}  {msg}", flush=True)


def success(msg: str) -> None:
    """A success line: '  ✔  msg'."""
    print(f"  {paint('✔', _GREEN, _BOLD)}  {msg}", flush=True)


def warn(msg: str) -> None:
    """A warning line: '  !  msg'."""
    print(f"  {paint('!', _YELLOW, _BOLD)}  {msg}", flush=True)


def error(msg: str) -> None:
    """An error line: '  ✘  msg'."""
    print(f"  {paint('✘', _RED, _BOLD)}  {paint(msg, _RED)}", flush=True)


def arrow(msg: str) -> None:
    """A result line: '  → msg'."""
    print(f"  {paint('→', _CYAN)} {msg}", flush=True)


def die(msg: str, *hints: str) -> NoReturn:
    """Print an error (and optional hint lines), then exit with status 1."""
    error(msg)
    for hint in hints:
        info(hint)
    sys.exit(1)


def header(title: str) -> None:
    """A boxed section title framed by '══…'."""
    bar = "═" * (len(title) + 4)
    print(flush=True)
    print(paint(f"╔{bar}╗", _BOLD), flush=True)
    print(paint(f"║  {title}  ║", _BOLD), flush=True)
    print(paint(f"╚{bar}╝", _BOLD), flush=True)


def show_request(method: str, url: str, bearer: str | None = None) -> None:
    """Print the request line and, masked, the Authorization header."""
    print(f"  {paint(method, _BOLD)} {url}", flush=True)
    if bearer is not None:
        print(f"  {paint('Auth: Bearer ***', _DIM)}", flush=True)


def show_response(status: int, body: Any) -> None:
    """Print '  HTTP <code>' and the body, pretty-printed when it is JSON."""
    colour = _GREEN if 200 <= status < 300 else _RED
    print(f"  {paint(f'HTTP {status}', colour, _BOLD)}", flush=True)
    text = body if isinstance(body, str) else json.dumps(body, indent=2, ensure_ascii=False)
    for line in text.splitlines() or [""]:
        print(f"    {line}", flush=True)


def emit_vars(**values: object) -> None:
    """Write KEY=VALUE lines to stderr, for scripts and `eval`-style capture."""
    for key, value in values.items():
        print(f"{key}={value}", file=sys.stderr, flush=True)


def normalize_gateway_url(url: str) -> str:
    """The gateway root: no trailing slash and no trailing /v1 (the /rl/* paths live at the root)."""
    root = url.strip().rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    if "://" not in root:
        root = "http://" + root
    return root


def resolve_gateway_url(cli_value: str | None, environ: Mapping[str, str]) -> str:
    """The gateway URL: the argument, else $ROLLGATE_GATEWAY_URL, else http://127.0.0.1:8080."""
    chosen = cli_value or environ.get("ROLLGATE_GATEWAY_URL") or DEFAULT_GATEWAY_URL
    return normalize_gateway_url(chosen)


def resolve_admin_key(cli_value: str | None, environ: Mapping[str, str]) -> str | None:
    """The admin key: --admin-key, else $ROLLGATE_ADMIN_KEY, else $ADMIN_KEY (AReaL's name)."""
    value = cli_value or environ.get("ROLLGATE_ADMIN_KEY") or environ.get("ADMIN_KEY")
    # A variable listing several keys (a rotation under way): the first is the current one.
    return (value.split(",", 1)[0].strip() or None) if value else None


ADMIN_KEY_HINTS = (
    "Pass --admin-key, or export ROLLGATE_ADMIN_KEY (ADMIN_KEY also works).",
    "`rollgate up` (and `make run`) prints the admin key it generated when it starts.",
)


def error_message(body: Any) -> str:
    """The human message in an error body: rollgate's {"error": {...}}, AReaL's {"detail"}, text."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str) and err:
            return err
        for field in ("detail", "message"):
            if body.get(field):
                return str(body[field])
        return json.dumps(body, ensure_ascii=False)
    text = str(body).strip()
    return text or "(empty response body)"


def retry_after_s(headers: Mapping[str, str]) -> float | None:
    """The Retry-After header in seconds, when present and numeric."""
    raw = headers.get("retry-after")
    if raw is None:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        return None


def _decode(raw: bytes) -> Any:
    text = raw.decode("utf-8", errors="replace")
    if not text.strip():
        return {}
    try:
        return json.loads(text)
    except ValueError:
        return text


def request_json(
    method: str,
    url: str,
    *,
    body: Mapping[str, Any] | None = None,
    bearer: str | None = None,
    timeout_s: float = 10.0,
) -> Reply:
    """One HTTP call; HTTP errors are returned as replies, an unreachable gateway ends the script."""
    headers = {"Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode("utf-8")
        headers["Content-Type"] = "application/json"
    if bearer is not None:
        headers["Authorization"] = f"Bearer {bearer}"
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, _decode(resp.read()), _lower_headers(resp.headers.items())
    except urllib.error.HTTPError as err:
        try:
            raw = err.read() if err.fp is not None else b""
        finally:
            err.close()
        return err.code, _decode(raw), _lower_headers((err.headers or {}).items())
    except (TimeoutError, socket.timeout):
        die(f"no answer from {url} within {timeout_s:g} s", "Is the gateway overloaded or stuck?")
    except (urllib.error.URLError, ConnectionError) as err:
        reason = getattr(err, "reason", err)
        if isinstance(reason, (TimeoutError, socket.timeout)):
            die(f"no answer from {url} within {timeout_s:g} s")
        root = _root_of(url)
        die(
            f"cannot reach the gateway at {root}: is `make run` running?",
            f"({reason})",
            "Start the stack with `make run` (or `rollgate up`), or pass the right gateway URL.",
        )


def post_json(url: str, body: Mapping[str, Any], bearer: str | None, timeout_s: float) -> Reply:
    """POST a JSON body; see request_json."""
    return request_json("POST", url, body=body, bearer=bearer, timeout_s=timeout_s)


def get_json(url: str, bearer: str | None = None, timeout_s: float = 10.0) -> Reply:
    """GET a JSON resource; see request_json."""
    return request_json("GET", url, bearer=bearer, timeout_s=timeout_s)


def _lower_headers(items: Any) -> dict[str, str]:
    return {str(k).lower(): str(v) for k, v in items}


def _root_of(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    return f"{scheme}://{rest.split('/', 1)[0]}"
