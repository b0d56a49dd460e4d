"""Dataproxy settings, read once in `__main__`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from services.runtime.secret import Keys
from services.runtime.settings import (
    DEFAULT_REDIS_URL,
    ServiceSettings,
    Sources,
    common_settings,
    framed_port,
    redis_settings,
)

DEFAULT_PORT = 50052
NO_KEYS = Keys()


@dataclass(frozen=True, slots=True, kw_only=True)
class DataProxySettings(ServiceSettings):
    """Everything the dataproxy needs to know at start-up."""

    port: int = DEFAULT_PORT
    # Where Ledger is also served framed (0: any free port; None: not at all).
    framed_port: int | None = 0
    redis_url: str = DEFAULT_REDIS_URL
    redis_prefix: str = "rg:"
    # Verifies the Trainer service's callers; required. Several keys (comma-separated in
    # the setting) are all accepted; the first is the current one.
    admin_key: Keys = NO_KEYS
    # More keys that may call the Trainer service (optional; comma-separated, all accepted).
    trainer_key: Keys = NO_KEYS
    # Deadline for one turn at the worker, streaming included.
    turn_timeout_s: float = 600.0
    # How long a start or refresh waits for capacity before 429 (the key stays valid).
    refresh_timeout_s: float = 120.0
    # Staleness bound (AReaL): open + published episodes ≤ (this + weight version + 1) x
    # batch_size. None: no bound (capacity unlimited unless GrantCapacity is called).
    max_head_offpolicyness: int | None = None
    batch_size: int = 1
    # How long a new turn waits while submission is paused before 503.
    pause_wait_s: float = 30.0
    # PauseSubmission waits this long for running turns when the call names no timeout.
    pause_drain_timeout_s: float = 60.0
    # An active episode without activity for this long is ended by the reaper ("idle").
    session_idle_timeout_s: float = 3600.0
    # > 0: an ended episode whose last interaction has no reward waits this long for one.
    late_reward_timeout_s: float = 0.0
    # How often each replica's reaper looks for due episodes.
    reaper_interval_s: float = 1.0

    def __post_init__(self) -> None:
        # One Secret (as tests and embedders pass it) is one key.
        object.__setattr__(self, "admin_key", Keys.of(self.admin_key))
        object.__setattr__(self, "trainer_key", Keys.of(self.trainer_key))

    @property
    def refresh_lock_s(self) -> float:
        """How long a refresh marker lives if its holder dies mid-refresh."""
        return self.refresh_timeout_s + 10.0

    @classmethod
    def load(cls, src: Sources, *, host: str | None = None, port: int | None = None) -> Self:
        """Settings from the sources (and command-line host/port)."""
        admin_key = Keys.parse(
            src.text("ROLLGATE_ADMIN_KEY", file="admin_key"),
            "ROLLGATE_ADMIN_KEY (admin_key in the file)",
        )
        if not admin_key:
            raise ValueError(
                "ROLLGATE_ADMIN_KEY is not set: the dataproxy needs the admin key to "
                "authenticate Trainer calls (rollgate up sets it for you)"
            )
        ofp_name = "ROLLGATE_MAX_HEAD_OFFPOLICYNESS"
        ofp_file = "rollout.max_head_offpolicyness"
        max_head_offpolicyness = (
            src.integer(ofp_name, 0, file=ofp_file) if src.is_set(ofp_name, file=ofp_file) else None
        )
        batch_size = src.integer("ROLLGATE_BATCH_SIZE", 1, file="rollout.batch_size")
        if max_head_offpolicyness is not None and max_head_offpolicyness < 0:
            raise ValueError("ROLLGATE_MAX_HEAD_OFFPOLICYNESS must be 0 or more")
        if batch_size < 1:
            raise ValueError(f"ROLLGATE_BATCH_SIZE={batch_size} must be at least 1")

        return cls(
            **common_settings(
                src, service="dataproxy", host=host, port=port, default_port=DEFAULT_PORT
            ),
            **redis_settings(src),
            framed_port=framed_port(src, "dataproxy"),
            admin_key=admin_key,
            trainer_key=Keys.parse(
                src.text("ROLLGATE_TRAINER_KEY", file="dataproxy.trainer_key"),
                "ROLLGATE_TRAINER_KEY (dataproxy.trainer_key in the file)",
            ),
            turn_timeout_s=src.number(
                "ROLLGATE_TURN_TIMEOUT_S", 600.0, file="dataproxy.turn_timeout_s"
            ),
            refresh_timeout_s=src.positive(
                "ROLLGATE_REFRESH_TIMEOUT_S", 120.0, file="dataproxy.refresh_timeout_s"
            ),
            max_head_offpolicyness=max_head_offpolicyness,
            batch_size=batch_size,
            pause_wait_s=src.number("ROLLGATE_PAUSE_WAIT_S", 30.0, file="dataproxy.pause_wait_s"),
            pause_drain_timeout_s=src.positive("ROLLGATE_PAUSE_DRAIN_TIMEOUT_S", 60.0),
            session_idle_timeout_s=src.positive(
                "ROLLGATE_SESSION_IDLE_TIMEOUT_S", 3600.0, file="dataproxy.session_idle_timeout_s"
            ),
            late_reward_timeout_s=src.number(
                "ROLLGATE_LATE_REWARD_TIMEOUT_S", 0.0, file="dataproxy.late_reward_timeout_s"
            ),
            reaper_interval_s=src.positive("ROLLGATE_REAPER_INTERVAL_S", 1.0),
        )
