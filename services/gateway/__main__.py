"""`python -m services.gateway [--host H] [--port P]`: the public HTTP entry of rollgate."""

from __future__ import annotations

import argparse
import os
import sys

from services.gateway.app import GatewayServer
from services.gateway.settings import GatewaySettings
from services.runtime.config import merged_environ
from services.runtime.grpc_server import run, wait_for_stop_signal
from services.runtime.logs import configure_logging


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    parser.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default 8080; 0: any)")
    parser.add_argument("--config", default=None, help="rollgate YAML (the environment wins)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides: a.b.0.c=value")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Reads the settings once, then serves until SIGTERM/SIGINT."""
    args = _parse_args(argv)
    try:
        settings = GatewaySettings.from_env(
            merged_environ(os.environ, args.config, args.overrides, "gateway"),
            host=args.host,
            port=args.port,
        )
    except ValueError as err:
        sys.exit(f"gateway: {err}")
    configure_logging(service="gateway", json_logs=settings.log_json, level=settings.log_level)

    async def serve() -> None:
        async with GatewayServer(settings):
            await wait_for_stop_signal()

    run(serve)


if __name__ == "__main__":
    main()
