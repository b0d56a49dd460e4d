"""Worker settings, read once in `__main__`."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from services.runtime.settings import env_float, env_str

UPSTREAM_KINDS = ("openai", "vllm")


def normalize_base_url(raw: str) -> str:
    """The upstream base URL ending in `/v1`, validated (no query string, no `/v1/v1`)."""
    url = raw.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in {"http", "https"} or not parts.netloc:
        raise ValueError(
            f"ROLLGATE_UPSTREAM_BASE_URL={raw!r} is not an http(s) URL "
            "(expected e.g. http://127.0.0.1:8000/v1)"
        )
    if parts.query or parts.fragment:
        raise ValueError(f"ROLLGATE_UPSTREAM_BASE_URL={raw!r} must not have a query string")
    if url.endswith("/v1/v1"):
        raise ValueError(f"ROLLGATE_UPSTREAM_BASE_URL={raw!r} ends in /v1/v1: drop one /v1")
    if url.endswith("/chat/completions"):
        raise ValueError(
            f"ROLLGATE_UPSTREAM_BASE_URL={raw!r} names the endpoint: give the base URL "
            "(ending in /v1) instead"
        )
    return url if url.endswith("/v1") else url + "/v1"


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSettings:
    """Everything the worker needs to know at start-up."""

    host: str = "127.0.0.1"
    port: int = 50061
    router_addr: str = "127.0.0.1:50051"
    worker_id: str = ""
    # host:port at which the dataproxy reaches this worker; empty: host and the bound port.
    advertise: str = ""
    # Always ends in /v1.
    upstream_base_url: str = ""
    # Never logged, never in repr.
    upstream_api_key: str = field(default="", repr=False)
    upstream_kind: str = "openai"
    # Empty: ask the upstream's /models at start-up.
    upstream_models: tuple[str, ...] = ()
    upstream_timeout_s: float = 600.0
    # Deadline for the start-up model listing.
    models_timeout_s: float = 5.0
    # Deadline of each call to the router.
    router_timeout_s: float = 2.0
    grace_s: float = 10.0
    log_level: str = "info"
    # None: JSON unless stderr is a terminal.
    log_json: bool | None = None

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str], *, host: str | None = None, port: int | None = None
    ) -> WorkerSettings:
        """Settings from the environment (and command-line host/port)."""
        raw_base = env_str(environ, "ROLLGATE_UPSTREAM_BASE_URL", "")
        if not raw_base:
            raise ValueError(
                "ROLLGATE_UPSTREAM_BASE_URL is not set: the worker needs the upstream LLM's "
                "OpenAI base URL (e.g. http://127.0.0.1:8000/v1; `rollgate up` sets it)"
            )
        kind = env_str(environ, "ROLLGATE_UPSTREAM_KIND", "openai").lower()
        if kind == "sglang":
            raise ValueError("ROLLGATE_UPSTREAM_KIND=sglang is not supported yet (issue 4)")
        if kind not in UPSTREAM_KINDS:
            raise ValueError(
                f"ROLLGATE_UPSTREAM_KIND={kind!r} is not one of {', '.join(UPSTREAM_KINDS)}"
            )
        models = tuple(
            m.strip() for m in env_str(environ, "ROLLGATE_UPSTREAM_MODELS", "").split(",")
        )
        log_json_raw = env_str(environ, "ROLLGATE_LOG_JSON", "auto").lower()
        return cls(
            host=host or env_str(environ, "ROLLGATE_WORKER_HOST", "127.0.0.1"),
            port=port if port is not None else 50061,
            router_addr=env_str(environ, "ROLLGATE_ROUTER_ADDR", "127.0.0.1:50051"),
            worker_id=env_str(environ, "ROLLGATE_WORKER_ID", f"worker-{uuid.uuid4().hex[:12]}"),
            advertise=env_str(environ, "ROLLGATE_WORKER_ADVERTISE", ""),
            upstream_base_url=normalize_base_url(raw_base),
            upstream_api_key=env_str(environ, "ROLLGATE_UPSTREAM_API_KEY", ""),
            upstream_kind=kind,
            upstream_models=tuple(m for m in models if m),
            upstream_timeout_s=env_float(environ, "ROLLGATE_UPSTREAM_TIMEOUT_S", 600.0),
            grace_s=env_float(environ, "ROLLGATE_GRACE_S", 10.0),
            log_level=env_str(environ, "ROLLGATE_LOG_LEVEL", "info"),
            log_json=None if log_json_raw == "auto" else log_json_raw in {"1", "true", "yes", "on"},
        )
