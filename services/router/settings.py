"""Router settings, read once in `__main__`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from services.runtime.settings import (
    DEFAULT_REDIS_URL,
    ServiceSettings,
    Sources,
    common_settings,
    redis_settings,
)

# An affinity unused this long is forgotten; the next turn of that session is placed afresh.
AFFINITY_TTL_S = 24 * 3600.0
DEFAULT_PORT = 50051


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterSettings(ServiceSettings):
    """Everything the router needs to know at start-up."""

    port: int = DEFAULT_PORT
    redis_url: str = DEFAULT_REDIS_URL
    redis_prefix: str = "rg:"
    # A worker is live while its last heartbeat is younger than this.
    lease_s: float = 6.0
    # How often workers are told to heartbeat: a third of the lease, so a worker is stale only
    # after three missed beats. Each beat is a gRPC call, which an idle process pays ≈ 1-3 ms of
    # CPU for at both ends (docs/internals.md): once a second it was ≈ 3 % of a one-client
    # stack's CPU.
    heartbeat_interval_s: float = 2.0
    # A worker silent this long leaves the registry (and its per-worker metric series go):
    # workers that die without deregistering, each restart a new id, must not pile up.
    forget_after_s: float = 60.0
    affinity_ttl_s: float = AFFINITY_TTL_S
    # Upper bound on the Redis work of one RPC (less when the caller's deadline is shorter).
    redis_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s <= 0 or self.lease_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"the worker lease ({self.lease_s}s, ROLLGATE_WORKER_LEASE_S) must be longer than "
                f"the heartbeat interval ({self.heartbeat_interval_s}s, "
                "ROLLGATE_HEARTBEAT_INTERVAL_S), and both positive"
            )
        if self.forget_after_s < self.lease_s:
            raise ValueError(
                f"a silent worker is forgotten after {self.forget_after_s}s "
                "(ROLLGATE_WORKER_FORGET_AFTER_S), which must be at least its lease "
                f"({self.lease_s}s, ROLLGATE_WORKER_LEASE_S)"
            )

    @classmethod
    def load(cls, src: Sources, *, host: str | None = None, port: int | None = None) -> Self:
        """Settings from the sources (and command-line host/port)."""
        return cls(
            **common_settings(
                src, service="router", host=host, port=port, default_port=DEFAULT_PORT
            ),
            **redis_settings(src),
            lease_s=src.number("ROLLGATE_WORKER_LEASE_S", 6.0, file="router.worker_lease_s"),
            heartbeat_interval_s=src.number(
                "ROLLGATE_HEARTBEAT_INTERVAL_S", 2.0, file="router.heartbeat_interval_s"
            ),
            forget_after_s=src.number(
                "ROLLGATE_WORKER_FORGET_AFTER_S", 60.0, file="router.worker_forget_after_s"
            ),
        )
