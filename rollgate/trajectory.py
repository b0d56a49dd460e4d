"""Decoding published trajectories into typed, read-only views (docs/trajectory-schema.md)."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]

# The only constants shared with the writer; the schema doc is the single source.
SUPPORTED_CODECS = ("msgpack",)
SCHEMA_VERSION = 2


class TrajectoryDecodeError(ValueError):
    """The bytes are not a trajectory this library can read."""


class _OutputArrays:
    """The packed output arrays of a sample, unpacked on access."""

    __slots__ = ()
    output_token_ids_bytes: bytes
    output_logprobs_bytes: bytes
    output_versions_bytes: bytes

    @property
    def output_token_ids(self) -> list[int]:
        """The sampled output token ids."""
        return _unpack("i", self.output_token_ids_bytes)

    @property
    def output_logprobs(self) -> list[float]:
        """One logprob per sampled output token (float32 precision)."""
        return _unpack_float(self.output_logprobs_bytes)

    @property
    def output_versions(self) -> list[int]:
        """The weight version that produced each output token."""
        return _unpack("i", self.output_versions_bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample(_OutputArrays):
    """Another sample of a group-sampled call (G > 1): same prompt, its own output."""

    # 1..G-1 (sample 0 is the interaction itself, the one the agent received).
    sample_index: int
    output: dict[str, Any]
    finish_reason: str
    output_token_ids_bytes: bytes
    output_logprobs_bytes: bytes
    output_versions_bytes: bytes
    exact_tokens: bool
    length_mismatch: bool
    # The interaction's reward (the whole group shares it).
    reward: float
    reward_set: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Interaction(_OutputArrays):
    """One LLM call of a trajectory, with its packed token arrays kept as bytes."""

    interaction_id: str
    index: int
    parent: int | None
    created_at: float
    latency_s: float
    ttft_s: float
    model: str
    upstream_kind: str
    messages: list[Any]
    tools: list[Any] | None
    output: dict[str, Any]
    finish_reason: str
    usage: dict[str, Any]
    prompt_token_ids_bytes: bytes
    output_token_ids_bytes: bytes
    output_logprobs_bytes: bytes
    output_versions_bytes: bytes
    exact_tokens: bool
    length_mismatch: bool
    reward: float
    reward_set: bool
    # The weight version when the turn finished (differs only if weights changed unpaused).
    weight_version_end: int = 0
    # "main", or "side" (X-Turn-Type: heartbeats, memory flushes); to_tensors leaves side out.
    turn_type: str = "main"
    # How output_versions was made: "chunks" (per streamed chunk), "admission" (non-streaming,
    # or written before the field existed) or "admission_uncounted" (chunk counts did not add up).
    output_versions_source: str = "admission"
    # Group sampling (G > 1): samples 1..G-1 of this call; empty when G = 1.
    samples: tuple[Sample, ...] = ()

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt's token ids as the model saw them."""
        return _unpack("i", self.prompt_token_ids_bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class Trajectory:
    """One published episode: its identity, timing, rewards and interactions in order."""

    schema_version: int
    trajectory_id: str
    session_id: str
    task_id: str
    key_id: str
    episode: str
    group_id: str | None
    # Episodes in the group; None without a group.
    group_size: int | None
    started_at: float
    ended_at: float
    end_reason: str
    final_reward: float
    weight_versions: list[int]
    stats: dict[str, int]
    interactions: tuple[Interaction, ...]

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens over all interactions."""
        return sum(len(i.prompt_token_ids_bytes) // 4 for i in self.interactions)

    @property
    def output_tokens(self) -> int:
        """Sampled output tokens over all interactions."""
        return sum(len(i.output_token_ids_bytes) // 4 for i in self.interactions)


def decode_trajectory(data: bytes, codec: str = "msgpack") -> Trajectory:
    """Decodes a trajectory as carried on the stream or by the Trainer service."""
    if codec not in SUPPORTED_CODECS:
        raise TrajectoryDecodeError(
            f"codec {codec!r} is not supported by this rollgate ({', '.join(SUPPORTED_CODECS)}); "
            "upgrade the client library"
        )
    try:
        raw = msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.UnpackException) as err:
        raise TrajectoryDecodeError(f"not a msgpack trajectory: {err}") from err
    if not isinstance(raw, dict):
        raise TrajectoryDecodeError("a trajectory is a msgpack map")
    version = int(raw.get("schema_version", 0))
    if version > SCHEMA_VERSION:
        raise TrajectoryDecodeError(
            f"trajectory schema version {version} is newer than this library's "
            f"({SCHEMA_VERSION}); upgrade rollgate"
        )
    return _trajectory(inline_content(raw), version)


def _trajectory(raw: Mapping[str, Any], version: int) -> Trajectory:
    """A trajectory from its map, contents inline (version 1 layout)."""
    return Trajectory(
        schema_version=version,
        trajectory_id=str(raw.get("trajectory_id", "")),
        session_id=str(raw.get("session_id", "")),
        task_id=str(raw.get("task_id", "")),
        key_id=str(raw.get("key_id", "")),
        episode=str(raw.get("episode", "")),
        group_id=raw.get("group_id"),
        group_size=None if raw.get("group_size") is None else int(raw["group_size"]),
        started_at=float(raw.get("started_at", 0.0)),
        ended_at=float(raw.get("ended_at", 0.0)),
        end_reason=str(raw.get("end_reason", "")),
        final_reward=float(raw.get("final_reward", 0.0)),
        weight_versions=[int(v) for v in raw.get("weight_versions", ())],
        stats={str(k): int(v) for k, v in (raw.get("stats") or {}).items()},
        interactions=tuple(_interaction(item) for item in raw.get("interactions", ())),
    )


def inline_content(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A msgpack-decoded trajectory map in the version 1 layout: each interaction's
    `messages_ref` / `tools_ref` (version 2) replaced by `messages` / `tools` from the tables,
    and its `prompt_prefix` (version 2) resolved into whole `prompt_token_ids`.

    Messages and tool lists are shared between interactions that refer to the same entry
    (each interaction has its own list): copy one before changing it in place.
    """
    out = dict(raw)
    if int(raw.get("schema_version", 0)) < 2:
        return out
    messages_table = list(out.pop("messages_table", None) or [])
    tools_table = list(out.pop("tools_table", None) or [])
    interactions: list[dict[str, Any]] = []
    for item in raw.get("interactions") or ():
        inlined = _inlined(item, messages_table, tools_table)
        inlined["prompt_token_ids"] = _whole_prompt(inlined, interactions)
        interactions.append(inlined)
    out["interactions"] = interactions
    return out


def _inlined(
    raw: Mapping[str, Any], messages_table: list[Any], tools_table: list[Any]
) -> dict[str, Any]:
    item = dict(raw)
    item["messages"] = [_entry(messages_table, ref) for ref in item.pop("messages_ref", None) or ()]
    tools_ref = item.pop("tools_ref", None)
    item["tools"] = None if tools_ref is None else _entry(tools_table, tools_ref)
    return item


def _whole_prompt(item: dict[str, Any], earlier: list[dict[str, Any]]) -> bytes:
    """The interaction's prompt ids: its `prompt_prefix` (removed from `item`), if any, taken
    from an earlier interaction already made whole, then its own stored ids."""
    own = bytes(item.get("prompt_token_ids") or b"")
    prefix = item.pop("prompt_prefix", None)
    if prefix is None:
        return own
    if not isinstance(prefix, Mapping):
        raise TrajectoryDecodeError(f"prompt_prefix {prefix!r} is not a map")
    source_index, source, length = prefix.get("from"), prefix.get("source"), prefix.get("length")
    if not isinstance(source_index, int) or not 0 <= source_index < len(earlier):
        raise TrajectoryDecodeError(
            f"prompt_prefix from {source_index!r} is not one of the "
            f"{len(earlier)} interactions before it"
        )
    shared = bytes(earlier[source_index]["prompt_token_ids"])
    if source == "prompt+output":
        shared += bytes(earlier[source_index].get("output_token_ids") or b"")
    elif source != "prompt":
        raise TrajectoryDecodeError(f"prompt_prefix source {source!r} is not known")
    if not isinstance(length, int) or not 0 <= length * 4 <= len(shared):
        raise TrajectoryDecodeError(
            f"prompt_prefix length {length!r} is longer than its source ({len(shared) // 4} ids)"
        )
    return shared[: length * 4] + own


def _entry(table: list[Any], ref: Any) -> Any:
    if not isinstance(ref, int) or not 0 <= ref < len(table):
        raise TrajectoryDecodeError(
            f"reference {ref!r} is outside its table ({len(table)} entries)"
        )
    return table[ref]


def trajectory_to_json(trajectory: Trajectory) -> dict[str, Any]:
    """The trajectory as JSON-ready data: packed arrays become lists."""
    out: dict[str, Any] = {
        name: getattr(trajectory, name)
        for name in Trajectory.__dataclass_fields__
        if name != "interactions"
    }
    out["interactions"] = [_interaction_json(i) for i in trajectory.interactions]
    return out


def _interaction_json(interaction: Interaction | Sample) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in type(interaction).__dataclass_fields__:
        if name.endswith("_bytes"):
            plain = name.removesuffix("_bytes")
            out[plain] = getattr(interaction, plain)
        elif name == "samples":
            out[name] = [_interaction_json(s) for s in getattr(interaction, name)]
        else:
            out[name] = getattr(interaction, name)
    return out


def trajectory_from_json(data: Mapping[str, Any]) -> Trajectory:
    """The trajectory a `trajectory_to_json` object (an export or `tail --json` line) holds.

    The inverse of `trajectory_to_json`: lists become packed arrays again, so the tensors
    made from the result equal those made from the stream's msgpack blob (float32 logprobs
    survive JSON exactly). Fields it does not know (`stream_id`) are ignored.
    """
    if not isinstance(data, Mapping):
        raise TrajectoryDecodeError("a trajectory is a JSON object")
    version = int(data.get("schema_version", 0) or 0)
    if version > SCHEMA_VERSION:
        raise TrajectoryDecodeError(
            f"trajectory schema version {version} is newer than this library's "
            f"({SCHEMA_VERSION}); upgrade rollgate"
        )
    try:
        raw = dict(data)
        raw["interactions"] = [_packed_json(item) for item in data.get("interactions") or ()]
        return _trajectory(raw, version)
    except (TypeError, ValueError, OverflowError) as err:
        raise TrajectoryDecodeError(f"not a trajectory in rollgate's JSON form: {err}") from err


def _packed_json(item: Mapping[str, Any]) -> dict[str, Any]:
    """An interaction (or sample) as JSON, with its arrays packed as on the stream."""
    if not isinstance(item, Mapping):
        raise TypeError("an interaction is a JSON object")
    out = dict(item)
    for name in ("prompt_token_ids", "output_token_ids", "output_versions"):
        if name in out:
            out[name] = _pack("i", out[name] or ())
    if "output_logprobs" in out:
        out["output_logprobs"] = _pack("f", out["output_logprobs"] or ())
    if "samples" in out:
        out["samples"] = [_packed_json(sample) for sample in out["samples"] or ()]
    return out


def _pack(typecode: str, values: Any) -> bytes:
    packed: array[Any] = array(typecode, values)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _interaction(raw: Mapping[str, Any]) -> Interaction:
    parent = raw.get("parent")
    return Interaction(
        interaction_id=str(raw.get("interaction_id", "")),
        index=int(raw.get("index", 0)),
        parent=None if parent is None else int(parent),
        created_at=float(raw.get("created_at", 0.0)),
        latency_s=float(raw.get("latency_s", 0.0)),
        ttft_s=float(raw.get("ttft_s", 0.0)),
        model=str(raw.get("model", "")),
        upstream_kind=str(raw.get("upstream_kind", "")),
        messages=list(raw.get("messages") or []),
        tools=raw.get("tools"),
        output=dict(raw.get("output") or {}),
        finish_reason=str(raw.get("finish_reason", "")),
        usage=dict(raw.get("usage") or {}),
        prompt_token_ids_bytes=bytes(raw.get("prompt_token_ids") or b""),
        output_token_ids_bytes=bytes(raw.get("output_token_ids") or b""),
        output_logprobs_bytes=bytes(raw.get("output_logprobs") or b""),
        output_versions_bytes=bytes(raw.get("output_versions") or b""),
        exact_tokens=bool(raw.get("exact_tokens", False)),
        length_mismatch=bool(raw.get("length_mismatch", False)),
        reward=float(raw.get("reward", 0.0)),
        reward_set=bool(raw.get("reward_set", False)),
        weight_version_end=int(raw.get("weight_version_end", 0) or 0),
        turn_type=str(raw.get("turn_type", "main") or "main"),
        output_versions_source=str(raw.get("output_versions_source") or "admission"),
        samples=tuple(_sample(item) for item in raw.get("samples") or ()),
    )


def _sample(raw: Mapping[str, Any]) -> Sample:
    return Sample(
        sample_index=int(raw.get("sample_index", 0)),
        output=dict(raw.get("output") or {}),
        finish_reason=str(raw.get("finish_reason", "")),
        output_token_ids_bytes=bytes(raw.get("output_token_ids") or b""),
        output_logprobs_bytes=bytes(raw.get("output_logprobs") or b""),
        output_versions_bytes=bytes(raw.get("output_versions") or b""),
        exact_tokens=bool(raw.get("exact_tokens", False)),
        length_mismatch=bool(raw.get("length_mismatch", False)),
        reward=float(raw.get("reward", 0.0)),
        reward_set=bool(raw.get("reward_set", False)),
    )


def _unpack(typecode: str, data: bytes) -> list[int]:
    values = _little_endian_array(typecode, data)
    return list(values)


def _unpack_float(data: bytes) -> list[float]:
    return list(_little_endian_array("f", data))


def _little_endian_array(typecode: str, data: bytes) -> array[Any]:
    values: array[Any] = array(typecode)
    if values.itemsize != 4:  # pragma: no cover - every mainstream platform has 4-byte i/f
        raise TrajectoryDecodeError(f"array({typecode!r}) is not 4 bytes wide here")
    if len(data) % 4:
        raise TrajectoryDecodeError(f"a packed array of {len(data)} bytes is not 4-byte aligned")
    values.frombytes(data)
    if sys.byteorder == "big":
        values.byteswap()
    return values
