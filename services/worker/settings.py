"""Worker settings, read once in `__main__`."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Self

from services.runtime.secret import NO_SECRET, Secret
from services.runtime.settings import (
    ServiceSettings,
    Sources,
    common_settings,
    env_str,
    framed_port,
)
from stackconfig import DEFAULT_KIND, SGLANG_PATHS, UPSTREAM_KINDS
from stackconfig import normalize_base_url as config_base_url

DEFAULT_KEY_VAR = "ROLLGATE_UPSTREAM_API_KEY"
DEFAULT_PORT = 50061


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


def _model_list(raw: str) -> tuple[str, ...]:
    return tuple(m for m in (m.strip() for m in raw.split(",")) if m)


def _optional_int(src: Sources, name: str, file: str) -> int | None:
    where, given = src.pick(name, file)
    if not where:
        return None
    value = src.integer(name, 0, file=file)
    if value <= 0:
        raise ValueError(f"{name}={given!r} must be a positive integer")
    return value


def _optional_float(src: Sources, name: str, file: str) -> float | None:
    where, given = src.pick(name, file)
    if not where:
        return None
    value = src.number(name, 0.0, file=file)
    if value < 0:
        raise ValueError(f"{name}={given!r} must be ≥ 0")
    return value


def _api_key(src: Sources) -> tuple[str, str]:
    """(variable name, key): the variable ROLLGATE_UPSTREAM_API_KEY_VAR (or the file's
    `api_key: ${VAR}`) names, else the default."""
    var = src.text("ROLLGATE_UPSTREAM_API_KEY_VAR", DEFAULT_KEY_VAR, file="upstream.api_key_var")
    key = env_str(src.environ, var, "")
    if var != DEFAULT_KEY_VAR and not key:
        raise ValueError(
            f"the upstream key variable {var} (named by the configuration) is not set: "
            f"export {var}=… in the worker's environment"
        )
    return var, key


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSettings(ServiceSettings):
    """Everything the worker needs to know at start-up."""

    port: int = DEFAULT_PORT
    # Where Turns is also served framed (0: any free port; None: not at all).
    framed_port: int | None = 0
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

    @classmethod
    def load(cls, src: Sources, *, host: str | None = None, port: int | None = None) -> Self:
        """Settings from the sources (and command-line host/port)."""
        raw_base = src.text("ROLLGATE_UPSTREAM_BASE_URL", file="upstream.base_url")
        if not raw_base:
            raise ValueError(
                "ROLLGATE_UPSTREAM_BASE_URL is not set: the worker needs the upstream LLM's "
                "OpenAI base URL (e.g. http://127.0.0.1:8000/v1; `rollgate up` sets it)"
            )
        kind = src.text("ROLLGATE_UPSTREAM_KIND", DEFAULT_KIND, file="upstream.kind").lower()
        if kind not in UPSTREAM_KINDS:
            raise ValueError(
                f"ROLLGATE_UPSTREAM_KIND={kind!r} is not one of {', '.join(UPSTREAM_KINDS)}"
            )
        key_var, key = _api_key(src)
        sglang_path = src.text("ROLLGATE_SGLANG_PATH", "chat", file="upstream.sglang_path")
        sglang_path = sglang_path.lower()
        if sglang_path not in SGLANG_PATHS:
            raise ValueError(f"ROLLGATE_SGLANG_PATH={sglang_path!r} is not `chat` or `generate`")
        tokenizer = src.text("ROLLGATE_UPSTREAM_TOKENIZER", file="upstream.tokenizer")
        if kind == "sglang" and sglang_path == "generate" and not tokenizer:
            raise ValueError(
                "ROLLGATE_SGLANG_PATH=generate needs ROLLGATE_UPSTREAM_TOKENIZER (the path of "
                "the model's tokenizer.json): the worker sends input_ids"
            )
        return cls(
            **common_settings(
                src, service="worker", host=host, port=port, default_port=DEFAULT_PORT
            ),
            framed_port=framed_port(src, "worker"),
            router_addr=src.text("ROLLGATE_ROUTER_ADDR", "127.0.0.1:50051", file="router.address"),
            worker_id=src.text("ROLLGATE_WORKER_ID", f"worker-{uuid.uuid4().hex[:12]}"),
            advertise=src.text("ROLLGATE_WORKER_ADVERTISE"),
            upstream_base_url=normalize_base_url(raw_base),
            upstream_api_key=Secret(key),
            upstream_api_key_var=key_var,
            upstream_kind=kind,
            upstream_name=src.text("ROLLGATE_UPSTREAM_NAME", file="upstream.name"),
            upstream_aliases=src.get(
                "ROLLGATE_UPSTREAM_ALIASES", (), parse=parse_aliases, file="upstream.aliases"
            ),
            serve_default_model=src.flag(
                "ROLLGATE_SERVE_DEFAULT_MODEL", True, file="upstream.serves_default"
            ),
            default_model=src.text("ROLLGATE_DEFAULT_MODEL", file="upstream.default_model"),
            tokenizer_path=tokenizer,
            sglang_path=sglang_path,
            default_max_tokens=_optional_int(
                src, "ROLLGATE_DEFAULT_MAX_TOKENS", "worker.sampling.max_new_tokens"
            ),
            default_temperature=_optional_float(
                src, "ROLLGATE_DEFAULT_TEMPERATURE", "worker.sampling.temperature"
            ),
            n_samples=_optional_int(src, "ROLLGATE_N_SAMPLES", "worker.sampling.n_samples") or 1,
            upstream_models=src.get(
                "ROLLGATE_UPSTREAM_MODELS", (), parse=_model_list, file="upstream.models"
            ),
            upstream_timeout_s=src.number(
                "ROLLGATE_UPSTREAM_TIMEOUT_S", 600.0, file="upstream.timeout_s"
            ),
        )
