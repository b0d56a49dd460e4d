"""The published trajectory, built from an episode's turn records (docs/trajectory-schema.md;
its fields, defaults and packing are schema.trajectory's). The stream it is read from is
trajectory_stream.py."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]
import orjson

from schema.packing import count, pack_int32, unpack_int32
from schema.trajectory import (
    INTERACTION_SPECS,
    SAMPLE_SPECS,
    SCHEMA_VERSION,
    VERSIONS_AT_ADMISSION,
    VERSIONS_FROM_CHUNKS,
    copied_from_turn,
)
from services.dataproxy.turns import decode_turns
from services.runtime.prefix import common_prefix

# A prompt shares ids with an earlier interaction only from this many on: below it the
# `prompt_prefix` map costs about what it saves.
MIN_SHARED_PROMPT_IDS = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class EpisodeInfo:
    """What the episode's hash says about the episode being published."""

    trajectory_id: str
    session_id: str
    task_id: str
    key_id: str
    episode: str
    started_at: float
    ended_at: float
    end_reason: str  # "refresh" | "end_session" | "idle"
    group_id: str | None = None
    # Episodes in the group (GRPO over whole episodes); None without a group.
    group_size: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class _Turn:
    """One turn record, decoded once, with what parent linking compares."""

    record: Mapping[str, Any]
    messages: list[Any]
    tools: list[Any] | None
    output: dict[str, Any]
    prompt_ids: bytes
    output_ids: bytes
    exact: bool


def build_trajectory(
    info: EpisodeInfo, turns: Sequence[bytes], rewards: Mapping[str, float]
) -> dict[str, Any]:
    """The trajectory (schema version 2) of an episode, ready for `encode_trajectory`."""
    decoded = [_decode_turn(record) for record in decode_turns(turns)]
    parents = link_parents(decoded)
    tables = _ContentTables()
    interactions = [
        _interaction(index, turn, parents[index], rewards, tables)
        for index, turn in enumerate(decoded)
    ]
    _share_prompt_prefixes(decoded, interactions)
    versions = sorted(
        {int(turn.record.get("weight_version", 0) or 0) for turn in decoded}
        | {v for i in interactions for v in _versions_of(i)}
    )
    return {
        "schema_version": SCHEMA_VERSION,
        "trajectory_id": info.trajectory_id,
        "session_id": info.session_id,
        "task_id": info.task_id,
        "key_id": info.key_id,
        "episode": info.episode,
        "group_id": info.group_id,
        "group_size": info.group_size,
        "started_at": float(info.started_at),
        "ended_at": float(info.ended_at),
        "end_reason": info.end_reason,
        "final_reward": interactions[-1]["reward"] if interactions else 0.0,
        "weight_versions": versions,
        "stats": _stats(decoded, parents, interactions),
        # Each distinct message and tool list once; interactions refer to them by index.
        "messages_table": tables.messages,
        "tools_table": tables.tools,
        "interactions": interactions,
    }


class _ContentTables:
    """Distinct messages and tool lists of one trajectory, keyed by their exact JSON."""

    def __init__(self) -> None:
        self.messages: list[Any] = []
        self.tools: list[list[Any]] = []
        self._message_index: dict[bytes, int] = {}
        self._tools_index: dict[bytes, int] = {}

    def message_refs(self, messages: Sequence[Any]) -> list[int]:
        """The table index of each message, adding the ones not seen yet."""
        return [_ref(self.messages, self._message_index, message) for message in messages]

    def tools_ref(self, tools: list[Any] | None) -> int | None:
        """The table index of the tool list; None when the request had none."""
        return None if tools is None else _ref(self.tools, self._tools_index, tools)


def _ref(table: list[Any], index: dict[bytes, int], value: Any) -> int:
    key = orjson.dumps(value)
    found = index.get(key)
    if found is None:
        found = index[key] = len(table)
        table.append(value)
    return found


def _share_prompt_prefixes(turns: Sequence[_Turn], interactions: list[dict[str, Any]]) -> None:
    """Stores each prompt as a prefix shared with an earlier interaction plus its own suffix."""
    extended = [turn.prompt_ids + turn.output_ids for turn in turns]
    for index, turn in enumerate(turns):
        shared = _longest_shared_prefix(turn.prompt_ids, extended[:index])
        if shared is None:
            continue
        source_index, length = shared
        source = turns[source_index]
        interactions[index]["prompt_prefix"] = {
            "from": source_index,
            "source": "prompt" if length * 4 <= len(source.prompt_ids) else "prompt+output",
            "length": length,
        }
        interactions[index]["prompt_token_ids"] = turn.prompt_ids[length * 4 :]


def _longest_shared_prefix(prompt: bytes, earlier: Sequence[bytes]) -> tuple[int, int] | None:
    """Which earlier prompt + output ids share the most leading ids with `prompt`, and how
    many; None below `MIN_SHARED_PROMPT_IDS`."""
    best: tuple[int, int] | None = None
    best_len = MIN_SHARED_PROMPT_IDS - 1
    # Latest first, so that on a tie the latest wins (as for parents).
    for candidate in range(len(earlier) - 1, -1, -1):
        if min(len(prompt), len(earlier[candidate])) // 4 <= best_len:
            continue
        length = _common_ids(prompt, earlier[candidate])
        if length > best_len:
            best, best_len = (candidate, length), length
    return best


def _common_ids(a: bytes, b: bytes) -> int:
    """How many leading int32 ids two packed arrays share (compared as bytes)."""
    return common_prefix(a, b) // 4


def encode_trajectory(trajectory: Mapping[str, Any]) -> bytes:
    """The trajectory as msgpack bytes (binary fields stay binary)."""
    return bytes(msgpack.packb(trajectory, use_bin_type=True))


def link_parents(turns: Sequence[_Turn]) -> list[int | None]:
    """Each turn's parent index: the longest earlier turn this one extends (AReaL's cache)."""
    parents: list[int | None] = []
    for index, child in enumerate(turns):
        best: int | None = None
        best_len = -1
        for candidate in range(index):
            parent = turns[candidate]
            if parent.exact and child.exact and parent.prompt_ids and child.prompt_ids:
                matched = child.prompt_ids.startswith(parent.prompt_ids + parent.output_ids)
                length = len(parent.prompt_ids) // 4
            else:
                matched = _is_message_prefix([*parent.messages, parent.output], child.messages)
                length = len(parent.messages)
            # `>=`: among equally long prompts the latest one wins (a retried call).
            if matched and length >= best_len:
                best, best_len = candidate, length
        parents.append(best)
    return parents


def _stats(
    turns: Sequence[_Turn], parents: Sequence[int | None], interactions: Sequence[Mapping[str, Any]]
) -> dict[str, int]:
    """How the turns joined: parents found, exact token joins, retries, length mismatches."""
    exact = 0
    for child, parent in zip(turns, parents, strict=True):
        if parent is not None and child.exact and turns[parent].exact:
            exact += int(
                child.prompt_ids.startswith(turns[parent].prompt_ids + turns[parent].output_ids)
            )
    seen: set[bytes] = set()
    retries = 0
    for turn in turns:
        key = (
            orjson.dumps(turn.messages, option=orjson.OPT_SORT_KEYS)
            if turn.messages
            else b"p" + turn.prompt_ids
        )
        retries += int(key in seen)
        seen.add(key)
    return {
        "interactions": len(turns),
        "joined": sum(parent is not None for parent in parents),
        "exact_joined": exact,
        "retries": retries,
        "length_mismatches": sum(bool(i["length_mismatch"]) for i in interactions),
    }


def _versions_of(interaction: Mapping[str, Any]) -> set[int]:
    return set(unpack_int32(bytes(interaction["output_versions"])))


def _decode_turn(record: Mapping[str, Any]) -> _Turn:
    request = _json_object(record.get("request_json"))
    messages = request.get("messages")
    tools = request.get("tools")
    return _Turn(
        record=record,
        messages=messages if isinstance(messages, list) else [],
        tools=tools if isinstance(tools, list) else None,
        output=_json_object(record.get("assistant_message_json")),
        prompt_ids=bytes(record.get("prompt_token_ids") or b""),
        output_ids=bytes(record.get("output_token_ids") or b""),
        exact=bool(record.get("exact_tokens", False)),
    )


def _interaction(
    index: int,
    turn: _Turn,
    parent: int | None,
    rewards: Mapping[str, float],
    tables: _ContentTables,
) -> dict[str, Any]:
    """One published interaction: the fields schema.trajectory copies from the turn record,
    and those built here."""
    record = turn.record
    copied = copied_from_turn(INTERACTION_SPECS, record)
    n_output = count(copied["output_token_ids"]) or count(copied["output_logprobs"])
    reward = rewards.get(copied["interaction_id"])
    return {
        **copied,
        "index": index,
        "parent": parent,
        "messages_ref": tables.message_refs(turn.messages),
        "tools_ref": tables.tools_ref(turn.tools),
        "output": turn.output,
        "usage": _json_object(record.get("usage_json")),
        "prompt_token_ids": turn.prompt_ids,
        "output_versions": _output_versions(record, n_output),
        # "chunks": stamped per streamed chunk; else every token has the admission version.
        "output_versions_source": _versions_source(record, n_output),
        # The version when the turn finished (≠ its tokens' only if weights changed unpaused).
        "weight_version_end": int(
            record.get("weight_version_end", record.get("weight_version", 0)) or 0
        ),
        "reward": float(reward) if reward is not None else 0.0,
        "reward_set": reward is not None,
        "samples": _extra_samples(record, reward),
    }


def _extra_samples(record: Mapping[str, Any], reward: float | None) -> list[dict[str, Any]]:
    """Samples 1..G-1 of a group-sampled call; each shares the prompt and the turn's reward."""
    out = []
    for number, sample in enumerate(record.get("extra_samples") or (), start=1):
        copied = copied_from_turn(SAMPLE_SPECS, sample)
        n_output = count(copied["output_token_ids"]) or count(copied["output_logprobs"])
        out.append(
            {
                **copied,
                "sample_index": number,
                "output": _json_object(sample.get("assistant_message_json")),
                "output_versions": _admission_versions(record, n_output),
                "reward": float(reward) if reward is not None else 0.0,
                "reward_set": reward is not None,
            }
        )
    return out


def _admission_versions(record: Mapping[str, Any], n_output: int) -> bytes:
    """The turn's admission version once per output token."""
    return pack_int32([int(record.get("weight_version", 0) or 0)]) * n_output


def _output_versions(record: Mapping[str, Any], n_output: int) -> bytes:
    """Per-token versions as recorded; else the turn's version repeated once per token."""
    packed = bytes(record.get("output_versions") or b"")
    if packed and len(packed) == n_output * 4:
        return packed
    return _admission_versions(record, n_output)


def _versions_source(record: Mapping[str, Any], n_output: int) -> str:
    """How `output_versions` was made (records written before per-token versions: admission)."""
    source = str(record.get("output_versions_source") or VERSIONS_AT_ADMISSION)
    packed = bytes(record.get("output_versions") or b"")
    if source == VERSIONS_FROM_CHUNKS and len(packed) != n_output * 4:
        return VERSIONS_AT_ADMISSION  # not one per token: `_output_versions` did not use them
    return source


def _json_object(raw: Any) -> dict[str, Any]:
    if not raw:
        return {}
    value = orjson.loads(raw)
    return value if isinstance(value, dict) else {}


def _is_message_prefix(prefix: Sequence[Any], messages: Sequence[Any]) -> bool:
    if len(prefix) > len(messages):
        return False
    return all(_normalized(a) == _normalized(b) for a, b in zip(prefix, messages, strict=False))


def _normalized(message: Any) -> Any:
    # Clients echo the assistant message with null or empty extras (`refusal: null`,
    # `content: ""` beside tool calls, `annotations: []`); those do not change the prompt.
    if not isinstance(message, dict):
        return message
    return {k: v for k, v in message.items() if v not in (None, "", [], {})}
