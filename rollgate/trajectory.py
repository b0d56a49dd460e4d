"""Decoding published trajectories into typed, read-only views (docs/trajectory-schema.md).

The views, their fields, defaults and packing are `schema.trajectory`'s (shared with the
writer); this module reads the stream's msgpack blobs and the JSON form into them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack  # type: ignore[import-untyped]

from schema.packing import pack_float32, pack_int32
from schema.trajectory import (
    INTERACTION_SPECS,
    SAMPLE_SPECS,
    SCHEMA_VERSION,
    SUPPORTED_CODECS,
    TRAJECTORY_SPECS,
    Interaction,
    Sample,
    Trajectory,
    TrajectoryDecodeError,
    read_fields,
)

__all__ = [
    "SCHEMA_VERSION",
    "SUPPORTED_CODECS",
    "Interaction",
    "Sample",
    "Trajectory",
    "TrajectoryDecodeError",
    "decode_trajectory",
    "inline_content",
    "trajectory_from_json",
    "trajectory_to_json",
]


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
    fields = read_fields(TRAJECTORY_SPECS, raw)
    fields["schema_version"] = version
    fields["interactions"] = tuple(_interaction(item) for item in raw.get("interactions", ()))
    return Trajectory(**fields)


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
    return pack_int32(values) if typecode == "i" else pack_float32(values)


def _interaction(raw: Mapping[str, Any]) -> Interaction:
    fields = read_fields(INTERACTION_SPECS, raw)
    fields["samples"] = tuple(_sample(item) for item in raw.get("samples") or ())
    return Interaction(**fields)


def _sample(raw: Mapping[str, Any]) -> Sample:
    return Sample(**read_fields(SAMPLE_SPECS, raw))
