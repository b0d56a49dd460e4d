"""Bearer keys: where they are read from, what kind they are, and who may call what."""

from __future__ import annotations

import enum
from collections.abc import Mapping

from services.runtime.errors import Unauthenticated
from services.runtime.keys import looks_like_session_key
from services.runtime.secret import Secret

MISSING_KEY_MESSAGE = (
    "missing API key: send `Authorization: Bearer <sk-sess-… session key from /rl/start_session>`"
)
ADMIN_KEY_ON_SESSION_ROUTE_MESSAGE = (
    "this is the admin key; chat and reward calls need the session key (`sk-sess-…`) "
    "returned by /rl/start_session"
)
NOT_A_SESSION_KEY_MESSAGE = (
    "this is not a rollgate session key; use the `sk-sess-…` key returned by "
    "/rl/start_session (the upstream API key stays on the server)"
)
ADMIN_KEY_REQUIRED_MESSAGE = "start_session needs the admin key"


class KeyKind(enum.Enum):
    """What a presented key is, judged by shape and by the admin key alone."""

    ADMIN = "admin"
    SESSION = "session"
    OTHER = "other"


def read_key(headers: Mapping[str, str]) -> str | None:
    """The key from `Authorization: Bearer …` (scheme case-insensitive) or `x-api-key`."""
    authorization = headers.get("Authorization", "").strip()
    scheme, _, rest = authorization.partition(" ")
    if scheme.lower() == "bearer" and rest.strip():
        return rest.strip()
    api_key = headers.get("x-api-key", "").strip()
    return api_key or None


def classify(key: str, admin_key: Secret) -> KeyKind:
    """ADMIN for the admin key, SESSION for the `sk-sess-` shape, OTHER for anything else."""
    if admin_key.matches(key):
        return KeyKind.ADMIN
    if looks_like_session_key(key):
        return KeyKind.SESSION
    return KeyKind.OTHER


def require_session_key(headers: Mapping[str, str], admin_key: Secret) -> str:
    """The session key of the request, or Unauthenticated saying which key to send."""
    key = read_key(headers)
    if key is None:
        raise Unauthenticated(MISSING_KEY_MESSAGE, code="missing_api_key")
    kind = classify(key, admin_key)
    if kind is KeyKind.ADMIN:
        raise Unauthenticated(ADMIN_KEY_ON_SESSION_ROUTE_MESSAGE, code="admin_key_not_allowed")
    if kind is KeyKind.OTHER:
        raise Unauthenticated(NOT_A_SESSION_KEY_MESSAGE, code="not_a_session_key")
    return key


def require_admin_key(headers: Mapping[str, str], admin_key: Secret) -> None:
    """Passes only for the admin key."""
    key = read_key(headers)
    if key is None or classify(key, admin_key) is not KeyKind.ADMIN:
        raise Unauthenticated(ADMIN_KEY_REQUIRED_MESSAGE, code="admin_key_required")


def require_any_key(headers: Mapping[str, str], admin_key: Secret) -> tuple[KeyKind, str]:
    """The admin key or a session-shaped key, with its kind."""
    key = read_key(headers)
    if key is None:
        raise Unauthenticated(MISSING_KEY_MESSAGE, code="missing_api_key")
    kind = classify(key, admin_key)
    if kind is KeyKind.OTHER:
        raise Unauthenticated(NOT_A_SESSION_KEY_MESSAGE, code="not_a_session_key")
    return kind, key
