"""Every Redis key name the dataproxy uses, and the field names of its hashes, in one place
(see docs/internals.md)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

# Ended episodes keep their hash this long: the record that makes publication idempotent.
ENDED_EPISODE_TTL_S = 7 * 24 * 3600


@dataclass(frozen=True, slots=True)
class RedisKeys:
    """Key names under one prefix (default `rg:`)."""

    prefix: str = "rg:"

    def key(self, digest: str) -> str:
        """Hash describing one session key (found by its SHA-256 digest): KeyFields."""
        return f"{self.prefix}key:{digest}"

    def episode(self, key_id: str, episode: str) -> str:
        """Hash describing one episode of a key: EpisodeFields."""
        return f"{self.prefix}ep:{key_id}:{episode}"

    def turns(self, key_id: str, episode: str) -> str:
        """List of msgpack turn records of one episode, in order."""
        return f"{self.prefix}turns:{key_id}:{episode}"

    def rewards(self, key_id: str, episode: str) -> str:
        """Hash interaction id → reward of one episode."""
        return f"{self.prefix}rewards:{key_id}:{episode}"

    def interaction_index(self, key_id: str, episode: str) -> str:
        """Hash interaction id → index in the turns list of one episode."""
        return f"{self.prefix}ix:{key_id}:{episode}"

    def session(self, key_id: str, session_id: str) -> str:
        """Hash of one header-mode session: SessionFields."""
        return f"{self.prefix}hsess:{key_id}:{session_id}"

    def refreshing(self, digest: str) -> str:
        """Marker set (NX, with a TTL) while a refresh of the key runs."""
        return f"{self.prefix}refreshing:{digest}"

    def group(self, group_id: str) -> str:
        """Hash of one episode group: GroupFields."""
        return f"{self.prefix}group:{group_id}"

    def trajectory_group(self, trajectory_id: str) -> str:
        """Hash of a published trajectory that belongs to a group: TrajectoryGroupFields."""
        return f"{self.prefix}trajgroup:{trajectory_id}"

    @property
    def idle(self) -> str:
        """Zset `digest/episode` → idle deadline of every active episode."""
        return f"{self.prefix}idle"

    @property
    def episode_turns(self) -> str:
        """Hash `digest/episode` → turns of the episode holding an in-flight lease (absent: 0)."""
        return f"{self.prefix}epturns"

    @property
    def awaiting_reward(self) -> str:
        """Zset `digest/episode` → deadline of ended episodes held for a late reward."""
        return f"{self.prefix}awaiting_reward"

    @property
    def capacity(self) -> str:
        """Hash: CapacityFields (absent: no grant ever made)."""
        return f"{self.prefix}capacity"

    @property
    def paused(self) -> str:
        """Present while submission is paused for a weight update."""
        return f"{self.prefix}paused"

    @property
    def in_flight(self) -> str:
        """Zset turn token → lease deadline of every running turn, over all replicas."""
        return f"{self.prefix}inflight"

    @property
    def trajectories(self) -> str:
        """The stream of published trajectories."""
        return f"{self.prefix}trajectories"

    @property
    def stats(self) -> str:
        """Hash of counters: StatsFields."""
        return f"{self.prefix}stats"

    @property
    def recent_trajectories(self) -> str:
        """List, newest first: `<stream id> <summary JSON>` of the last published trajectories."""
        return f"{self.prefix}recent"

    @property
    def history(self) -> str:
        """Sorted set: unix time → JSON snapshot of the counters, one per history interval."""
        return f"{self.prefix}history"

    @property
    def history_slot(self) -> str:
        """String: the last history interval written (so one replica writes each)."""
        return f"{self.prefix}history:slot"

    @property
    def errors(self) -> str:
        """List, newest first: JSON of the last failed RPCs (the console's error panel)."""
        return f"{self.prefix}errors"

    @property
    def metrics_exporter(self) -> str:
        """String: which dataproxy replica exports the global metrics (a lease)."""
        return f"{self.prefix}metrics:exporter:dataproxy"

    @property
    def weight_version(self) -> str:
        """The current weight version (0 when unset)."""
        return f"{self.prefix}weight_version"

    @property
    def weight_version_epoch(self) -> str:
        """Counter: how many times the weight version was rolled back (SetWeightVersion's
        allow_rollback), so every replica's view can tell a rollback from a stale reply."""
        return f"{self.prefix}weight_version_epoch"

    @property
    def session_seq(self) -> str:
        """Counter behind session ids `<task_id>-<n>`."""
        return f"{self.prefix}seq:session"

    def conversation(self, key_id: str, name: str) -> str:
        """List of chat messages (JSON) of one server-kept conversation of a key."""
        return f"{self.prefix}conv:{key_id}:{name}"

    def conversation_lease(self, key_id: str, name: str) -> str:
        """String holding the id of the run that holds the conversation's turn lease."""
        return f"{self.prefix}convlease:{key_id}:{name}"

    def conversation_run(self, key_id: str, name: str, idempotency_key: str) -> str:
        """String holding the id of the first run claimed under a WebSocket idempotencyKey."""
        return f"{self.prefix}convrun:{key_id}:{name}:{idempotency_key}"

    def response(self, key_id: str, response_id: str) -> str:
        """Hash of one stored Responses response: ResponseFields."""
        return f"{self.prefix}resp:{key_id}:{response_id}"

    def response_chain(self, key_id: str, chain_id: str) -> str:
        """List of the items (JSON) of one Responses chain, materialized in order."""
        return f"{self.prefix}rchain:{key_id}:{chain_id}"

    def revoked(self, digest: str) -> str:
        """Hash of a revoked key (any kind), kept for good: TombstoneFields."""
        return f"{self.prefix}revoked:{digest}"

    @property
    def access_keys(self) -> str:
        """Hash digest → JSON `{key_id, kind, label, created_at}` of issued admin/trainer keys."""
        return f"{self.prefix}access_keys"

    def key_pattern(self, key_id: str) -> str:
        """SCAN pattern of the session key hashes whose digest starts with `key_id` (hex)."""
        return f"{self.prefix}key:{key_id}*"

    def revoked_pattern(self, key_id: str) -> str:
        """SCAN pattern of the tombstones whose digest starts with `key_id` (hex)."""
        return f"{self.prefix}revoked:{key_id}*"


# Hash field names, one class per kind of hash: what Python reads and writes by these names,
# the .lua scripts spell the same (tests/dataproxy/test_redis_fields.py holds them to it).


class KeyFields:
    """Fields of a session key's hash (`RedisKeys.key`)."""

    KEY_ID: Final = "key_id"
    TASK_ID: Final = "task_id"
    MODE: Final = "mode"  # "header" for a header-mode key; absent: per-episode
    STATE: Final = "state"  # KeyStatus
    EPISODE: Final = "episode"  # the active episode ("" between episodes)
    EPOCH: Final = "epoch"  # episodes bound so far
    HELD: Final = "held"  # the ended episode held for a late reward
    CREATED_AT: Final = "created_at"
    # The last publication, so a retried end_session finds it.
    LAST_EPISODE: Final = "last_episode"
    LAST_STATUS: Final = "last_status"
    LAST_TRAJECTORY_ID: Final = "last_trajectory_id"
    LAST_STREAM_ID: Final = "last_stream_id"
    LAST_TURNS: Final = "last_turns"
    LAST_ENDED_AT: Final = "last_ended_at"


class KeyStatus(enum.StrEnum):
    """Values of a key's `KeyFields.STATE`."""

    ACTIVE = "active"  # its episode is open
    IDLE = "idle"  # between episodes


class EpisodeStatus(enum.StrEnum):
    """Values of an episode's `EpisodeFields.STATE` (the Lua scripts write the same)."""

    ACTIVE = "active"
    HELD = "ended_awaiting_reward"  # ended; published once its reward is set or it times out
    PUBLISHED = "published"
    EMPTY = "empty"  # ended without a turn: nothing to publish
    REVOKED = "revoked"


class EpisodeFields:
    """Fields of an episode's hash (`RedisKeys.episode`)."""

    SESSION_ID: Final = "session_id"
    TASK_ID: Final = "task_id"
    EPOCH: Final = "epoch"
    STATE: Final = "state"  # EpisodeStatus
    TRAJECTORY_ID: Final = "trajectory_id"
    STARTED_AT: Final = "started_at"
    LAST_ACTIVE_AT: Final = "last_active_at"
    TURNS: Final = "turns"
    LAST_INTERACTION: Final = "last_interaction"
    GROUP_ID: Final = "group_id"
    GROUP_SIZE: Final = "group_size"
    ENDED_AT: Final = "ended_at"
    END_REASON: Final = "end_reason"
    STREAM_ID: Final = "stream_id"


class SessionFields:
    """Fields of a header-mode session's pointer hash (`RedisKeys.session`)."""

    EPISODE: Final = "episode"  # the active episode, "" when none
    EPOCH: Final = "epoch"
    COUNT: Final = "count"  # episodes the session has had
    LAST: Final = "last"  # the episode that ended last


class GroupFields:
    """Fields of an episode group's hash (`RedisKeys.group`)."""

    SIZE: Final = "size"
    DONE: Final = "done"  # members published or empty
    CREATED_AT: Final = "created_at"


class TrajectoryGroupFields:
    """Fields of a published trajectory's group record (`RedisKeys.trajectory_group`)."""

    GROUP_ID: Final = "group_id"
    GROUP_SIZE: Final = "group_size"


class CapacityFields:
    """Fields of the capacity hash (`RedisKeys.capacity`)."""

    GRANTS: Final = "grants"  # episodes granted and not yet taken


class TombstoneFields:
    """Fields of a revoked key's tombstone (`RedisKeys.revoked`)."""

    KEY_ID: Final = "key_id"
    KIND: Final = "kind"
    REVOKED_AT: Final = "revoked_at"


class ResponseFields:
    """Fields of a stored Responses response (`RedisKeys.response`)."""

    RESPONSE: Final = "response"
    PARENT: Final = "parent"
    CHAIN: Final = "chain"
    CHAIN_LEN: Final = "chain_len"


class StatsFields:
    """The counters of the stats hash (`RedisKeys.stats`)."""

    OPEN_EPISODES: Final = "open_episodes"
    PUBLISHED: Final = "published"
    EMPTY_EPISODES: Final = "empty_episodes"
    REVOKED_EPISODES: Final = "revoked_episodes"
    CONSUMED: Final = "consumed"
    INTERACTIONS: Final = "interactions"
    JOINED: Final = "joined"
    OUTPUT_TOKENS: Final = "output_tokens"
    EXACT_INTERACTIONS: Final = "exact_interactions"
    LENGTH_MISMATCHES: Final = "length_mismatches"
    REWARD_MICROS: Final = "reward_micros"  # final rewards summed, in millionths
    REWARD_POSITIVE_MICROS: Final = "reward_positive_micros"
    REWARD_NEGATIVE_MICROS: Final = "reward_negative_micros"
    ERRORS: Final = "errors"
    STREAM_MS: Final = "stream_ms"  # the ms part of the last numbered stream id
