"""Bearer keys: where they are read from, what kind they are, and who may call what."""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Mapping

from services.runtime.errors import Unauthenticated
from services.runtime.keys import access_key_kind, key_digest, looks_like_session_key
from services.runtime.secret import Keys

# digest → "admin" | "trainer" | "revoked" | "": what the dataproxy's Keys service knows of an
# issued admin or trainer key (held there only as a digest).
AccessLookup = Callable[[str], Awaitable[str]]

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
ISSUED_KEY_ON_SESSION_ROUTE_MESSAGE = (
    "this is an admin or trainer key; chat and reward calls need the session key (`sk-sess-…`) "
    "returned by /rl/start_session"
)
ADMIN_KEY_REQUIRED_MESSAGE = (
    "this route needs the admin key (ROLLGATE_ADMIN_KEY, or an admin key issued by POST /rl/keys)"
)
ADMIN_KEY_REVOKED_MESSAGE = "this admin key was revoked: use a current admin key"


class KeyKind(enum.Enum):
    """What a presented key is, judged by shape and by the admin key alone."""

    ADMIN = "admin"
    SESSION = "session"
    # Shaped like an admin or trainer key issued at run time: valid only if the Keys service
    # knows its digest.
    ISSUED = "issued"
    OTHER = "other"


def read_key(headers: Mapping[str, str]) -> str | None:
    """The key from `Authorization: Bearer …` (scheme case-insensitive) or `x-api-key`."""
    authorization = headers.get("Authorization", "").strip()
    scheme, _, rest = authorization.partition(" ")
    if scheme.lower() == "bearer" and rest.strip():
        return rest.strip()
    api_key = headers.get("x-api-key", "").strip()
    return api_key or None


def classify(key: str, admin_key: Keys) -> KeyKind:
    """ADMIN for the configured admin key, SESSION for the `sk-sess-` shape, ISSUED for the
    `sk-admin-` / `sk-trainer-` shapes, OTHER for anything else."""
    if admin_key.matches(key):
        return KeyKind.ADMIN
    if looks_like_session_key(key):
        return KeyKind.SESSION
    if access_key_kind(key):
        return KeyKind.ISSUED
    return KeyKind.OTHER


def require_session_key(headers: Mapping[str, str], admin_key: Keys) -> str:
    """The session key of the request, or Unauthenticated saying which key to send."""
    key = read_key(headers)
    if key is None:
        raise Unauthenticated(MISSING_KEY_MESSAGE, code="missing_api_key")
    kind = classify(key, admin_key)
    if kind is KeyKind.ADMIN:
        raise Unauthenticated(ADMIN_KEY_ON_SESSION_ROUTE_MESSAGE, code="admin_key_not_allowed")
    if kind is KeyKind.ISSUED:
        raise Unauthenticated(ISSUED_KEY_ON_SESSION_ROUTE_MESSAGE, code="admin_key_not_allowed")
    if kind is KeyKind.OTHER:
        raise Unauthenticated(NOT_A_SESSION_KEY_MESSAGE, code="not_a_session_key")
    return key


async def require_admin_key(
    headers: Mapping[str, str], admin_key: Keys, lookup: AccessLookup
) -> None:
    """Passes for the configured admin key (constant time) and for issued admin keys (by
    digest: one lookup, only for keys of that shape)."""
    key = read_key(headers)
    kind = KeyKind.OTHER if key is None else classify(key, admin_key)
    if kind is KeyKind.ADMIN:
        return
    if key is not None and kind is KeyKind.ISSUED and access_key_kind(key) == "admin":
        found = await lookup(key_digest(key))
        if found == "admin":
            return
        if found == "revoked":
            raise Unauthenticated(ADMIN_KEY_REVOKED_MESSAGE, code="key_revoked")
    raise Unauthenticated(ADMIN_KEY_REQUIRED_MESSAGE, code="admin_key_required")


async def require_any_key(
    headers: Mapping[str, str], admin_key: Keys, lookup: AccessLookup
) -> tuple[KeyKind, str]:
    """An admin key (ADMIN, configured or issued) or a session-shaped key (SESSION: the caller
    checks that the dataproxy knows it), with its kind."""
    key = read_key(headers)
    if key is None:
        raise Unauthenticated(MISSING_KEY_MESSAGE, code="missing_api_key")
    kind = classify(key, admin_key)
    if kind is KeyKind.ISSUED:
        await require_admin_key(headers, admin_key, lookup)
        return KeyKind.ADMIN, key
    if kind is KeyKind.OTHER:
        raise Unauthenticated(NOT_A_SESSION_KEY_MESSAGE, code="not_a_session_key")
    return kind, key
