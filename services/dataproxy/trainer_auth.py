"""Who may call the Trainer service: an admin or trainer key, as bearer metadata.

Valid keys: the configured admin key (`ROLLGATE_ADMIN_KEY`) and trainer key
(`ROLLGATE_TRAINER_KEY`), compared in constant time, and the admin and trainer keys issued at
run time (`POST /rl/keys`), found by their SHA-256 digest (services/dataproxy/access_keys.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from services.runtime.errors import Unauthenticated
from services.runtime.keys import access_key_kind, key_digest
from services.runtime.secret import Keys, Secret, matches_any

_MISSING = (
    "the Trainer service needs the admin key (or the trainer key) as `authorization: Bearer …` "
    "metadata; admin and trainer keys issued by POST /rl/keys work too"
)
_REVOKED = "this key was revoked: use a current admin or trainer key"

# digest → "admin" | "trainer" | "revoked" | "" (AccessKeyStore.lookup)
AccessLookup = Callable[[str], Awaitable[str]]


class TrainerAuth:
    """Checks call metadata against the configured keys and the issued ones."""

    def __init__(
        self,
        *,
        admin_key: Keys | Secret,
        trainer_key: Keys | Secret | None = None,
        lookup: AccessLookup | None = None,
    ) -> None:
        # Every configured key is accepted (a rotation holds the old and the new one).
        self._keys = (*Keys.of(admin_key), *(Keys.of(trainer_key) if trainer_key else ()))
        self._lookup = lookup

    async def check(self, metadata: Iterable[Any] | None, *, what: str = _MISSING) -> str:
        """Returns if a valid bearer key is present; else raises Unauthenticated (`what`).
        The answer is the digest of an issued key ("" for a configured one): what
        `still_valid` checks again during a long call."""
        token = _bearer(metadata)
        if token and matches_any(self._keys, token):
            return ""
        text = token.decode(errors="replace")
        if self._lookup is not None and access_key_kind(text):
            digest = key_digest(text)
            await self.still_valid(digest, what=what)
            return digest
        raise Unauthenticated(what, code="invalid_trainer_key")

    async def still_valid(self, digest: str, *, what: str = _MISSING) -> None:
        """Raises Unauthenticated (`key_revoked` once revoked) unless the issued key with this
        digest is valid; "" (a configured key, which only the configuration changes) passes."""
        if not digest:
            return
        kind = await self._lookup(digest) if self._lookup is not None else ""
        if kind in ("admin", "trainer"):
            return
        if kind == "revoked":
            raise Unauthenticated(_REVOKED, code="key_revoked")
        raise Unauthenticated(what, code="invalid_trainer_key")


def _bearer(metadata: Iterable[Any] | None) -> bytes:
    for key, value in metadata or ():
        if key.lower() != "authorization":
            continue
        text = value.decode() if isinstance(value, bytes) else str(value)
        scheme, _, token = text.strip().partition(" ")
        if scheme.lower() == "bearer":
            return token.strip().encode()
    return b""
