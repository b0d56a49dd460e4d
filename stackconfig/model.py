"""The stack's configuration as validated values: one frozen dataclass per section of the file.

Which file names what (rollgate's own sections, or AReaL's `config.yaml`) is the readers'
business (`rollgate_file.py`, `areal.py`); everything after loading sees only these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stackconfig.kinds import DEFAULT_KIND

# The model name clients may send for "whatever this stack serves by default" (AReaL's scripts).
DEFAULT_MODEL_ALIAS = "default"
SERVICES = ("gateway", "router", "dataproxy", "worker")


class ConfigError(ValueError):
    """The configuration is wrong; the message says what and how to fix it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class UpstreamConfig:
    """One upstream LLM endpoint and the workers bound to it."""

    name: str
    kind: str = DEFAULT_KIND
    # Always ends in /v1.
    base_url: str
    # The *name* of the environment variable holding the key ("" when the upstream needs none).
    api_key_var: str = ""
    # Served model ids (empty: ask the upstream's /models at start-up).
    models: tuple[str, ...] = ()
    # (alias, served id): the name an agent is configured with → the id the upstream serves.
    aliases: tuple[tuple[str, str], ...] = ()
    # A local tokenizer.json: token ids for `openai`, input_ids for sglang's `generate` path.
    tokenizer: str = ""
    # sglang only: `chat` (OpenAI endpoint) or `generate` (native /generate, exact ids).
    sglang_path: str = "chat"
    workers: int = 2
    timeout_s: float = 600.0

    def serves(self, name: str) -> bool:
        """True when `name` is one of its models or aliases."""
        return name in self.models or any(alias == name for alias, _ in self.aliases)


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingConfig:
    """Defaults applied when a client leaves them out, and group sampling."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    # G > 1: the worker asks the upstream for G samples per call; the agent gets sample 0.
    n_samples: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayConfig:
    """The HTTP gateway."""

    port: int = field(default=8080, metadata={"minimum": 0})
    max_body_bytes: int | None = None
    request_timeout_s: float | None = None
    # The HTTP edge's limits (docs/deploy.md).
    header_timeout_s: float | None = None
    body_timeout_s: float | None = None
    keepalive_timeout_s: float | None = None
    max_header_bytes: int | None = None
    max_headers: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterConfig:
    """The router."""

    address: str = "127.0.0.1:50051"
    worker_lease_s: float | None = None
    heartbeat_interval_s: float | None = None
    worker_forget_after_s: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class DataProxyConfig:
    """The dataproxy (and the Trainer service it serves)."""

    address: str = "127.0.0.1:50052"
    turn_timeout_s: float | None = None
    # Lifecycle (docs/lifecycle.md); None keeps the dataproxy's default.
    refresh_timeout_s: float | None = None
    session_idle_timeout_s: float | None = None
    pause_wait_s: float | None = None
    late_reward_timeout_s: float | None = None
    trainer_key_var: str = ""
    # Resolved from `trainer_key_var` at load time; never in repr.
    trainer_key: str = field(default="", repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutConfig:
    """Capacity settings of online RL (AReaL's names)."""

    batch_size: int | None = None
    max_head_offpolicyness: int | None = field(default=None, metadata={"minimum": 0})


@dataclass(frozen=True, slots=True, kw_only=True)
class RollgateConfig:
    """The whole stack's configuration, validated."""

    admin_key_var: str = ""
    # The admin key's value, resolved from `admin_key_var` at load time; never in repr.
    admin_key: str = field(default="", repr=False)
    redis_url: str = ""
    redis_prefix: str = ""
    log_level: str = ""
    gateway: GatewayConfig = GatewayConfig()
    router: RouterConfig = RouterConfig()
    dataproxy: DataProxyConfig = DataProxyConfig()
    upstreams: tuple[UpstreamConfig, ...] = ()
    # What `"model": "default"` means: a served id or alias; "" = the first upstream's first model.
    default_model: str = ""
    sampling: SamplingConfig = SamplingConfig()
    rollout: RolloutConfig = RolloutConfig()
    # "rollgate" or "areal": the file's flavour.
    style: str = "rollgate"
    # Dotted names of fields the file has but rollgate does not use (reported once).
    ignored: tuple[str, ...] = ()
    # Where it was read from ("" for text), the text as written (keys are `${VAR}` names,
    # never values) and the dotted overrides applied: a launcher passes them on to services.
    path: str = ""
    text: str = field(default="", repr=False)
    overrides: tuple[str, ...] = ()

    def upstream(self, name: str) -> UpstreamConfig:
        """The upstream called `name` (or with that index)."""
        for i, upstream in enumerate(self.upstreams):
            if name in (upstream.name, str(i)):
                return upstream
        names = ", ".join(u.name for u in self.upstreams) or "none"
        raise ConfigError(f"no upstream {name!r} in the configuration (upstreams: {names})")

    def default_for(self, upstream: UpstreamConfig) -> tuple[bool, str]:
        """Whether this upstream's workers serve `default`, and as which model ("" = their
        first).

        An explicit model or alias named `default` wins; else `worker.default_model` goes to
        the upstream listing it (or to each upstream that asks its /models, which registers it
        only if it serves it); without one, the first upstream's first model.
        """
        if any(u.serves(DEFAULT_MODEL_ALIAS) for u in self.upstreams):
            return False, ""
        wanted = self.default_model
        if wanted:
            if upstream.serves(wanted) or not upstream.models:
                return True, wanted
            return False, ""
        first = self.upstreams[0] if self.upstreams else upstream
        return first.name == upstream.name, ""
