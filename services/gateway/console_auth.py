"""The console's login: a signed, short-lived, stateless cookie that any gateway replica checks.

The operator logs in once with an admin key — the configured one or one issued by
`POST /rl/keys` — POSTed in a form body, never in a URL. The cookie holds only who logged in
(`sub`: "configured", or the SHA-256 digest of the issued key, never a key), when, and until
when, signed with HMAC-SHA256 under a key derived from the current configured admin key (the first
of `ROLLGATE_ADMIN_KEY=new,old`) and accepted when it is signed under any of them. Every
replica holds those keys, so any replica accepts the cookie without shared state, also while
a rotation is rolled out (old -> old,new -> new,old -> new); dropping a configured admin key
ends the console sessions signed under it, and revoking an issued admin key ends the
sessions it opened (the gateway asks the Keys service, as for any issued key).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Mapping
from dataclasses import dataclass

import orjson

from services.runtime.secret import Keys, Secret

COOKIE_NAME = "rollgate_console"
COOKIE_PATH = "/console"
VERSION = "v1"
CONFIGURED = "configured"
# The signing key is derived from the admin key with this label, so a console cookie's
# signature can never stand for anything else keyed by the admin key.
_DERIVE_LABEL = b"rollgate console cookie v1"
# A cookie issued up to this far in the future (another replica's clock) is still accepted.
CLOCK_SKEW_S = 60


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsoleSession:
    """A valid cookie: who logged in, when, when it was issued and until when it holds."""

    subject: str
    login_at: int
    issued_at: int
    expires_at: int

    @property
    def issued_key(self) -> bool:
        """True when an issued admin key (not the configured one) logged in."""
        return self.subject != CONFIGURED


class CookieRefused(Exception):
    """Why a cookie is not accepted (for the log; the client only learns "log in again")."""


class ConsoleCookies:
    """Issues and checks console cookies, signed under the configured admin key."""

    def __init__(self, admin_key: Keys | Secret, *, session_s: float, max_login_s: float) -> None:
        # One signing key per configured admin key, by kid: the first signs, any verifies.
        self._keys = dict(_signing_key(key) for key in Keys.of(admin_key))
        self._kid = next(iter(self._keys))
        self._key = self._keys[self._kid]
        self.session_s = int(session_s)
        self.max_login_s = int(max_login_s)

    def issue(self, subject: str, *, now: float | None = None) -> str:
        """A fresh cookie value for a login by `subject` (CONFIGURED or an issued key's digest)."""
        at = int(time.time() if now is None else now)
        return self._issue(subject, login_at=at, now=at)

    def check(self, value: str | None, *, now: float | None = None) -> ConsoleSession:
        """The session a cookie value proves; CookieRefused when forged, expired or stale."""
        if not value:
            raise CookieRefused("no cookie")
        parts = value.split(".")
        if len(parts) != 3 or parts[0] != VERSION:
            raise CookieRefused("malformed")
        try:
            payload = _unb64(parts[1])
            signature = _unb64(parts[2])
            claims = orjson.loads(payload)
        except (ValueError, orjson.JSONDecodeError):
            raise CookieRefused("malformed") from None
        if not isinstance(claims, dict):
            raise CookieRefused("malformed")
        key = self._keys.get(str(claims.get("kid", "")))
        if key is None:
            raise CookieRefused("signed under another admin key")
        if not hmac.compare_digest(_sign(key, payload), signature):
            raise CookieRefused("bad signature")
        try:
            session = ConsoleSession(
                subject=str(claims["sub"]),
                login_at=int(claims["login"]),
                issued_at=int(claims["iat"]),
                expires_at=int(claims["exp"]),
            )
        except (KeyError, TypeError, ValueError):
            raise CookieRefused("malformed") from None
        now = time.time() if now is None else now
        if session.expires_at <= now:
            raise CookieRefused("expired")
        if session.issued_at > now + CLOCK_SKEW_S or session.login_at > session.issued_at:
            raise CookieRefused("issued in the future")
        if now - session.login_at > self.max_login_s:
            raise CookieRefused("login too old")
        return session

    def renewal(self, session: ConsoleSession, *, now: float | None = None) -> str | None:
        """A renewed cookie when less than half of the session is left (the page stays
        logged in while open, up to max_login_s after the login), else None."""
        now = time.time() if now is None else now
        if session.expires_at - now > self.session_s / 2:
            return None
        if session.expires_at >= session.login_at + self.max_login_s:
            return None
        return self._issue(session.subject, login_at=session.login_at, now=int(now))

    def _issue(self, subject: str, *, login_at: int, now: int) -> str:
        expires = min(now + self.session_s, login_at + self.max_login_s)
        claims = {"kid": self._kid, "sub": subject, "login": login_at, "iat": now, "exp": expires}
        payload = orjson.dumps(claims, option=orjson.OPT_SORT_KEYS)
        return f"{VERSION}.{_b64(payload)}.{_b64(self._sign(payload))}"

    def _sign(self, payload: bytes) -> bytes:
        return _sign(self._key, payload)


def _signing_key(admin_key: Secret) -> tuple[str, Secret]:
    """The cookie signing key derived from one admin key, and its kid: a one-way tag, so a
    cookie signed under a key no longer configured is told apart from a forged one (both
    are refused)."""
    derived = hmac.new(admin_key.reveal().encode(), _DERIVE_LABEL, hashlib.sha256).digest()
    return hmac.new(derived, b"kid", hashlib.sha256).hexdigest()[:16], Secret(derived.hex())


def _sign(key: Secret, payload: bytes) -> bytes:
    return hmac.new(key.reveal().encode(), payload, hashlib.sha256).digest()


def cookie_attributes(*, max_age_s: int, secure: bool) -> Mapping[str, str | int | bool]:
    """Set-Cookie attributes: only the console's paths, never readable by scripts, never sent
    from another site, Secure behind HTTPS."""
    return {
        "path": COOKIE_PATH,
        "max_age": max_age_s,
        "httponly": True,
        "samesite": "Strict",
        "secure": secure,
    }


_B64_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    if not text or any(c not in _B64_CHARS for c in text):
        raise ValueError("not base64url")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
