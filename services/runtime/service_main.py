"""The one `main` every service runs: parse the command line, read the settings once, log,
serve until SIGTERM/SIGINT, and turn start-up failures into one clear line."""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, TypeVar

from services.runtime.grpc_server import run, wait_for_stop_signal
from services.runtime.logs import configure_logging, get_logger
from services.runtime.secret import secrets_in
from stackconfig import sources_for

log = get_logger(__name__)


class ServiceSettings(Protocol):
    """What the entry point needs from a service's settings."""

    @property
    def log_json(self) -> bool | None: ...

    @property
    def log_level(self) -> str: ...


S = TypeVar("S", bound=ServiceSettings)


def service_main(
    *,
    service: str,
    description: str | None,
    default_port: int,
    load_settings: Callable[..., S],
    serving: Callable[[S], AbstractAsyncContextManager[Any]],
    argv: Sequence[str] | None = None,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
    startup_errors: tuple[type[Exception], ...] = (),
) -> None:
    """Runs `service` (`python -m services.<service> [--host H] [--port P] [--config F] …`)."""
    parser = command_line(
        service, description=description, default_port=default_port, add_arguments=add_arguments
    )
    args = parser.parse_args(argv)
    try:
        settings = settings_from(service, args, os.environ, load_settings)
    except ValueError as err:
        # A configuration problem is one clear line naming the setting, not a usage dump.
        print(f"{parser.prog}: {err}", file=sys.stderr)
        sys.exit(2)
    configure_logging(
        service=service,
        json_logs=settings.log_json,
        level=settings.log_level,
        secrets=secrets_in(settings),
    )

    started = False

    async def serve() -> None:
        nonlocal started
        async with serving(settings):
            started = True
            await wait_for_stop_signal()
            log.info("stop_signal_received")

    try:
        run(serve)
    except Exception as err:
        if started:
            log.exception("service_failed")
            sys.exit(1)
        # Start-up failures are one line saying what to fix; a traceback only at debug level.
        log.debug("startup_traceback", exc_info=err)
        log.error("startup_failed", error=startup_message(err, known=startup_errors))
        sys.exit(1)


def command_line(
    service: str,
    *,
    description: str | None = None,
    default_port: int,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.ArgumentParser:
    """The command line every service takes (plus its own `add_arguments`)."""
    parser = argparse.ArgumentParser(prog=f"python -m services.{service}", description=description)
    parser.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=None, help=f"port (default {default_port}; 0: any)"
    )
    parser.add_argument(
        "--metrics-port",
        default=None,
        help="port of GET /metrics (default $ROLLGATE_METRICS_PORT, else per service; 0: any; off)",
    )
    parser.add_argument(
        "--config",
        default=None,
        help="rollgate YAML (the environment wins over it, dotted overrides over both)",
    )
    if add_arguments is not None:
        add_arguments(parser)
    parser.add_argument("overrides", nargs="*", help="dotted overrides: a.b.0.c=value")
    return parser


def settings_from(
    service: str,
    args: argparse.Namespace,
    environ: Mapping[str, str],
    load_settings: Callable[..., S],
) -> S:
    """The settings of `service` from its parsed command line and the environment: the one
    place file, environment and command line meet (docs/internals.md, Configuration)."""
    if args.metrics_port is not None:
        # The flag wins over the environment, as --host and --port do.
        environ = {**environ, "ROLLGATE_METRICS_PORT": str(args.metrics_port)}
    sources = sources_for(
        service,
        environ=environ,
        config_path=args.config,
        overrides=args.overrides,
        upstream=getattr(args, "upstream", None),
    )
    return load_settings(sources, host=args.host, port=args.port)


class StartupError(Exception):
    """A service cannot start; the message says what to fix."""


def startup_message(err: BaseException, *, known: tuple[type[Exception], ...] = ()) -> str:
    """One line describing a start-up failure and what to do about it."""
    if isinstance(err, (StartupError, ValueError, *known)):
        # Configuration checks and start-up probes raise these with the fix in the message.
        text = str(err)
    elif isinstance(err, OSError) and err.errno == errno.EADDRINUSE:
        text = f"{err}: choose another --port (or --host), or stop the process using it"
    elif isinstance(err, OSError):
        text = str(err)
    else:
        text = f"{type(err).__name__}: {err} (set ROLLGATE_LOG_LEVEL=debug for the traceback)"
    return " ".join(text.split())
