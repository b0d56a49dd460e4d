"""A masked secret: the one form in which services hold admin, trainer and upstream keys."""

from __future__ import annotations

import hmac
import re
from collections.abc import Iterable
from typing import Any, NoReturn

MASK = "***"

# Shapes a secret can be recognised by in free text, whoever held it: session keys and issued
# admin and trainer keys by their prefix, any bearer credential by the scheme in front of it.
_SECRET_SHAPES = re.compile(
    r"(?P<session>sk-(?:sess|admin|trainer)-)[A-Za-z0-9_\-]{8,}"
    r"|(?P<bearer>\b[Bb]earer\s+)[^\s'\",;}\]]+"
)


# Internal addresses, which a client must not see either: a URL, an IPv4 address (and port), a
# host:port.
_ADDRESS_SHAPES = re.compile(
    r"\b[a-z][a-z0-9+.-]*://[^\s'\"<>]+"
    r"|\b(?:\d{1,3}\.){3}\d{1,3}(?::\d{1,5})?\b"
    r"|\b[A-Za-z][\w.-]*:\d{2,5}\b",
    re.IGNORECASE,
)
ADDRESS_MASK = "<address>"


class Secret:
    """A string that never shows itself: `str`, `repr` and `format` are masked.

    Only `reveal()` gives the value, and only where it leaves the process (an HTTP header, a
    comparison). Pickling is refused so a secret cannot leak through a serialised object.
    """

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        if not isinstance(value, str):
            raise TypeError("Secret holds a str")
        self._value = value

    def reveal(self) -> str:
        """The value itself; call it only where the secret must leave the process."""
        return self._value

    def matches(self, candidate: str | bytes) -> bool:
        """Constant-time comparison with a presented key (False for an empty secret)."""
        if not self._value:
            return False
        given = candidate.encode() if isinstance(candidate, str) else candidate
        return hmac.compare_digest(self._value.encode(), given)

    def __bool__(self) -> bool:
        return bool(self._value)

    def __repr__(self) -> str:
        return f"Secret({MASK!r})" if self._value else "Secret('')"

    def __str__(self) -> str:
        return MASK if self._value else ""

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Secret):
            return NotImplemented
        return hmac.compare_digest(self._value.encode(), other._value.encode())

    def __hash__(self) -> int:
        return hash((Secret, self._value))

    def __reduce__(self) -> NoReturn:
        raise TypeError("a Secret cannot be pickled")


def matches_any(secrets: Iterable[Secret], candidate: str | bytes) -> bool:
    """True if `candidate` equals one of `secrets`; compares against all of them, so timing
    says nothing about which one matched or came close."""
    results = [secret.matches(candidate) for secret in secrets]
    return any(results)


class Keys(tuple[Secret, ...]):
    """The keys one key setting holds (`ROLLGATE_ADMIN_KEY=new,old`): the first is the
    current one, which rollgate itself sends and signs with; every one is accepted, so a
    rotation is add the new key, move clients, remove the old one. Each is a masked Secret."""

    __slots__ = ()

    @classmethod
    def of(cls, value: Secret | Keys) -> Keys:
        """`value` as Keys (one Secret is one key, an empty one none)."""
        if isinstance(value, Keys):
            return value
        return cls((value,) if value else ())

    @classmethod
    def parse(cls, raw: str, setting: str) -> Keys:
        """The keys of a comma-separated setting; ValueError naming the setting (never a key)
        when an entry is empty."""
        if not raw.strip():
            return cls()
        entries = [entry.strip() for entry in raw.split(",")]
        if not all(entries):
            raise ValueError(
                f"{setting} has an empty entry: separate several keys with one comma each "
                "(the first is the current key, the others are still accepted)"
            )
        return cls(Secret(entry) for entry in entries)

    @property
    def current(self) -> Secret:
        """The key rollgate sends and signs with (the first)."""
        return self[0] if self else NO_SECRET

    def reveal(self) -> str:
        """The current key's value; call it only where the key must leave the process."""
        return self.current.reveal()

    def matches(self, candidate: str | bytes) -> bool:
        """True if `candidate` is one of the keys (constant time, all compared)."""
        return matches_any(self, candidate)

    def __repr__(self) -> str:
        return f"Keys({len(self)} x {MASK!r})"

    def __str__(self) -> str:
        return ",".join(MASK for _ in self)


def secrets_in(settings: Any) -> tuple[Secret, ...]:
    """Every Secret a settings object holds (fields, and tuples or lists of them)."""
    found: list[Secret] = []
    names = getattr(settings, "__dataclass_fields__", {})
    for name in names:
        value = getattr(settings, name, None)
        items = value if isinstance(value, tuple | list | frozenset) else (value,)
        found.extend(item for item in items if isinstance(item, Secret) and item)
    return tuple(found)


def scrub(text: str, known: Iterable[str] = ()) -> str:
    """`text` with every known secret value and every secret-shaped substring masked."""
    for value in known:
        if value and value in text:
            text = text.replace(value, MASK)
    # Every shape holds one of these literally: two substring searches skip the regex (8 µs
    # over a 250-character log line) for the text that has none.
    if "sk-" not in text and "earer" not in text:
        return text
    return _SECRET_SHAPES.sub(_mask_match, text)


def mask_addresses(text: str) -> str:
    """`text` with every URL, IP address and host:port masked."""
    return _ADDRESS_SHAPES.sub(ADDRESS_MASK, text)


def _mask_match(match: re.Match[str]) -> str:
    return (match.group("session") or match.group("bearer")) + MASK


# The default of an optional secret setting (an immutable value, safe to share).
NO_SECRET = Secret("")
