"""Gateway settings, read once in `__main__`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self

from services.gateway.ws_protocol import DEFAULT_SYSTEM_PROMPT
from services.runtime.secret import Keys
from services.runtime.settings import ServiceSettings, Sources, common_settings, positive

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
# start_session waits the dataproxy's refresh timeout plus this much (publication, hops).
START_SESSION_MARGIN_S = 10.0
DEFAULT_PORT = 8080
ADMIN_SETTING = "ROLLGATE_ADMIN_KEY (admin_key in the file)"


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewaySettings(ServiceSettings):
    """Everything the gateway needs to know at start-up."""

    # Authenticates /rl/start_session, the console, /rl/keys ...; required, compared in
    # constant time. Several keys (`ROLLGATE_ADMIN_KEY=new,old`) are all accepted; the first
    # signs console cookies and goes on the gateway's own calls to the dataproxy.
    admin_key: Keys
    port: int = DEFAULT_PORT
    router_addr: str = "127.0.0.1:50051"
    dataproxy_addr: str = "127.0.0.1:50052"
    # Use the framed Turns and Ledger streams where the worker and dataproxy offer them
    # (services/runtime/framed.py); off: their gRPC streams.
    framed_streams: bool = True
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # Deadline for one chat turn, streaming included.
    request_timeout_s: float = 600.0
    # Deadline for routing and the small session calls (set_reward, models, ...).
    rpc_timeout_s: float = 5.0
    # start_session may wait for capacity: the dataproxy's refresh timeout plus a margin.
    start_session_timeout_s: float = 130.0
    # end_session publishes the trajectory: more work than a reward.
    end_session_timeout_s: float = 30.0
    # Deadline for each health check behind /ready.
    ready_timeout_s: float = 2.0
    # How often /health's count of live workers is refreshed from the router when no /health
    # asks (a /health refreshes a count older than 2 s itself: services.gateway.health).
    health_workers_refresh_s: float = 10.0
    route_cache_ttl_s: float = 5.0
    route_cache_size: int = 100_000
    # The console (/console): how long a login cookie lives without use (renewed while the
    # page is open), and the longest a login lasts however often it is renewed.
    console_session_s: float = 900.0
    console_max_login_s: float = 12 * 3600.0
    # Refused console logins a client address may make per minute (then 429 until they refill).
    console_login_failures_per_min: int = 10
    # The WebSocket bridge (`/ws`, docs/protocols.md): the model its runs use ("": the first
    # model a live worker serves), their system prompt, the tick interval, the frame and
    # buffer limits announced in hello-ok, and the deadline of one run.
    ws_model: str = ""
    ws_system_prompt: str = DEFAULT_SYSTEM_PROMPT
    ws_tick_interval_ms: int = 15_000
    ws_max_payload_bytes: int = 25 * 1024 * 1024
    ws_max_buffered_bytes: int = 50 * 1024 * 1024
    ws_run_timeout_s: float = 600.0
    # The HTTP/1.1 edge (docs/deploy.md): a request head (request line and headers) must
    # arrive within header_timeout_s of its first byte; an idle keep-alive connection is
    # closed after keepalive_timeout_s; a header line (and the request line) may be at most
    # max_header_bytes long, and a request may carry at most max_headers headers.
    header_timeout_s: float = 10.0
    # The whole body must arrive within this long of the head.
    body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 75.0
    max_header_bytes: int = 8190
    max_headers: int = 128

    def __post_init__(self) -> None:
        # One Secret (as tests and embedders pass it) is one key.
        object.__setattr__(self, "admin_key", Keys.of(self.admin_key))

    @classmethod
    def load(cls, src: Sources, *, host: str | None = None, port: int | None = None) -> Self:
        """Settings from the sources (and command-line host/port)."""
        admin_key = Keys.parse(src.text("ROLLGATE_ADMIN_KEY", file="admin_key"), ADMIN_SETTING)
        if not admin_key:
            raise ValueError(
                "ROLLGATE_ADMIN_KEY is not set: the gateway needs the admin key to authenticate "
                "/rl/start_session (rollgate up sets it for you)"
            )
        # start_session waits as long as the dataproxy's refresh does (plus a margin).
        refresh_timeout_s = src.positive(
            "ROLLGATE_REFRESH_TIMEOUT_S", 120.0, file="dataproxy.refresh_timeout_s"
        )
        return cls(
            **common_settings(
                src, service="gateway", host=host, port=port, default_port=DEFAULT_PORT
            ),
            admin_key=admin_key,
            console_session_s=src.positive("ROLLGATE_CONSOLE_SESSION_S", 900.0),
            console_max_login_s=src.positive("ROLLGATE_CONSOLE_MAX_LOGIN_S", 12 * 3600.0),
            console_login_failures_per_min=_at_least_one(
                src.integer("ROLLGATE_CONSOLE_LOGIN_FAILURES_PER_MIN", 10),
                "ROLLGATE_CONSOLE_LOGIN_FAILURES_PER_MIN",
            ),
            router_addr=src.text("ROLLGATE_ROUTER_ADDR", "127.0.0.1:50051", file="router.address"),
            dataproxy_addr=src.text(
                "ROLLGATE_DATAPROXY_ADDR", "127.0.0.1:50052", file="dataproxy.address"
            ),
            framed_streams=src.flag("ROLLGATE_FRAMED_STREAMS", True),
            start_session_timeout_s=refresh_timeout_s + START_SESSION_MARGIN_S,
            **_ws_settings(src),
            **_limits(src),
        )


def _at_least_one(value: int, name: str) -> int:
    if value < 1:
        raise ValueError(f"{name}={value} must be at least 1")
    return value


def _ws_settings(src: Sources) -> dict[str, Any]:
    """The `ROLLGATE_WS_*` variables; every limit must be positive."""
    numbers: dict[str, Any] = {
        "ws_tick_interval_ms": src.integer("ROLLGATE_WS_TICK_INTERVAL_MS", 15_000),
        "ws_max_payload_bytes": src.integer("ROLLGATE_WS_MAX_PAYLOAD_BYTES", 25 << 20),
        "ws_max_buffered_bytes": src.integer("ROLLGATE_WS_MAX_BUFFERED_BYTES", 50 << 20),
        "ws_run_timeout_s": src.number("ROLLGATE_WS_RUN_TIMEOUT_S", 600.0),
    }
    for name, value in numbers.items():
        positive(value, f"ROLLGATE_{name.upper()}")
    return numbers | {
        "ws_model": src.text("ROLLGATE_WS_MODEL", ""),
        "ws_system_prompt": src.text("ROLLGATE_WS_SYSTEM_PROMPT", DEFAULT_SYSTEM_PROMPT),
    }


def _limits(src: Sources) -> dict[str, Any]:
    """The body and request limits and the HTTP/1.1 edge's (`gateway.*` in the file); each
    must be positive."""
    numbers: dict[str, Any] = {
        "max_body_bytes": src.integer(
            "ROLLGATE_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES, file="gateway.max_body_bytes"
        ),
        "request_timeout_s": src.number(
            "ROLLGATE_REQUEST_TIMEOUT_S", 600.0, file="gateway.request_timeout_s"
        ),
        "header_timeout_s": src.number(
            "ROLLGATE_HEADER_TIMEOUT_S", 10.0, file="gateway.header_timeout_s"
        ),
        "body_timeout_s": src.number(
            "ROLLGATE_BODY_TIMEOUT_S", 60.0, file="gateway.body_timeout_s"
        ),
        "keepalive_timeout_s": src.number(
            "ROLLGATE_KEEPALIVE_TIMEOUT_S", 75.0, file="gateway.keepalive_timeout_s"
        ),
        "max_header_bytes": src.integer(
            "ROLLGATE_MAX_HEADER_BYTES", 8190, file="gateway.max_header_bytes"
        ),
        "max_headers": src.integer("ROLLGATE_MAX_HEADERS", 128, file="gateway.max_headers"),
    }
    for name, value in numbers.items():
        positive(value, f"ROLLGATE_{name.upper()}")
    return numbers
