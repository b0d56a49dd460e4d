"""The stack's configuration: the rollgate YAML (or an AReaL `config.yaml`), read the same way by
the `rollgate` CLI and by every service, and the one merge of file, environment and command
line each service's settings go through. Pure: imports nothing of ours (STYLE.md).

Modules by job: `model` (the validated values), `loading` (read, override, expand),
`rollgate_file` and `areal` (the two formats), `reader` (typed fields, key fields), `urls`
(base URLs), `kinds` (the upstream kinds), `sources` (file + environment + command line).
"""

from stackconfig.areal import is_areal
from stackconfig.kinds import (
    DEFAULT_KIND,
    KINDS,
    SGLANG_PATHS,
    UPSTREAM_KINDS,
    UpstreamKind,
    kinds_help,
    upstream_kind,
)
from stackconfig.loading import apply_override, check_upstream_key, expand_vars, load_config
from stackconfig.model import (
    DEFAULT_MODEL_ALIAS,
    SERVICES,
    ConfigError,
    DataProxyConfig,
    GatewayConfig,
    RollgateConfig,
    RolloutConfig,
    RouterConfig,
    SamplingConfig,
    UpstreamConfig,
)
from stackconfig.sources import (
    Sources,
    env_bool,
    env_float,
    env_int,
    env_str,
    file_values,
    pick_upstream,
    sources_for,
)
from stackconfig.urls import normalize_base_url

__all__ = [
    "DEFAULT_KIND",
    "DEFAULT_MODEL_ALIAS",
    "KINDS",
    "SERVICES",
    "SGLANG_PATHS",
    "UPSTREAM_KINDS",
    "ConfigError",
    "DataProxyConfig",
    "GatewayConfig",
    "RollgateConfig",
    "RolloutConfig",
    "RouterConfig",
    "SamplingConfig",
    "Sources",
    "UpstreamConfig",
    "UpstreamKind",
    "apply_override",
    "check_upstream_key",
    "env_bool",
    "env_float",
    "env_int",
    "env_str",
    "expand_vars",
    "file_values",
    "is_areal",
    "kinds_help",
    "load_config",
    "normalize_base_url",
    "pick_upstream",
    "sources_for",
    "upstream_kind",
]
