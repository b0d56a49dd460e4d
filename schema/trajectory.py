"""The published trajectory (schema version 2): each field once, with the key it has in the
msgpack map, its default when absent (older trajectories), how a reader takes it, and where
the writer copies it from.

A field with `turn=` is copied as it is from the stored turn record's key of that name (the
dataproxy's builder); with `proto=True` the dataproxy also stores it straight from the
worker's `TurnRecord` (or `TurnSample`) field of that name. Adding such a field is: the
worker sets it (services/worker/turn.py), `protos/common.proto` carries it, and one line
here; the dataproxy and every reader follow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from schema.packing import count, unpack_float32, unpack_int32

SCHEMA_VERSION = 2
CODEC = "msgpack"
SUPPORTED_CODECS = (CODEC,)

# How output_versions was made: per streamed chunk, the admission version (non-streaming, or
# written before the field existed), or the admission version because the streamed chunks'
# token counts did not add up.
VERSIONS_FROM_CHUNKS = "chunks"
VERSIONS_AT_ADMISSION = "admission"
VERSIONS_UNCOUNTED = "admission_uncounted"
# "main", or "side" (X-Turn-Type: heartbeats, memory flushes; recorded, not trained on).
MAIN_TURN = "main"


class TrajectoryDecodeError(ValueError):
    """The bytes are not a trajectory this library can read."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Spec:
    """How one field travels."""

    # Its key in the published map.
    key: str
    # The value from what the map holds (never called with None: that is the default).
    read: Callable[[Any], Any]
    default: Any
    # An empty value ("", 0, b"", []) also means the default.
    empty_is_default: bool = False
    # The stored turn record's key the builder copies it from (None: the builder computes it).
    turn: str | None = None
    # The dataproxy stores the worker's TurnRecord / TurnSample field of the same name as is.
    proto: bool = False

    def value(self, raw: Mapping[str, Any], key: str | None = None) -> Any:
        """The field's value in `raw` (under `key`, else its own key)."""
        value = raw.get(self.key if key is None else key)
        if value is None or (self.empty_is_default and not value):
            return self.default
        return self.read(value)


def _spec(read: Callable[[Any], Any], *, key: str = "", **spec: Any) -> dict[str, Any]:
    """A field's metadata; `key` "" is the field's own name (see `specs`)."""
    return {"spec": {"read": read, "key": key, **spec}}


def _as_is(value: Any) -> Any:
    return value


def _int_list(value: Any) -> list[int]:
    return [int(v) for v in value]


def _int_map(value: Any) -> dict[str, int]:
    return {str(k): int(n) for k, n in value.items()}


class _OutputArrays:
    """The packed output arrays of a sample, unpacked on access."""

    __slots__ = ()
    output_token_ids_bytes: bytes
    output_logprobs_bytes: bytes
    output_versions_bytes: bytes

    @property
    def output_token_ids(self) -> list[int]:
        """The sampled output token ids."""
        return _ints(self.output_token_ids_bytes)

    @property
    def output_logprobs(self) -> list[float]:
        """One logprob per sampled output token (float32 precision)."""
        try:
            return unpack_float32(self.output_logprobs_bytes)
        except ValueError as err:
            raise TrajectoryDecodeError(str(err)) from None

    @property
    def output_versions(self) -> list[int]:
        """The weight version that produced each output token."""
        return _ints(self.output_versions_bytes)


def _ints(data: bytes) -> list[int]:
    try:
        return unpack_int32(data)
    except ValueError as err:
        raise TrajectoryDecodeError(str(err)) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample(_OutputArrays):
    """Another sample of a group-sampled call (G > 1): same prompt, its own output."""

    # 1..G-1 (sample 0 is the interaction itself, the one the agent received).
    sample_index: int = field(default=0, metadata=_spec(int))
    output: dict[str, Any] = field(
        default_factory=dict, metadata=_spec(dict, empty_is_default=True)
    )
    finish_reason: str = field(default="", metadata=_spec(str, turn="finish_reason", proto=True))
    output_token_ids_bytes: bytes = field(
        default=b"",
        metadata=_spec(
            bytes,
            key="output_token_ids",
            empty_is_default=True,
            turn="output_token_ids",
            proto=True,
        ),
    )
    output_logprobs_bytes: bytes = field(
        default=b"",
        metadata=_spec(
            bytes, key="output_logprobs", empty_is_default=True, turn="output_logprobs", proto=True
        ),
    )
    output_versions_bytes: bytes = field(
        default=b"", metadata=_spec(bytes, key="output_versions", empty_is_default=True)
    )
    exact_tokens: bool = field(default=False, metadata=_spec(bool, turn="exact_tokens", proto=True))
    length_mismatch: bool = field(
        default=False, metadata=_spec(bool, turn="length_mismatch", proto=True)
    )
    # The interaction's reward (the whole group shares it).
    reward: float = field(default=0.0, metadata=_spec(float))
    reward_set: bool = field(default=False, metadata=_spec(bool))


@dataclass(frozen=True, slots=True, kw_only=True)
class Interaction(_OutputArrays):
    """One LLM call of a trajectory, with its packed token arrays kept as bytes."""

    interaction_id: str = field(default="", metadata=_spec(str, turn="interaction_id", proto=True))
    index: int = field(default=0, metadata=_spec(int))
    parent: int | None = field(default=None, metadata=_spec(int))
    created_at: float = field(default=0.0, metadata=_spec(float, turn="created_at"))
    latency_s: float = field(default=0.0, metadata=_spec(float, turn="latency_s", proto=True))
    ttft_s: float = field(default=0.0, metadata=_spec(float, turn="ttft_s", proto=True))
    model: str = field(default="", metadata=_spec(str, turn="upstream_model", proto=True))
    upstream_kind: str = field(default="", metadata=_spec(str, turn="upstream_kind", proto=True))
    messages: list[Any] = field(default_factory=list, metadata=_spec(list, empty_is_default=True))
    tools: list[Any] | None = field(default=None, metadata=_spec(_as_is))
    output: dict[str, Any] = field(
        default_factory=dict, metadata=_spec(dict, empty_is_default=True)
    )
    finish_reason: str = field(default="", metadata=_spec(str, turn="finish_reason", proto=True))
    usage: dict[str, Any] = field(default_factory=dict, metadata=_spec(dict, empty_is_default=True))
    prompt_token_ids_bytes: bytes = field(
        default=b"", metadata=_spec(bytes, key="prompt_token_ids", empty_is_default=True)
    )
    output_token_ids_bytes: bytes = field(
        default=b"",
        metadata=_spec(
            bytes,
            key="output_token_ids",
            empty_is_default=True,
            turn="output_token_ids",
            proto=True,
        ),
    )
    output_logprobs_bytes: bytes = field(
        default=b"",
        metadata=_spec(
            bytes, key="output_logprobs", empty_is_default=True, turn="output_logprobs", proto=True
        ),
    )
    output_versions_bytes: bytes = field(
        default=b"", metadata=_spec(bytes, key="output_versions", empty_is_default=True)
    )
    exact_tokens: bool = field(default=False, metadata=_spec(bool, turn="exact_tokens", proto=True))
    length_mismatch: bool = field(
        default=False, metadata=_spec(bool, turn="length_mismatch", proto=True)
    )
    reward: float = field(default=0.0, metadata=_spec(float))
    reward_set: bool = field(default=False, metadata=_spec(bool))
    # The weight version when the turn finished (differs only if weights changed unpaused).
    weight_version_end: int = field(default=0, metadata=_spec(int, empty_is_default=True))
    # "main", or "side" (X-Turn-Type: heartbeats, memory flushes); to_tensors leaves side out.
    turn_type: str = field(
        default=MAIN_TURN, metadata=_spec(str, empty_is_default=True, turn="turn_type")
    )
    # How output_versions was made: "chunks" (per streamed chunk), "admission" (non-streaming,
    # or written before the field existed) or "admission_uncounted" (chunk counts did not add up).
    output_versions_source: str = field(
        default=VERSIONS_AT_ADMISSION, metadata=_spec(str, empty_is_default=True)
    )
    # Group sampling (G > 1): samples 1..G-1 of this call; empty when G = 1.
    samples: tuple[Sample, ...] = field(default=(), metadata=_spec(tuple, empty_is_default=True))

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt's token ids as the model saw them."""
        return _ints(self.prompt_token_ids_bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class Trajectory:
    """One published episode: its identity, timing, rewards and interactions in order."""

    schema_version: int = field(default=0, metadata=_spec(int))
    trajectory_id: str = field(default="", metadata=_spec(str))
    session_id: str = field(default="", metadata=_spec(str))
    task_id: str = field(default="", metadata=_spec(str))
    key_id: str = field(default="", metadata=_spec(str))
    episode: str = field(default="", metadata=_spec(str))
    group_id: str | None = field(default=None, metadata=_spec(_as_is))
    # Episodes in the group; None without a group.
    group_size: int | None = field(default=None, metadata=_spec(int))
    started_at: float = field(default=0.0, metadata=_spec(float))
    ended_at: float = field(default=0.0, metadata=_spec(float))
    end_reason: str = field(default="", metadata=_spec(str))
    final_reward: float = field(default=0.0, metadata=_spec(float))
    weight_versions: list[int] = field(default_factory=list, metadata=_spec(_int_list))
    stats: dict[str, int] = field(
        default_factory=dict, metadata=_spec(_int_map, empty_is_default=True)
    )
    interactions: tuple[Interaction, ...] = field(default=(), metadata=_spec(tuple))

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens over all interactions."""
        return sum(count(i.prompt_token_ids_bytes) for i in self.interactions)

    @property
    def output_tokens(self) -> int:
        """Sampled output tokens over all interactions."""
        return sum(count(i.output_token_ids_bytes) for i in self.interactions)


def specs(view: type[Any]) -> dict[str, Spec]:
    """Attribute name → Spec of every field of `Sample`, `Interaction` or `Trajectory`."""
    out: dict[str, Spec] = {}
    for f in dataclasses.fields(view):
        spec = dict(f.metadata["spec"])
        spec["key"] = spec["key"] or f.name
        factory: Any = f.default_factory
        default = f.default if f.default is not dataclasses.MISSING else factory()
        out[f.name] = Spec(default=default, **spec)
    return out


SAMPLE_SPECS = specs(Sample)
INTERACTION_SPECS = specs(Interaction)
TRAJECTORY_SPECS = specs(Trajectory)

# The TurnRecord (and TurnSample) fields the dataproxy stores as they come from the worker.
TURN_RECORD_FIELDS = tuple(s.turn for s in INTERACTION_SPECS.values() if s.proto and s.turn)
TURN_SAMPLE_FIELDS = tuple(s.turn for s in SAMPLE_SPECS.values() if s.proto and s.turn)


def copied_from_turn(view_specs: Mapping[str, Spec], record: Mapping[str, Any]) -> dict[str, Any]:
    """Published key → value of every field the builder copies from a stored turn record."""
    return {
        spec.key: spec.value(record, spec.turn)
        for spec in view_specs.values()
        if spec.turn is not None
    }


def read_fields(view_specs: Mapping[str, Spec], raw: Mapping[str, Any]) -> dict[str, Any]:
    """Attribute → value of every field, read from a published map."""
    return {name: spec.value(raw) for name, spec in view_specs.items()}
