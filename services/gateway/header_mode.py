"""OpenClaw-RL's session headers: X-Session-Id, X-Turn-Type, X-Session-Done (or body keys).

OpenClaw-RL's patched OpenClaw names the conversation and the kind of turn on every call.
The body keys `session_id`, `turn_type`, `session_done` mean the same as the headers (a header
wins); the worker strips them before forwarding. Unlike OpenClaw-RL, a missing turn type is
`main` here (OpenClaw-RL silently treats it as `side`, which produces no training data).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.runtime.errors import InvalidRequest, bounded, check_identifier

SESSION_ID_HEADER = "X-Session-Id"
TURN_TYPE_HEADER = "X-Turn-Type"
SESSION_DONE_HEADER = "X-Session-Done"
TURN_TYPES = ("main", "side")
# OpenClaw-RL's truthy strings for session_done.
_TRUE = frozenset({"1", "true", "yes", "on"})


@dataclass(slots=True, kw_only=True)  # not frozen: built every turn (half the cost)
class TurnTags:
    """What a call says about its session: its id, main or side, and whether it is the last."""

    session_id: str = ""
    turn_type: str = "main"
    session_done: bool = False


def body_tags(body: Mapping[str, Any]) -> TurnTags:
    """The body's `session_id`, `turn_type`, `session_done` (not yet merged with headers)."""
    session_id = body.get("session_id")
    turn_type = body.get("turn_type")
    done = body.get("session_done")
    if session_id is not None and not isinstance(session_id, str | int):
        raise InvalidRequest("`session_id` must be a string", code="invalid_session_id")
    if turn_type is not None and not isinstance(turn_type, str):
        raise InvalidRequest("`turn_type` must be a string: main or side", code="invalid_turn_type")
    return TurnTags(
        session_id="" if session_id is None else str(session_id),
        turn_type=turn_type or "",
        session_done=_truthy(done),
    )


def session_id_header(headers: Mapping[str, str]) -> str:
    """The X-Session-Id header (stripped, "" when absent), within the identifier limit."""
    return check_identifier(headers.get(SESSION_ID_HEADER, "").strip(), SESSION_ID_HEADER)


def turn_tags(headers: Mapping[str, str], body: TurnTags) -> TurnTags:
    """The headers merged over the body's keys, as OpenClaw-RL reads them; validated."""
    session_id = session_id_header(headers) or check_identifier(
        body.session_id.strip(), "`session_id`"
    )
    raw_type = headers.get(TURN_TYPE_HEADER, "").strip() or body.turn_type.strip()
    turn_type = raw_type.lower() or "main"
    if turn_type not in TURN_TYPES:
        raise InvalidRequest(
            f"X-Turn-Type must be main or side, not {bounded(raw_type, 40)!r}",
            code="invalid_turn_type",
        )
    done = _truthy(headers.get(SESSION_DONE_HEADER)) or body.session_done
    return TurnTags(session_id=session_id, turn_type=turn_type, session_done=done)


def _truthy(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return value != 0
    return isinstance(value, str) and value.strip().lower() in _TRUE
