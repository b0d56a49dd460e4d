"""OpenClaw gateway protocol: frames, the handshake answers, and the static method answers."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from services.gateway.json_body import load_json
from services.runtime.errors import (
    MAX_IDENTIFIER_CHARS,
    InvalidRequest,
    RollgateError,
    bounded,
    check_identifier,
)

PROTOCOL_VERSIONS = (3, 4)
SERVER_VERSION = "rollgate"
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

METHODS = (
    "connect",
    "health",
    "status",
    "chat.send",
    "chat.history",
    "chat.abort",
    "agent",
    "agent.wait",
    "agents.list",
    "sessions.list",
    "sessions.describe",
    "sessions.reset",
    "sessions.subscribe",
    "sessions.unsubscribe",
    "commands.list",
    "question.list",
    "plugin.approval.list",
    "taskSuggestions.list",
    "models.list",
)
EVENTS = ("connect.challenge", "tick", "agent", "chat", "health", "shutdown")

# Error codes of the protocol (v3 set + v4 FORBIDDEN).
INVALID_REQUEST = "INVALID_REQUEST"
UNAVAILABLE = "UNAVAILABLE"
AGENT_TIMEOUT = "AGENT_TIMEOUT"

# Close codes.
CLOSE_POLICY = 1008
CLOSE_PROTOCOL = 1002

TOKEN_MISMATCH_MESSAGE = (
    "unauthorized: gateway token mismatch (use the sk-sess-… session key returned by "
    "rollgate's /rl/start_session as the gateway token)"
)
TOKEN_MISMATCH_DETAILS = {
    "code": "AUTH_TOKEN_MISMATCH",
    "authReason": "token_mismatch",
    "canRetryWithDeviceToken": False,
    "recommendedNextStep": "update_auth_credentials",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class WsConfig:
    """How the WebSocket bridge runs conversations."""

    # The model runs use ("" : the first model the live workers serve).
    model: str = ""
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    tick_interval_ms: int = 15_000
    max_payload_bytes: int = 25 * 1024 * 1024
    max_buffered_bytes: int = 50 * 1024 * 1024
    # Frames before `connect` are capped lower, as OpenClaw's gateway does.
    preconnect_max_bytes: int = 64 * 1024
    handshake_timeout_s: float = 15.0
    # After close 1009, how long the rest of the oversized frame is drained before hanging up.
    oversize_linger_s: float = 5.0
    # The conversation's turn lease, renewed while a run lasts.
    lease_ms: int = 30_000
    # At most one cumulative `chat` delta per run in this interval.
    chat_delta_interval_s: float = 0.15
    run_timeout_s: float = 600.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """A `req` frame."""

    id: str
    method: str
    params: dict[str, Any]


class FrameError(Exception):
    """A frame that is not a valid request; `frame_id` when it had one."""

    def __init__(self, message: str, *, frame_id: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.frame_id = frame_id


def now_ms() -> int:
    """Unix time in milliseconds."""
    return int(time.time() * 1000)


def parse_request(text: str) -> Request:
    """A request frame, or FrameError saying what is wrong."""
    try:
        frame: Any = load_json(text, what="the frame")
    except InvalidRequest as err:
        raise FrameError(f"malformed frame: {err.message}") from None
    if not isinstance(frame, dict):
        raise FrameError("malformed frame: not a JSON object")
    raw_id = frame.get("id")
    frame_id = raw_id if isinstance(raw_id, str) else ""
    if frame.get("type") != "req":
        raise FrameError("only `req` frames are accepted from clients", frame_id=frame_id)
    if not frame_id:
        raise FrameError("a request needs a string `id`")
    if len(frame_id) > MAX_IDENTIFIER_CHARS:
        # Not echoed: every answer to it would carry it again.
        raise FrameError(
            f"`id` is {len(frame_id)} characters long; the limit is {MAX_IDENTIFIER_CHARS}"
        )
    method = frame.get("method")
    if not isinstance(method, str) or not method:
        raise FrameError("a request needs a string `method`", frame_id=frame_id)
    if len(method) > MAX_IDENTIFIER_CHARS:
        raise FrameError(
            f"`method` is {len(method)} characters long; the limit is {MAX_IDENTIFIER_CHARS}",
            frame_id=frame_id,
        )
    params = frame.get("params")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise FrameError("`params` must be an object", frame_id=frame_id)
    return Request(id=frame_id, method=method, params=params)


def event(name: str, payload: Any, *, seq: int | None = None) -> str:
    """An `event` frame."""
    frame: dict[str, Any] = {"type": "event", "event": name, "payload": payload}
    if seq is not None:
        frame["seq"] = seq
    return orjson.dumps(frame).decode()


def ok(frame_id: str, payload: Any) -> str:
    """A successful `res` frame."""
    return orjson.dumps({"type": "res", "id": frame_id, "ok": True, "payload": payload}).decode()


def error(
    frame_id: str,
    code: str,
    message: str,
    *,
    details: dict[str, Any] | None = None,
    retry_after_ms: int | None = None,
) -> str:
    """A failed `res` frame; its message bounded as every error message is."""
    body: dict[str, Any] = {"code": code, "message": bounded(message)}
    if details:
        body["details"] = details
    if retry_after_ms is not None:
        body["retryable"] = True
        body["retryAfterMs"] = retry_after_ms
    return orjson.dumps({"type": "res", "id": frame_id, "ok": False, "error": body}).decode()


def error_for(frame_id: str, err: RollgateError) -> str:
    """A failed `res` frame for a rollgate error (503 → UNAVAILABLE with the retry hint)."""
    retry_ms = None if err.retry_after_s is None else max(1, int(err.retry_after_s * 1000))
    code = UNAVAILABLE if err.http_status in (429, 502, 503, 504) else INVALID_REQUEST
    details = {"code": err.code, "type": err.error_type, "httpStatus": err.http_status}
    return error(frame_id, code, err.message, details=details, retry_after_ms=retry_ms)


def negotiate(params: dict[str, Any]) -> int | None:
    """The protocol both sides speak (the highest in range), or None."""
    low, high = params.get("minProtocol"), params.get("maxProtocol")
    if not isinstance(low, int) or not isinstance(high, int):
        return None
    usable = [v for v in PROTOCOL_VERSIONS if low <= v <= high]
    return max(usable) if usable else None


def hello_ok(
    *, protocol: int, conn_id: str, params: dict[str, Any], config: WsConfig, started_ms: int
) -> dict[str, Any]:
    """The `hello-ok` payload."""
    scopes = params.get("scopes") if isinstance(params.get("scopes"), list) else []
    return {
        "type": "hello-ok",
        "protocol": protocol,
        "server": {"version": SERVER_VERSION, "connId": conn_id},
        "features": {"methods": list(METHODS), "events": list(EVENTS)},
        "snapshot": {
            "presence": [],
            "health": {"ok": True},
            "stateVersion": {"presence": 0, "health": 0},
            "uptimeMs": now_ms() - started_ms,
            "sessionDefaults": {
                "defaultAgentId": "main",
                "mainKey": "main",
                "mainSessionKey": "agent:main:main",
            },
        },
        "auth": {"role": params.get("role") or "operator", "scopes": scopes},
        "policy": {
            "maxPayload": config.max_payload_bytes,
            "maxBufferedBytes": config.max_buffered_bytes,
            "tickIntervalMs": config.tick_interval_ms,
        },
    }


def session_key(raw: Any, *, agent_id: str = "main") -> str:
    """The canonical OpenClaw session key: `main` → `agent:main:main`, `x` → `agent:main:x`."""
    if not isinstance(raw, str) or not raw.strip():
        return f"agent:{agent_id[:MAX_IDENTIFIER_CHARS]}:main"
    key = check_identifier(raw.strip(), "`sessionKey`")
    return key if key.startswith("agent:") else f"agent:{agent_id}:{key}"


def list_answer(method: str, params: dict[str, Any], *, model: str) -> Any:
    """Answers of the list/describe methods the TUI calls at start (valid, mostly empty)."""
    if method == "agents.list":
        return {
            "defaultId": "main",
            "mainKey": "main",
            "scope": "per-sender",
            "agents": [{"id": "main", "name": "main", "kind": "agent"}],
        }
    if method == "question.list":
        return {"questions": []}
    if method == "plugin.approval.list":
        return []
    if method == "taskSuggestions.list":
        return {"suggestions": []}
    if method == "commands.list":
        return {"commands": []}
    if method == "models.list":
        return {"models": [{"id": model, "provider": "rollgate"}] if model else []}
    if method in ("health", "status"):
        return {"ok": True, "ts": now_ms()}
    if method == "sessions.subscribe":
        return {"subscribed": True}
    if method == "sessions.unsubscribe":
        return {"subscribed": False}
    if method == "sessions.describe":
        key = session_key(params.get("key") or params.get("sessionKey"))
        return {"session": {"key": key, "kind": "direct", "visibility": "private"}}
    raise KeyError(method)


def new_id() -> str:
    """A fresh uuid4 string."""
    return str(uuid.uuid4())
