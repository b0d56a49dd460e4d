"""The published trajectory: built from an episode's turn records (docs/trajectory-schema.md)."""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]
import orjson
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from services.dataproxy.redis_keys import RedisKeys
from services.dataproxy.turns import common_prefix, decode_turns
from services.runtime.errors import InvalidRequest
from services.runtime.logs import get_logger

log = get_logger(__name__)

CODEC: str = "msgpack"
SCHEMA_VERSION = 2

# Packed arrays are little-endian whatever the host: int32 ids/versions, float32 logprobs.
_INT32 = struct.Struct("<i")
_FLOAT32_BYTES = 4

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
    packed = bytes(interaction["output_versions"])
    count = len(packed) // 4
    return set(struct.unpack(f"<{count}i", packed)) if count else set()


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
    record = turn.record
    interaction_id = str(record.get("interaction_id", ""))
    logprobs = bytes(record.get("output_logprobs") or b"")
    n_output = len(turn.output_ids) // 4 or len(logprobs) // _FLOAT32_BYTES
    reward = rewards.get(interaction_id)
    return {
        "interaction_id": interaction_id,
        "index": index,
        "parent": parent,
        "created_at": float(record.get("created_at", 0.0) or 0.0),
        "latency_s": float(record.get("latency_s", 0.0) or 0.0),
        "ttft_s": float(record.get("ttft_s", 0.0) or 0.0),
        "model": str(record.get("upstream_model", "")),
        "upstream_kind": str(record.get("upstream_kind", "")),
        "messages_ref": tables.message_refs(turn.messages),
        "tools_ref": tables.tools_ref(turn.tools),
        "output": turn.output,
        "finish_reason": str(record.get("finish_reason", "")),
        "usage": _json_object(record.get("usage_json")),
        "prompt_token_ids": turn.prompt_ids,
        "output_token_ids": turn.output_ids,
        "output_logprobs": logprobs,
        "output_versions": _output_versions(record, n_output),
        # "chunks": stamped per streamed chunk; else every token has the admission version.
        "output_versions_source": _versions_source(record, n_output),
        # The version when the turn finished (≠ its tokens' only if weights changed unpaused).
        "weight_version_end": int(
            record.get("weight_version_end", record.get("weight_version", 0)) or 0
        ),
        "exact_tokens": turn.exact,
        # "main", or "side" (X-Turn-Type): side turns are recorded but left out of training.
        "turn_type": str(record.get("turn_type", "main") or "main"),
        "length_mismatch": bool(record.get("length_mismatch", False)),
        "reward": float(reward) if reward is not None else 0.0,
        "reward_set": reward is not None,
        "samples": _extra_samples(record, reward),
    }


def _extra_samples(record: Mapping[str, Any], reward: float | None) -> list[dict[str, Any]]:
    """Samples 1..G-1 of a group-sampled call; each shares the prompt and the turn's reward."""
    out = []
    for number, sample in enumerate(record.get("extra_samples") or (), start=1):
        output_ids = bytes(sample.get("output_token_ids") or b"")
        logprobs = bytes(sample.get("output_logprobs") or b"")
        n_output = len(output_ids) // 4 or len(logprobs) // _FLOAT32_BYTES
        out.append(
            {
                "sample_index": number,
                "output": _json_object(sample.get("assistant_message_json")),
                "finish_reason": str(sample.get("finish_reason", "")),
                "output_token_ids": output_ids,
                "output_logprobs": logprobs,
                "output_versions": _INT32.pack(int(record.get("weight_version", 0) or 0))
                * n_output,
                "exact_tokens": bool(sample.get("exact_tokens", False)),
                "length_mismatch": bool(sample.get("length_mismatch", False)),
                "reward": float(reward) if reward is not None else 0.0,
                "reward_set": reward is not None,
            }
        )
    return out


def _output_versions(record: Mapping[str, Any], n_output: int) -> bytes:
    """Per-token versions as recorded; else the turn's version repeated once per token."""
    packed = bytes(record.get("output_versions") or b"")
    if packed and len(packed) == n_output * 4:
        return packed
    return _INT32.pack(int(record.get("weight_version", 0) or 0)) * n_output


def _versions_source(record: Mapping[str, Any], n_output: int) -> str:
    """How `output_versions` was made (records written before per-token versions: admission)."""
    source = str(record.get("output_versions_source") or "admission")
    if source == "chunks" and len(bytes(record.get("output_versions") or b"")) != n_output * 4:
        return "admission"  # not one version per token: `_output_versions` did not use them
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


# --- The stream of published trajectories, as the Trainer service reads it ----------------


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamEntry:
    """One entry of the trajectories stream."""

    stream_id: str
    trajectory_id: str
    codec: str
    data: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerStats:
    """The counters `GetStats` reports."""

    open_episodes: int
    published: int
    consumed: int
    pending: int
    weight_version: int
    empty_episodes: int
    # Interactions published, and those whose parent was found (`P stats` counters).
    interactions: int = 0
    joined: int = 0

    @property
    def join_rate(self) -> float:
        """Share of interactions after each episode's first whose parent was found."""
        could_join = self.interactions - self.published
        return self.joined / could_join if could_join > 0 else 0.0


# XACK and the `consumed` counter move together, in one round trip.
_ACK_LUA = """
local n = redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 2))
if n > 0 then redis.call('HINCRBY', KEYS[2], 'consumed', n) end
return n
"""

# Weight versions only move forward; repeating the current one is a no-op. The new version
# is published on the channel named like the key, which every replica's WeightVersionView
# follows (services/dataproxy/control.py) to stamp streamed tokens as they pass.
_SET_VERSION_LUA = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
local wanted = tonumber(ARGV[1])
if wanted < current then return {0, tostring(current)} end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('PUBLISH', KEYS[1], ARGV[1])
return {1, ARGV[1]}
"""

# Lua's unpack() has a stack limit of a few thousand values: ack in chunks.
_ACK_CHUNK = 1000
_READ_BATCH = 64


class TrajectoryStream:
    """Reads the trajectories stream through consumer groups; acks; version; counters."""

    def __init__(
        self,
        *,
        redis: Redis,
        keys: RedisKeys,
        reclaim_idle_s: float = 60.0,
        block_s: float = 2.0,
        command_timeout_s: float = 5.0,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._reclaim_idle_ms = max(1, int(reclaim_idle_s * 1000))
        self._block_ms = max(1, int(block_s * 1000))
        self._timeout_s = command_timeout_s
        self._ack = redis.register_script(_ACK_LUA)
        self._set_version = redis.register_script(_SET_VERSION_LUA)

    async def ensure_group(self, group: str) -> None:
        """Creates the consumer group (from the start of the stream) unless it exists."""
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._redis.xgroup_create(
                    self._keys.trajectories, group, id="0", mkstream=True
                )
        except ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise

    async def pull(
        self,
        group: str,
        consumer: str,
        *,
        max_count: int = 0,
        idle_timeout_s: float = 0.0,
        stopping: asyncio.Event | None = None,
    ) -> AsyncIterator[StreamEntry]:
        """Own pending entries first, then reclaimed and new ones, until a limit is reached."""
        await self.ensure_group(group)
        budget = _Budget(max_count=max_count, idle_timeout_s=idle_timeout_s, stopping=stopping)
        async for entry in self._own_pending(group, consumer, budget):
            yield entry
        next_reclaim, reclaim_cursor = 0.0, "0-0"
        while not budget.done():
            if time.monotonic() >= next_reclaim:
                reclaimed, reclaim_cursor = await self._reclaim(
                    group, consumer, reclaim_cursor, budget.batch()
                )
                for entry in reclaimed:
                    budget.delivered()
                    yield entry
                if reclaim_cursor == "0-0":  # the whole group's PEL was scanned
                    next_reclaim = time.monotonic() + self._reclaim_idle_ms / 4000
                continue
            block_ms = min(self._block_ms, budget.idle_left_ms())
            entries = await self._read(group, consumer, ">", budget.batch(), block_ms)
            for entry in entries:
                budget.delivered()
                yield entry

    async def ack(self, group: str, stream_ids: Sequence[str]) -> int:
        """XACKs `stream_ids` in `group` and counts them as consumed; the number acked."""
        acked = 0
        for start in range(0, len(stream_ids), _ACK_CHUNK):
            chunk = stream_ids[start : start + _ACK_CHUNK]
            async with asyncio.timeout(self._timeout_s):
                acked += int(
                    await self._ack(
                        keys=[self._keys.trajectories, self._keys.stats], args=[group, *chunk]
                    )
                )
        return acked

    async def set_weight_version(self, version: int) -> int:
        """Sets the weight version; refuses to go backwards."""
        if version < 0:
            raise InvalidRequest(f"weight version {version} is negative", code="invalid_version")
        async with asyncio.timeout(self._timeout_s):
            ok, current = await self._set_version(keys=[self._keys.weight_version], args=[version])
        if not int(ok):
            raise InvalidRequest(
                f"weight version {version} is older than the current one ({int(current)}); "
                "versions only move forward",
                code="weight_version_decreased",
            )
        return version

    async def stats(self) -> TrainerStats:
        """Counters from the stats hash, pending entries over all groups, the weight version."""
        async with asyncio.timeout(self._timeout_s):
            pipe = self._redis.pipeline(transaction=False)
            pipe.hgetall(self._keys.stats)
            pipe.get(self._keys.weight_version)
            counters, version = await pipe.execute()
            groups = await self._groups()
        fields = {_text(k): _int(v) for k, v in counters.items()}
        return TrainerStats(
            # Maintained by the session code only if it can do so cheaply; else 0.
            open_episodes=fields.get("open_episodes", 0),
            published=fields.get("published", 0),
            consumed=fields.get("consumed", 0),
            pending=sum(_int(g.get("pending", 0)) for g in groups),
            weight_version=_int(version),
            empty_episodes=fields.get("empty_episodes", 0),
            interactions=fields.get("interactions", 0),
            joined=fields.get("joined", 0),
        )

    async def _groups(self) -> list[dict[str, Any]]:
        try:
            groups = await self._redis.xinfo_groups(self._keys.trajectories)
        except ResponseError as err:
            if "no such key" in str(err).lower():
                return []
            raise
        return [{_text(k): v for k, v in group.items()} for group in groups]

    async def _own_pending(
        self, group: str, consumer: str, budget: _Budget
    ) -> AsyncIterator[StreamEntry]:
        cursor = "0-0"
        while not budget.done():
            entries, cursor = await self._read_pending(group, consumer, cursor, budget.batch())
            if cursor == "":
                return
            for entry in entries:
                budget.delivered()
                yield entry

    async def _read_pending(
        self, group: str, consumer: str, cursor: str, count: int
    ) -> tuple[list[StreamEntry], str]:
        async with asyncio.timeout(self._timeout_s):
            reply = await self._redis.xreadgroup(
                group, consumer, {self._keys.trajectories: cursor}, count=count
            )
        raw = _stream_items(reply)
        if not raw:
            return [], ""
        return await self._usable(group, raw), _text(raw[-1][0])

    async def _read(
        self, group: str, consumer: str, cursor: str, count: int, block_ms: int
    ) -> list[StreamEntry]:
        async with asyncio.timeout(self._timeout_s + block_ms / 1000):
            reply = await self._redis.xreadgroup(
                group, consumer, {self._keys.trajectories: cursor}, count=count, block=block_ms
            )
        return await self._usable(group, _stream_items(reply))

    async def _reclaim(
        self, group: str, consumer: str, cursor: str, count: int
    ) -> tuple[list[StreamEntry], str]:
        """Claims entries left unacked for long (a dead consumer's); the next scan cursor."""
        async with asyncio.timeout(self._timeout_s):
            reply = await self._redis.xautoclaim(
                self._keys.trajectories,
                group,
                consumer,
                self._reclaim_idle_ms,
                start_id=cursor,
                count=count,
            )
        cursor, items = _text(reply[0]), list(reply[1])
        entries = await self._usable(group, items)
        if entries:
            log.info("trajectories_reclaimed", group=group, consumer=consumer, count=len(entries))
        return entries, cursor

    async def _usable(self, group: str, items: Sequence[Any]) -> list[StreamEntry]:
        """Entries with their data; pending ids whose entry was trimmed away are acked."""
        entries: list[StreamEntry] = []
        gone: list[str] = []
        for stream_id, fields in items:
            if not fields:
                gone.append(_text(stream_id))
                continue
            values = {_text(k): v for k, v in fields.items()}
            entries.append(
                StreamEntry(
                    stream_id=_text(stream_id),
                    trajectory_id=_text(values.get("trajectory_id", b"")),
                    codec=_text(values.get("codec", CODEC.encode())),
                    data=bytes(values.get("data", b"")),
                )
            )
        if gone:
            async with asyncio.timeout(self._timeout_s):
                await self._redis.xack(self._keys.trajectories, group, *gone)
            log.warning("trajectories_gone_from_stream", group=group, count=len(gone))
        return entries


class _Budget:
    """When a pull stops: a count, an idle time since the last delivery, or shutdown."""

    def __init__(
        self, *, max_count: int, idle_timeout_s: float, stopping: asyncio.Event | None
    ) -> None:
        self._left = max_count if max_count > 0 else None
        self._idle_s = idle_timeout_s if idle_timeout_s > 0 else None
        self._stopping = stopping
        self._last = time.monotonic()

    def delivered(self) -> None:
        if self._left is not None:
            self._left -= 1
        self._last = time.monotonic()

    def batch(self) -> int:
        return _READ_BATCH if self._left is None else max(1, min(_READ_BATCH, self._left))

    def idle_left_ms(self) -> int:
        if self._idle_s is None:
            return 1 << 30
        return max(1, int((self._idle_s - (time.monotonic() - self._last)) * 1000))

    def done(self) -> bool:
        if self._left is not None and self._left <= 0:
            return True
        if self._stopping is not None and self._stopping.is_set():
            return True
        return self._idle_s is not None and time.monotonic() - self._last >= self._idle_s


def _stream_items(reply: Any) -> list[Any]:
    """The (id, fields) pairs of a one-stream XREAD/XREADGROUP reply (RESP2 or RESP3)."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return [item for items in reply.values() for item in (items[0] if items else [])]
    return [item for _name, items in reply for item in items]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _int(value: Any) -> int:
    if value is None or value == b"" or value == "":
        return 0
    return int(float(value))
