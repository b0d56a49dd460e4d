"""Who may call the Trainer service: the admin key or the trainer key, as bearer metadata."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from services.runtime.errors import Unauthenticated
from services.runtime.secret import Secret, matches_any

_MISSING = (
    "the Trainer service needs the admin key (or the trainer key) as "
    "`authorization: Bearer …` metadata"
)


class TrainerAuth:
    """Checks call metadata against the admin key and the optional trainer key."""

    def __init__(self, *, admin_key: Secret, trainer_key: Secret | None = None) -> None:
        self._keys = tuple(key for key in (admin_key, trainer_key) if key)

    def check(self, metadata: Iterable[Any] | None) -> None:
        """Returns if a valid bearer key is present; else raises Unauthenticated."""
        token = _bearer(metadata)
        if not token or not matches_any(self._keys, token):
            raise Unauthenticated(_MISSING, code="invalid_trainer_key")


def _bearer(metadata: Iterable[Any] | None) -> bytes:
    for key, value in metadata or ():
        if key.lower() != "authorization":
            continue
        text = value.decode() if isinstance(value, bytes) else str(value)
        scheme, _, token = text.strip().partition(" ")
        if scheme.lower() == "bearer":
            return token.strip().encode()
    return b""
