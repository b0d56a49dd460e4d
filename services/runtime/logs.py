"""Structured logs: JSON lines in production, readable lines on a terminal."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

_SECRET_FIELDS = frozenset({"api_key", "admin_key", "authorization", "key", "token", "password"})


def _redact(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for field in _SECRET_FIELDS & event.keys():
        event[field] = "***"
    return event


def configure_logging(*, service: str, json_logs: bool | None = None, level: str = "info") -> None:
    """Sets up structlog once per process; `json_logs=None` picks JSON unless on a terminal."""
    if json_logs is None:
        json_logs = not sys.stderr.isatty()
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json_logs
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _redact,
            # show_locals defaults to True in rich tracebacks: locals can hold keys.
            structlog.processors.dict_tracebacks
            if json_logs
            else structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)


def get_logger(name: str) -> Any:
    """A structlog logger for `name`."""
    return structlog.get_logger(name)
