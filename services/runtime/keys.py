"""Session, admin and trainer keys: generation, digests, and the shapes that tell them apart."""

from __future__ import annotations

import hashlib
import secrets

SESSION_KEY_PREFIX = "sk-sess-"
# Admin and trainer keys issued at run time (`POST /rl/keys`), by kind.
ACCESS_KEY_PREFIXES = {"admin": "sk-admin-", "trainer": "sk-trainer-"}
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


def new_access_key(kind: str) -> str:
    """A fresh admin or trainer key: its kind's prefix + 256 random bits."""
    return ACCESS_KEY_PREFIXES[kind] + secrets.token_urlsafe(32)


def access_key_kind(key: str) -> str:
    """ "admin" or "trainer" for strings shaped like an issued key of that kind, else ""."""
    for kind, prefix in ACCESS_KEY_PREFIXES.items():
        if key.startswith(prefix) and len(key) - len(prefix) == _SESSION_KEY_BODY_LEN:
            return kind
    return ""


def looks_like_key_id(text: str) -> bool:
    """True for a key id: 24 lowercase hex digits."""
    return len(text) == 24 and all(c in "0123456789abcdef" for c in text)
