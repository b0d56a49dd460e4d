"""Structured logs: JSON lines in production, readable lines on a terminal.

Every line — structlog's and the standard library's (aiohttp, grpc, asyncio) — passes one
processor chain whose last step before rendering masks secrets, so it sees the rendered
traceback too. Tracebacks carry no frame locals: locals hold settings, keys and headers.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, MutableMapping
from typing import Any

import structlog
from structlog.tracebacks import ExceptionDictTransformer

from services.runtime.secret import MASK, Secret, scrub

_SECRET_FIELDS = frozenset(
    {"api_key", "admin_key", "trainer_key", "authorization", "key", "token", "password"}
)

# Values of the secrets this process holds (admin, trainer, upstream keys): masked wherever
# they appear in a line. Process-wide because logging itself is (structlog.configure).
_KNOWN_SECRETS: set[str] = set()


def redact_secrets(secrets: Iterable[Secret]) -> None:
    """Masks these secrets' values in every later log line (e.g. keys added at runtime)."""
    _KNOWN_SECRETS.update(secret.reveal() for secret in secrets if secret)


def _scrub_value(value: Any) -> Any:
    if isinstance(value, str):
        return scrub(value, _KNOWN_SECRETS)
    if isinstance(value, dict):
        return {k: MASK if k in _SECRET_FIELDS else _scrub_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_scrub_value(v) for v in value]
    if isinstance(value, int | float | bool) or value is None:
        return value
    # Anything else is rendered as text anyway: scrub that text.
    return scrub(str(value), _KNOWN_SECRETS)


def redact(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Masks secret-named fields, known secret values and secret-shaped text, at any depth."""
    for name in list(event):
        if name.startswith("_"):
            continue  # structlog's own bookkeeping (the stdlib record), never rendered
        event[name] = MASK if name in _SECRET_FIELDS else _scrub_value(event[name])
    return event


def _exception_renderer(json_logs: bool) -> Any:
    if json_logs:
        # dict_tracebacks shows locals by default; they can hold keys.
        return structlog.processors.ExceptionRenderer(ExceptionDictTransformer(show_locals=False))
    return structlog.processors.format_exc_info


def configure_logging(
    *,
    service: str,
    json_logs: bool | None = None,
    level: str = "info",
    secrets: Iterable[Secret] = (),
) -> None:
    """Sets up structlog and the standard library's logging once per process;
    `json_logs=None` picks JSON unless on a terminal; `secrets` are masked in every line."""
    if json_logs is None:
        json_logs = not sys.stderr.isatty()
    redact_secrets(secrets)
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json_logs
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    numeric_level = logging.getLevelNamesMapping()[level.upper()]
    # Exceptions rendered first, then redaction, so it sees the traceback text.
    tail = [_exception_renderer(json_logs), redact, renderer]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *tail,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    _route_stdlib_logging(service, numeric_level, tail)


def _route_stdlib_logging(service: str, level: int, tail: list[Any]) -> None:
    """The standard library's loggers (aiohttp, asyncio, grpc) through the same chain."""
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_service(service),
        ],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *tail],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    # Libraries say little below WARNING that a user needs; our own lines use structlog.
    root.setLevel(max(level, logging.WARNING))


def _add_service(service: str) -> Any:
    def add(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        event.setdefault("service", service)
        return event

    return add


def get_logger(name: str) -> Any:
    """A structlog logger for `name`."""
    return structlog.get_logger(name)
