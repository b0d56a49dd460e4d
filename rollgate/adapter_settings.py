r"""Where a trainer adapter finds rollgate: arguments, the environment, a `rollgate:` YAML section.

Precedence, highest first: arguments given in code; `ROLLGATE_*` variables; the `rollgate:`
section of the trainer's YAML (AReaL's config file); `rollgate up`'s stack.json (the Trainer
address); defaults. A key in the YAML must be `${VAR}` (a literal key is refused, as in every
rollgate file), written `\${VAR}` in an AReaL file so that AReaL's OmegaConf keeps it as it is;
the key itself comes from that variable.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rollgate.keys import current_key
from rollgate.trajectories_cli import stack_file

DEFAULT_TRAINER_ADDR = "127.0.0.1:50052"
_VAR = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")
_ANY_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
# The `rollgate:` section's fields (values may use ${VAR}); admin_key must be exactly ${VAR}.
SECTION_FIELDS = frozenset(
    {
        "trainer_address",
        "admin_key",
        "group",
        "consumer",
        "episode_group_size",
        "include_side_turns",
        "include_history",
        "replay",
        "dump",
    }
)
# Environment variables, by field.
ENV_NAMES = {
    "trainer_address": "ROLLGATE_TRAINER_ADDR",
    "group": "ROLLGATE_TRAINER_GROUP",
    "consumer": "ROLLGATE_TRAINER_CONSUMER",
    "include_history": "ROLLGATE_INCLUDE_HISTORY",
    "replay": "ROLLGATE_REPLAY",
    "dump": "ROLLGATE_DUMP",
}


class AdapterConfigError(ValueError):
    """The adapter's configuration is wrong; the message says what to change."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterSettings:
    """Where the Trainer service is, with which key, as which consumer, and what to read."""

    trainer_address: str
    admin_key: str = field(repr=False)
    group: str
    consumer: str
    episode_group_size: int = 1
    include_side_turns: bool = False
    # A consumer group created by this adapter starts at the beginning of the stream (every
    # episode still in it, earlier runs' too) instead of from now on.
    include_history: bool = False
    # An export file to replay instead of the live stream.
    replay: str | None = None
    # A file to append every episode handed to the trainer to, as export lines.
    dump: str | None = None
    # What the trainer's own config says (AReaL: rollout.agent.export_style / turn_discount).
    style: str = "individual"
    discount: float = 1.0


def resolve(
    *,
    default_group: str,
    config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    **given: Any,
) -> AdapterSettings:
    """The settings from `given` (None: not given), the environment, `config` and defaults."""
    env = os.environ if environ is None else environ
    raw = _load(config)
    section = raw.get("rollgate") or {}
    if not isinstance(section, Mapping):
        raise AdapterConfigError("the `rollgate:` section must be a mapping (key: value lines)")
    unknown = sorted(set(section) - SECTION_FIELDS)
    if unknown:
        raise AdapterConfigError(
            f"rollgate.{unknown[0]} is not a setting of the trainer adapters; "
            f"known: {', '.join(sorted(SECTION_FIELDS))}"
        )
    agent = _agent_section(raw)
    values: dict[str, Any] = {}
    for name in SECTION_FIELDS - {"admin_key"}:
        if given.get(name) is not None:
            values[name] = given[name]
        elif name in ENV_NAMES and env.get(ENV_NAMES[name]):
            values[name] = env[ENV_NAMES[name]]
        elif section.get(name) is not None:
            values[name] = _expand(section[name], env, f"rollgate.{name}")
    admin_key = given.get("admin_key") or _admin_key(section, env)
    if not admin_key:
        raise AdapterConfigError(
            "no rollgate admin key: set ROLLGATE_ADMIN_KEY (or ROLLGATE_TRAINER_KEY), "
            "or write `rollgate: {admin_key: ${ROLLGATE_ADMIN_KEY}}` in the trainer's YAML"
        )
    style = given.get("style") or agent.get("export_style") or "individual"
    if style not in ("individual", "concat"):
        raise AdapterConfigError(f"style must be 'individual' or 'concat', not {style!r}")
    discount = given.get("discount")
    if discount is None:
        discount = agent.get("turn_discount", 1.0)
    return AdapterSettings(
        trainer_address=str(values.get("trainer_address") or _stack_address(env)),
        admin_key=str(admin_key),
        group=str(values.get("group") or default_group),
        consumer=str(values.get("consumer") or default_consumer(env)),
        episode_group_size=_positive_int(values.get("episode_group_size", 1)),
        include_side_turns=_bool(values.get("include_side_turns", False), "include_side_turns"),
        include_history=_bool(values.get("include_history", False), "include_history"),
        replay=str(values["replay"]) if values.get("replay") else None,
        dump=str(values["dump"]) if values.get("dump") else None,
        style=str(style),
        discount=float(discount),
    )


def default_consumer(environ: Mapping[str, str]) -> str:
    """`<host>-<RANK>` when RANK is set (torchrun, AReaL and slime set it): one name per rank,
    the same after a restart, so a restarted rank gets its unacked episodes back at once.
    Without RANK, `<host>-pid<pid>`: unique per process, so two trainers on one host never
    read each other's pending entries (a restarted one gets them back from the reclaim)."""
    rank = environ.get("RANK")
    if rank:
        return f"{socket.gethostname()}-{rank}"
    return f"{socket.gethostname()}-pid{os.getpid()}"


def _load(config: str | os.PathLike[str] | Mapping[str, Any] | None) -> Mapping[str, Any]:
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return config
    try:
        loaded = yaml.safe_load(Path(config).read_text())
    except OSError as err:
        raise AdapterConfigError(f"cannot read {config}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise AdapterConfigError(f"{config} is not YAML: {err}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, Mapping):
        raise AdapterConfigError(f"{config} must be a mapping at the top level")
    return loaded


def _agent_section(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    rollout = raw.get("rollout")
    agent = rollout.get("agent") if isinstance(rollout, Mapping) else None
    return agent if isinstance(agent, Mapping) else {}


def _admin_key(section: Mapping[str, Any], env: Mapping[str, str]) -> str:
    raw = section.get("admin_key")
    if raw is not None and raw != "":
        match = _VAR.match(_unescaped(raw).strip()) if isinstance(raw, str) else None
        if match is None:
            raise AdapterConfigError(
                "rollgate.admin_key holds a literal key. Keys never live in configuration "
                "files (they end up in git, in logs and in bug reports): put the key in an "
                "environment variable and write rollgate.admin_key: ${ROLLGATE_ADMIN_KEY}"
            )
        name = match.group(1)
        if not env.get(name):
            raise AdapterConfigError(
                f"rollgate.admin_key is ${{{name}}} but {name} is not set: export {name}=…"
            )
        return current_key(env[name])
    return current_key(env.get("ROLLGATE_ADMIN_KEY") or env.get("ROLLGATE_TRAINER_KEY") or "")


def _unescaped(value: str) -> str:
    """`\\${VAR}` is how an AReaL file (OmegaConf resolves `${…}` itself) keeps `${VAR}`."""
    return value.replace("\\${", "${")


def _expand(value: Any, env: Mapping[str, str], where: str) -> Any:
    if not isinstance(value, str):
        return value
    value = _unescaped(value)

    def one(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if env.get(name):
            return env[name]
        if default is not None:
            return default
        raise AdapterConfigError(f"{where} uses ${{{name}}} but {name} is not set")

    return _ANY_VAR.sub(one, value)


def _stack_address(env: Mapping[str, str]) -> str:
    try:
        state = json.loads(stack_file(env).read_text())
    except (OSError, ValueError):
        return DEFAULT_TRAINER_ADDR
    address = state.get("trainer_address") if isinstance(state, dict) else None
    return str(address) if address else DEFAULT_TRAINER_ADDR


def _positive_int(value: Any) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise AdapterConfigError(f"episode_group_size must be an integer, not {value!r}") from None
    if number < 1:
        raise AdapterConfigError(f"episode_group_size must be at least 1, not {number}")
    return number


def _bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise AdapterConfigError(f"{name} must be true or false, not {value!r}")
