"""The dataproxy's Lua scripts (`lua/*.lua`), one typed wrapper each: a call dataclass in (its
KEYS and ARGV by name, in the script's order), a parsed reply out (an enum status and a
dataclass). Loaded once by the shared loader (services/runtime/redis_scripts.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.runtime.redis_scripts import (
    EACH,
    KEY,
    Script,
    ScriptCall,
    ScriptStatus,
    as_bool,
    text_of,
)

# -- session transitions: begin and append a turn, set a reward, bind and publish episodes --


@dataclass(slots=True, kw_only=True)  # not frozen: built every turn (half the cost)
class BeginTurnCall(ScriptCall):
    """begin_turn.lua: resolves the key's episode and takes the turn's in-flight lease."""

    SCRIPT = "begin_turn"
    key: str = field(metadata=KEY)
    paused: str = field(metadata=KEY)
    in_flight: str = field(metadata=KEY)
    weight_version: str = field(metadata=KEY)
    session: str = field(metadata=KEY)  # the session pointer (header mode; else any key)
    idle: str = field(metadata=KEY)
    episode_turns: str = field(metadata=KEY)
    token: str
    lease_until: float
    now: float
    session_id: str
    digest: str


class BeginTurn(ScriptStatus):
    """begin_turn.lua's status."""

    OK = "ok"
    UNKNOWN = "unknown"
    NOT_ACTIVE = "not_active"
    NEEDS_SESSION = "needs_session"
    NEW = "new"
    PAUSED = "paused"


@dataclass(slots=True, kw_only=True)  # not frozen: built every turn (half the cost)
class BeganTurn:
    """begin_turn.lua's reply; `epoch` is the session's episode count when NEW."""

    status: BeginTurn
    key_id: str
    episode: str
    epoch: int
    weight_version: int
    mode: str

    @classmethod
    def parse(cls, reply: list[Any]) -> BeganTurn:
        """From `{status, key_id, episode, epoch, weight_version, mode}`."""
        status, key_id, episode, epoch, version, mode = reply
        return cls(
            status=BeginTurn.parse(status),
            key_id=text_of(key_id),
            episode=text_of(episode),
            epoch=int(epoch),
            weight_version=int(version),
            mode=text_of(mode),
        )


@dataclass(slots=True, kw_only=True)  # not frozen: built every turn (half the cost)
class AppendTurnCall(ScriptCall):
    """append_turn.lua: appends a turn to its still-active episode, releases its lease."""

    SCRIPT = "append_turn"
    key: str = field(metadata=KEY)
    episode_hash: str = field(metadata=KEY)
    turns: str = field(metadata=KEY)
    interaction_index: str = field(metadata=KEY)
    idle: str = field(metadata=KEY)
    in_flight: str = field(metadata=KEY)
    weight_version: str = field(metadata=KEY)
    episode_turns: str = field(metadata=KEY)
    episode: str
    epoch: int
    interaction_id: str
    record: bytes
    now: float
    idle_until: float
    idle_member: str
    lease_token: str
    expected_version: int  # the record's weight_version_end; -1: not checked
    mode: str


class AppendTurn(ScriptStatus):
    """append_turn.lua's status."""

    OK = "ok"
    DUPLICATE = "duplicate"
    ENDED = "ended"
    VERSION = "version"


@dataclass(slots=True, kw_only=True)  # not frozen: built every turn (half the cost)
class AppendedTurn:
    """append_turn.lua's reply: the turn's index (the current weight version on VERSION)."""

    status: AppendTurn
    value: int

    @classmethod
    def parse(cls, reply: list[Any]) -> AppendedTurn:
        """From `{status, index_or_version}`."""
        status, value = reply
        return cls(status=AppendTurn.parse(status), value=int(value))


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleaseTurnCall(ScriptCall):
    """release_turn.lua: drops a turn's lease that ends without its append."""

    SCRIPT = "release_turn"
    in_flight: str = field(metadata=KEY)
    episode_turns: str = field(metadata=KEY)
    token: str
    member: str  # the episode's `digest/episode` ('' when unknown)


@dataclass(frozen=True, slots=True, kw_only=True)
class SetRewardCall(ScriptCall):
    """set_reward.lua: stores the reward of one interaction (the last when none is named)."""

    SCRIPT = "set_reward"
    key: str = field(metadata=KEY)
    episode_hash: str = field(metadata=KEY)
    rewards: str = field(metadata=KEY)
    interaction_index: str = field(metadata=KEY)
    episode: str
    epoch: int
    interaction_id: str
    reward: float
    mode: str  # active | episode | held


class SetReward(ScriptStatus):
    """set_reward.lua's status."""

    OK = "ok"
    NOT_ACTIVE = "not_active"
    NO_INTERACTION = "no_interaction"
    NOT_FOUND = "not_found"


@dataclass(frozen=True, slots=True, kw_only=True)
class RewardSet:
    """set_reward.lua's reply: the interaction rewarded and whether it is the episode's last."""

    status: SetReward
    interaction_id: str
    is_last: bool

    @classmethod
    def parse(cls, reply: list[Any]) -> RewardSet:
        """From `{status, interaction_id, is_last}`."""
        status, found, is_last = reply
        return cls(
            status=SetReward.parse(status),
            interaction_id=text_of(found),
            is_last=bool(int(is_last)),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class BindMember(ScriptCall):
    """One episode bind_episode.lua binds: its key hash and episode hash, and its names."""

    key: str = field(metadata=KEY)
    episode_hash: str = field(metadata=KEY)
    key_id: str
    task_id: str
    episode: str
    trajectory_id: str
    digest: str
    session_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class BindEpisodeCall(ScriptCall):
    """bind_episode.lua: binds the members' episodes if capacity allows, all or none."""

    SCRIPT = "bind_episode"
    stats: str = field(metadata=KEY)
    capacity: str = field(metadata=KEY)
    weight_version: str = field(metadata=KEY)
    idle: str = field(metadata=KEY)
    slot: str = field(metadata=KEY)  # the group hash, or (header mode) the session pointer
    mode: str  # new | next | header
    now: float
    max_head_offpolicyness: int  # -1: no staleness bound
    batch_size: int
    idle_timeout_s: float
    group_id: str
    group_size: int
    group_ttl_s: int
    members: Sequence[BindMember] = field(metadata=EACH)


class BindEpisode(ScriptStatus):
    """bind_episode.lua's status."""

    OK = "ok"
    EXISTS = "exists"
    UNKNOWN = "unknown"
    BUSY = "busy"
    FULL = "full"


@dataclass(frozen=True, slots=True, kw_only=True)
class EpisodeBound:
    """bind_episode.lua's reply: the first member's epoch (on FULL, the capacity left)."""

    status: BindEpisode
    value: int

    @classmethod
    def parse(cls, reply: list[Any]) -> EpisodeBound:
        """From `{status, epoch_or_capacity}`."""
        status, value = reply
        return cls(status=BindEpisode.parse(status), value=int(value))


@dataclass(frozen=True, slots=True, kw_only=True)
class PublishCall(ScriptCall):
    """publish.lua: publishes the episode's trajectory (or marks it empty), or holds it."""

    SCRIPT = "publish"
    key: str = field(metadata=KEY)
    episode_hash: str = field(metadata=KEY)
    turns: str = field(metadata=KEY)
    rewards: str = field(metadata=KEY)
    interaction_index: str = field(metadata=KEY)
    trajectories: str = field(metadata=KEY)
    stats: str = field(metadata=KEY)
    idle: str = field(metadata=KEY)
    awaiting_reward: str = field(metadata=KEY)
    trajectory_group: str = field(metadata=KEY)
    group: str = field(metadata=KEY)  # the group hash (any key without a group)
    session: str = field(metadata=KEY)  # the session pointer (header mode; else any key)
    episode_turns: str = field(metadata=KEY)
    recent_trajectories: str = field(metadata=KEY)
    episode: str
    epoch: int
    turn_count: int
    trajectory_id: str
    codec: str
    data: bytes  # b"" when the caller wants a hold
    now: float
    end_reason: str
    ttl_s: int
    member: str
    interactions: int
    joined: int
    hold_until: float  # 0: publish
    group_id: str
    group_size: int
    mode: str
    summary: bytes
    recent_kept: int


class Publish(ScriptStatus):
    """publish.lua's status."""

    PUBLISHED = "published"
    EMPTY = "empty"
    HELD = "held"
    MISSING = "missing"
    STALE = "stale"
    RETRY = "retry"


@dataclass(frozen=True, slots=True, kw_only=True)
class Published:
    """publish.lua's reply."""

    status: Publish
    stream_id: str
    trajectory_id: str
    turns: int

    @classmethod
    def parse(cls, reply: list[Any]) -> Published:
        """From `{status, stream_id, trajectory_id, turns}`."""
        status, stream_id, trajectory_id, turns = reply
        return cls(
            status=Publish.parse(status),
            stream_id=text_of(stream_id),
            trajectory_id=text_of(trajectory_id),
            turns=int(turns),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimDueCall(ScriptCall):
    """claim_due.lua: claims due members of a deadline zset for `lease_s`."""

    SCRIPT = "claim_due"
    zset: str = field(metadata=KEY)
    now: float
    lease_s: float
    limit: int


def members_of(reply: list[Any]) -> list[str]:
    """claim_due.lua's reply: the members claimed."""
    return [text_of(m) for m in reply]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleaseMarkerCall(ScriptCall):
    """release_marker.lua: deletes a marker still holding `token`."""

    SCRIPT = "release_marker"
    marker: str = field(metadata=KEY)
    token: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ExtendMarkerCall(ScriptCall):
    """extend_marker.lua: extends a marker still holding `token` by `ttl_ms`."""

    SCRIPT = "extend_marker"
    marker: str = field(metadata=KEY)
    token: str
    ttl_ms: int


# -- revocation ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RevokeCandidate(ScriptCall):
    """One episode revoke_key.lua may discard, with the keys it touches."""

    episode_hash: str = field(metadata=KEY)
    turns: str = field(metadata=KEY)
    rewards: str = field(metadata=KEY)
    interaction_index: str = field(metadata=KEY)
    group: str = field(metadata=KEY)  # the group hash (any key without a group)
    session: str = field(metadata=KEY)  # the session pointer (header mode; else any key)
    episode: str
    group_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RevokeKeyCall(ScriptCall):
    """revoke_key.lua: tombstones a session key and discards its open episodes."""

    SCRIPT = "revoke_key"
    key: str = field(metadata=KEY)
    tombstone: str = field(metadata=KEY)
    stats: str = field(metadata=KEY)
    idle: str = field(metadata=KEY)
    awaiting_reward: str = field(metadata=KEY)
    episode_turns: str = field(metadata=KEY)
    digest: str
    now: float
    ttl_s: int
    default_kind: str  # recorded when the key has no mode
    candidates: Sequence[RevokeCandidate] = field(metadata=EACH)


@dataclass(frozen=True, slots=True, kw_only=True)
class RevokeAccessKeyCall(ScriptCall):
    """revoke_access_key.lua: an issued admin or trainer key leaves the valid set."""

    SCRIPT = "revoke_access_key"
    access_keys: str = field(metadata=KEY)
    tombstone: str = field(metadata=KEY)
    digest: str
    now: float


class RevokeKey(ScriptStatus):
    """revoke_key.lua's and revoke_access_key.lua's status."""

    REVOKED = "revoked"
    ALREADY = "already"
    UNKNOWN = "unknown"
    RETRY = "retry"


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyRevoked:
    """revoke_key.lua's reply (`discarded` and `missing` are empty for revoke_access_key.lua);
    on RETRY `missing` names an episode the script was not given."""

    status: RevokeKey
    key_id: str
    kind: str
    discarded: int = 0
    missing: str = ""

    @classmethod
    def parse(cls, reply: list[Any]) -> KeyRevoked:
        """From `{status, key_id, kind[, discarded, missing]}`."""
        status, key_id, kind, *rest = reply
        return cls(
            status=RevokeKey.parse(status),
            key_id=text_of(key_id),
            kind=text_of(kind),
            discarded=int(rest[0]) if rest else 0,
            missing=text_of(rest[1]) if len(rest) > 1 else "",
        )


# -- the trajectory stream, the weight version, the console's history ------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class AckCall(ScriptCall):
    """ack_trajectory.lua: XACKs stream ids in a group and counts them as consumed."""

    SCRIPT = "ack_trajectory"
    stream: str = field(metadata=KEY)
    stats: str = field(metadata=KEY)
    group: str
    stream_ids: Sequence[str] = field(metadata=EACH)


@dataclass(frozen=True, slots=True, kw_only=True)
class SetVersionCall(ScriptCall):
    """set_version.lua: moves the weight version (back only with `allow_rollback`)."""

    SCRIPT = "set_version"
    weight_version: str = field(metadata=KEY)
    epoch: str = field(metadata=KEY)
    version: int
    allow_rollback: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class VersionSet:
    """set_version.lua's reply: whether it moved, the version now, the one before."""

    moved: bool
    current: int
    previous: int

    @classmethod
    def parse(cls, reply: list[Any]) -> VersionSet:
        """From `{1, version, previous}` or `{0, current}`."""
        moved, current, *rest = reply
        return cls(
            moved=bool(int(moved)), current=int(current), previous=int(rest[0]) if rest else 0
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TrimStreamCall(ScriptCall):
    """trim_stream.lua: trims what every consumer group has acknowledged."""

    SCRIPT = "trim_stream"
    stream: str = field(metadata=KEY)
    max_len_without_groups: int  # 0: never trim without groups


@dataclass(frozen=True, slots=True, kw_only=True)
class TrimResult:
    """What one trim pass removed, and by which rule."""

    trimmed: int
    min_id: str  # the MINID used, "" when none
    mode: str  # "groups" | "maxlen" | "" (nothing to trim)

    @classmethod
    def parse(cls, reply: list[Any]) -> TrimResult:
        """From `{trimmed, min_id, mode}`."""
        trimmed, min_id, mode = reply
        return cls(trimmed=int(trimmed), min_id=text_of(min_id), mode=text_of(mode))


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamGroupsCall(ScriptCall):
    """stream_groups.lua: the stream's length and each consumer group's position."""

    SCRIPT = "stream_groups"
    stream: str = field(metadata=KEY)


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamGroups:
    """stream_groups.lua's reply: per group `[name, pending, last_delivered, consumers,
    oldest_pending, next_undelivered]`, as Redis sent them."""

    length: int
    groups: list[Sequence[Any]]

    @classmethod
    def parse(cls, reply: list[Any]) -> StreamGroups:
        """From `{length, groups}`."""
        length, groups = reply
        return cls(length=int(length), groups=list(groups))


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteHistoryCall(ScriptCall):
    """write_history.lua: this interval's snapshot, unless a replica wrote it already."""

    SCRIPT = "write_history"
    history: str = field(metadata=KEY)
    slot_key: str = field(metadata=KEY)
    slot: int
    now: float
    snapshot: bytes
    keep_after: float


# -- conversations, turn leases and stored responses (every one checks the key exists) --------


class ConversationStatus(ScriptStatus):
    """The status of a conversation script (each returns some of these)."""

    OK = "ok"
    UNKNOWN_KEY = "unknown_key"
    NOT_HOLDER = "not_holder"
    GRANTED = "granted"
    HELD = "held"
    CLAIMED = "claimed"
    TAKEN = "taken"
    NOT_FOUND = "not_found"
    PARENT_NOT_FOUND = "parent_not_found"


@dataclass(frozen=True, slots=True, kw_only=True)
class ConversationReply:
    """A conversation script's reply `{status[, value, items...]}`: `value` is a count, a time,
    an id or a response (bytes, as Redis sent it), `items` the listed messages or items."""

    status: ConversationStatus
    value: Any
    items: list[bytes]

    @classmethod
    def parse(cls, reply: list[Any]) -> ConversationReply:
        """From `{status, value, items...}`."""
        status, *rest = reply
        return cls(
            status=ConversationStatus.parse(status),
            value=rest[0] if rest else None,
            items=list(rest[1:]),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class GetMessagesCall(ScriptCall):
    """get_messages.lua: {ok, total, the last `limit` messages...} (all when limit <= 0)."""

    SCRIPT = "get_messages"
    key: str = field(metadata=KEY)
    conversation: str = field(metadata=KEY)
    limit: int


@dataclass(frozen=True, slots=True, kw_only=True)
class AppendMessagesCall(ScriptCall):
    """append_messages.lua: {ok, total} | {not_holder} (`holder` set and not the lease's)."""

    SCRIPT = "append_messages"
    key: str = field(metadata=KEY)
    conversation: str = field(metadata=KEY)
    lease: str = field(metadata=KEY)
    holder: str
    ttl_s: int
    messages: Sequence[bytes] = field(metadata=EACH)


@dataclass(frozen=True, slots=True, kw_only=True)
class ResetConversationCall(ScriptCall):
    """reset_conversation.lua: {ok, messages dropped}."""

    SCRIPT = "reset_conversation"
    key: str = field(metadata=KEY)
    conversation: str = field(metadata=KEY)


@dataclass(frozen=True, slots=True, kw_only=True)
class AcquireLeaseCall(ScriptCall):
    """acquire_turn_lease.lua: {granted, 0} | {held, the lease's ms left}."""

    SCRIPT = "acquire_turn_lease"
    key: str = field(metadata=KEY)
    lease: str = field(metadata=KEY)
    holder: str
    lease_ms: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleaseLeaseCall(ScriptCall):
    """release_turn_lease.lua: 1 when `holder` held the lease and released it."""

    SCRIPT = "release_turn_lease"
    lease: str = field(metadata=KEY)
    holder: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimRunCall(ScriptCall):
    """claim_run.lua: {claimed, run_id} | {taken, the first run's id}."""

    SCRIPT = "claim_run"
    key: str = field(metadata=KEY)
    claim: str = field(metadata=KEY)
    run_id: str
    ttl_ms: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PutResponseCall(ScriptCall):
    """put_response.lua: {ok, chain length} | {parent_not_found}."""

    SCRIPT = "put_response"
    key: str = field(metadata=KEY)
    response: str = field(metadata=KEY)
    parent: str = field(metadata=KEY)
    chain: str = field(metadata=KEY)
    parent_id: str
    ttl_s: int
    response_json: bytes
    items: Sequence[bytes] = field(metadata=EACH)


@dataclass(frozen=True, slots=True, kw_only=True)
class GetResponseCall(ScriptCall):
    """get_response.lua: {ok, response json, chain items... (with `include_chain`)} |
    {not_found}."""

    SCRIPT = "get_response"
    key: str = field(metadata=KEY)
    response: str = field(metadata=KEY)
    include_chain: bool


# -- what the session store runs, loaded once --------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Scripts:
    """Every session transition the dataproxy makes, one script each."""

    bind_episode: Script[BindEpisodeCall, EpisodeBound]
    append_turn: Script[AppendTurnCall, AppendedTurn]
    set_reward: Script[SetRewardCall, RewardSet]
    publish: Script[PublishCall, Published]
    release_marker: Script[ReleaseMarkerCall, bool]
    extend_marker: Script[ExtendMarkerCall, bool]
    begin_turn: Script[BeginTurnCall, BeganTurn]
    claim_due: Script[ClaimDueCall, list[str]]
    release_turn: Script[ReleaseTurnCall, bool]

    @classmethod
    def load(cls) -> Scripts:
        """Reads all the scripts."""
        return cls(
            bind_episode=Script.load(BindEpisodeCall, EpisodeBound.parse),
            append_turn=Script.load(AppendTurnCall, AppendedTurn.parse),
            set_reward=Script.load(SetRewardCall, RewardSet.parse),
            publish=Script.load(PublishCall, Published.parse),
            release_marker=Script.load(ReleaseMarkerCall, as_bool),
            extend_marker=Script.load(ExtendMarkerCall, as_bool),
            begin_turn=Script.load(BeginTurnCall, BeganTurn.parse),
            claim_due=Script.load(ClaimDueCall, members_of),
            release_turn=Script.load(ReleaseTurnCall, as_bool),
        )
