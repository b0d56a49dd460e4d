"""Session keys: generation, digests, and the shapes that tell keys apart."""

from __future__ import annotations

import hashlib
import secrets

SESSION_KEY_PREFIX = "sk-sess-"
# 32 random bytes in url-safe base64 without padding: 43 characters.
_SESSION_KEY_BODY_LEN = 43


def new_session_key() -> str:
    """A fresh session key: `sk-sess-` + 256 random bits."""
    return SESSION_KEY_PREFIX + secrets.token_urlsafe(32)


def looks_like_session_key(key: str) -> bool:
    """True for strings shaped like a rollgate session key."""
    body = key[len(SESSION_KEY_PREFIX) :]
    return key.startswith(SESSION_KEY_PREFIX) and len(body) == _SESSION_KEY_BODY_LEN


def key_digest(key: str) -> str:
    """SHA-256 hex digest: the only form in which a session key is stored or sent on."""
    return hashlib.sha256(key.encode()).hexdigest()


def key_id_of(digest: str) -> str:
    """The key id written into trajectories: a prefix of the digest, never the key."""
    return digest[:24]
