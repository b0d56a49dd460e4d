"""Who may call the Trainer service: the admin key or the trainer key, as bearer metadata."""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from typing import Any

from services.runtime.errors import Unauthenticated

_MISSING = (
    "the Trainer service needs the admin key (or the trainer key) as "
    "`authorization: Bearer …` metadata"
)


class TrainerAuth:
    """Checks call metadata against the admin key and the optional trainer key."""

    def __init__(self, *, admin_key: str, trainer_key: str = "") -> None:
        self._keys = tuple(key.encode() for key in (admin_key, trainer_key) if key)

    def check(self, metadata: Iterable[Any] | None) -> None:
        """Returns if a valid bearer key is present; else raises Unauthenticated."""
        token = _bearer(metadata)
        # Compare against every key, so timing says nothing about which one was close.
        matches = [hmac.compare_digest(token, key) for key in self._keys]
        if not token or not any(matches):
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
