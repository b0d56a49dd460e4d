"""Parsing helpers for the settings each service reads once in its `__main__`."""

from __future__ import annotations

from collections.abc import Mapping

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def env_str(environ: Mapping[str, str], name: str, default: str) -> str:
    """`environ[name]`, or `default` when unset or empty."""
    value = environ.get(name, "").strip()
    return value or default


def env_float(environ: Mapping[str, str], name: str, default: float) -> float:
    """A float setting, with a message naming the variable when it does not parse."""
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


def env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    """An integer setting, with a message naming the variable when it does not parse."""
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def env_bool(environ: Mapping[str, str], name: str, default: bool) -> bool:
    """A yes/no setting (1/0, true/false, yes/no, on/off)."""
    raw = environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in {"1", "true", "yes", "on"}:
        return True
    if raw in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"{name}={raw!r} is not a yes/no value")


def redis_url(environ: Mapping[str, str]) -> str:
    """`ROLLGATE_REDIS_URL`, else `REDIS_URL`, else the local default."""
    return env_str(environ, "ROLLGATE_REDIS_URL", env_str(environ, "REDIS_URL", DEFAULT_REDIS_URL))
