"""Worker settings, read once in `__main__`."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from services.runtime.metrics import NO_METRICS_PORT, MetricsEndpoint, metrics_endpoint
from services.runtime.secret import NO_SECRET, Secret
from services.runtime.settings import env_bool, env_float, env_int, env_str
from services.runtime.tracing import NO_TRACING, TracingSettings, tracing_settings
from stackconfig import DEFAULT_KIND, SGLANG_PATHS, UPSTREAM_KINDS
from stackconfig import normalize_base_url as config_base_url

DEFAULT_KEY_VAR = "ROLLGATE_UPSTREAM_API_KEY"


def normalize_base_url(raw: str) -> str:
    """The upstream base URL ending in `/v1`, validated (no query string, no `/v1/v1`)."""
    return config_base_url(raw, where="ROLLGATE_UPSTREAM_BASE_URL")


def parse_aliases(raw: str) -> tuple[tuple[str, str], ...]:
    """`alias=served,alias2=served2` as pairs; ValueError naming the bad entry."""
    pairs: list[tuple[str, str]] = []
    for entry in (e.strip() for e in raw.split(",")):
        if not entry:
            continue
        alias, sep, served = (p.strip() for p in entry.partition("="))
        if not sep or not alias or not served:
            raise ValueError(
                f"ROLLGATE_UPSTREAM_ALIASES entry {entry!r} is not alias=served-model-id"
            )
        pairs.append((alias, served))
    return tuple(pairs)


def _optional_int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    value = env_int(environ, name, 0)
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be a positive integer")
    return value


def _optional_float(environ: Mapping[str, str], name: str) -> float | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    value = env_float(environ, name, 0.0)
    if value < 0:
        raise ValueError(f"{name}={raw!r} must be ≥ 0")
    return value


def _api_key(environ: Mapping[str, str]) -> tuple[str, str]:
    """(variable name, key): the variable ROLLGATE_UPSTREAM_API_KEY_VAR names, else the default."""
    var = env_str(environ, "ROLLGATE_UPSTREAM_API_KEY_VAR", DEFAULT_KEY_VAR)
    key = env_str(environ, var, "")
    if var != DEFAULT_KEY_VAR and not key:
        raise ValueError(
            f"the upstream key variable {var} (named by the configuration) is not set: "
            f"export {var}=… in the worker's environment"
        )
    return var, key


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
    # Masked wherever it is held; revealed only in the upstream request header.
    upstream_api_key: Secret = NO_SECRET
    # The environment variable the key came from: named in "check <VAR>" error messages.
    upstream_api_key_var: str = DEFAULT_KEY_VAR
    upstream_kind: str = DEFAULT_KIND
    # The upstream's name in the configuration (logs only).
    upstream_name: str = ""
    # (alias, served id): registered with the router as models, rewritten before forwarding.
    upstream_aliases: tuple[tuple[str, str], ...] = ()
    # Serve the model name `default` as an alias (AReaL's scripts send it) of `default_model`,
    # "" = the first served model. Off for the other upstreams of a multi-upstream file.
    serve_default_model: bool = True
    default_model: str = ""
    # A local tokenizer.json (openai: ids for the record; sglang generate: input_ids).
    tokenizer_path: str = ""
    # sglang: "chat" (OpenAI endpoint) or "generate" (native /generate with input_ids).
    sglang_path: str = "chat"
    # Applied when the client leaves `max_tokens`/`max_completion_tokens` or `temperature` out.
    default_max_tokens: int | None = None
    default_temperature: float | None = None
    # G > 1: G samples per call upstream; the client gets sample 0, all G are recorded.
    n_samples: int = 1
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
    # Where GET /metrics is served (port None: nowhere); docs/metrics.md.
    metrics: MetricsEndpoint = NO_METRICS_PORT
    # Spans over OTLP/HTTP when an endpoint is set (off by default); docs/metrics.md, Traces.
    tracing: TracingSettings = NO_TRACING

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
        kind = env_str(environ, "ROLLGATE_UPSTREAM_KIND", DEFAULT_KIND).lower()
        if kind not in UPSTREAM_KINDS:
            raise ValueError(
                f"ROLLGATE_UPSTREAM_KIND={kind!r} is not one of {', '.join(UPSTREAM_KINDS)}"
            )
        models = tuple(
            m.strip() for m in env_str(environ, "ROLLGATE_UPSTREAM_MODELS", "").split(",")
        )
        log_json_raw = env_str(environ, "ROLLGATE_LOG_JSON", "auto").lower()
        key_var, key = _api_key(environ)
        sglang_path = env_str(environ, "ROLLGATE_SGLANG_PATH", "chat").lower()
        if sglang_path not in SGLANG_PATHS:
            raise ValueError(f"ROLLGATE_SGLANG_PATH={sglang_path!r} is not `chat` or `generate`")
        tokenizer = env_str(environ, "ROLLGATE_UPSTREAM_TOKENIZER", "")
        if kind == "sglang" and sglang_path == "generate" and not tokenizer:
            raise ValueError(
                "ROLLGATE_SGLANG_PATH=generate needs ROLLGATE_UPSTREAM_TOKENIZER (the path of "
                "the model's tokenizer.json): the worker sends input_ids"
            )
        n_samples = _optional_int(environ, "ROLLGATE_N_SAMPLES") or 1
        bind_host = host or env_str(environ, "ROLLGATE_WORKER_HOST", "127.0.0.1")
        return cls(
            host=bind_host,
            metrics=metrics_endpoint(environ, service="worker", host=bind_host),
            tracing=tracing_settings(environ),
            port=port if port is not None else 50061,
            router_addr=env_str(environ, "ROLLGATE_ROUTER_ADDR", "127.0.0.1:50051"),
            worker_id=env_str(environ, "ROLLGATE_WORKER_ID", f"worker-{uuid.uuid4().hex[:12]}"),
            advertise=env_str(environ, "ROLLGATE_WORKER_ADVERTISE", ""),
            upstream_base_url=normalize_base_url(raw_base),
            upstream_api_key=Secret(key),
            upstream_api_key_var=key_var,
            upstream_kind=kind,
            upstream_name=env_str(environ, "ROLLGATE_UPSTREAM_NAME", ""),
            upstream_aliases=parse_aliases(env_str(environ, "ROLLGATE_UPSTREAM_ALIASES", "")),
            serve_default_model=env_bool(environ, "ROLLGATE_SERVE_DEFAULT_MODEL", True),
            default_model=env_str(environ, "ROLLGATE_DEFAULT_MODEL", ""),
            tokenizer_path=tokenizer,
            sglang_path=sglang_path,
            default_max_tokens=_optional_int(environ, "ROLLGATE_DEFAULT_MAX_TOKENS"),
            default_temperature=_optional_float(environ, "ROLLGATE_DEFAULT_TEMPERATURE"),
            n_samples=n_samples,
            upstream_models=tuple(m for m in models if m),
            upstream_timeout_s=env_float(environ, "ROLLGATE_UPSTREAM_TIMEOUT_S", 600.0),
            grace_s=env_float(environ, "ROLLGATE_GRACE_S", 10.0),
            log_level=env_str(environ, "ROLLGATE_LOG_LEVEL", "info"),
            log_json=None if log_json_raw == "auto" else log_json_raw in {"1", "true", "yes", "on"},
        )
