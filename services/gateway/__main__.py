"""`python -m services.gateway [--host H] [--port P]`: the public HTTP entry of rollgate."""

from __future__ import annotations

from collections.abc import Sequence

from services.gateway.app import GatewayServer
from services.gateway.settings import GatewaySettings
from services.runtime.service_main import service_main


def main(argv: Sequence[str] | None = None) -> None:
    """Reads the settings once, then serves until SIGTERM/SIGINT."""
    service_main(
        service="gateway",
        description=__doc__,
        default_port=8080,
        load_settings=GatewaySettings.load,
        serving=GatewayServer,
        argv=argv,
    )


if __name__ == "__main__":
    main()
