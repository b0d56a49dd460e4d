"""slime's rollout function on rollgate (OpenClaw-RL's `generate_rollout_openclaw`, replaced).

    --rollout-function-path rollgate.slime_rollout.generate_rollout

Each call: SetWeightVersion(the version slime trains from), ResumeSubmission (agents' turns
proceed), pull published episodes until `args.rollout_batch_size` groups, PauseSubmission
(slime syncs weights next), and return `RolloutFnTrainOutput(samples, metrics)`. A group is
one call's n samples (a group of one when n = 1, as OpenClaw-RL's), or with
`rollgate_group_by="episode"` every row of one episode (`"episode_group"`: of one
`start_session(group_size=G)` group). Groups with an aborted sample are dropped. slime's
`Sample` and `RolloutFnTrainOutput` are used when slime imports, else dataclasses with the same
fields. Settings: `args.rollgate_*` attributes, else `ROLLGATE_*` variables (docs/training.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from types import ModuleType
from typing import Any, Literal, TypeVar

from rollgate.adapter_settings import AdapterSettings, resolve
from rollgate.episode_rows import EpisodeRow, episode_rows
from rollgate.episodes import (
    Episode,
    EpisodeSource,
    FileSource,
    LiveOptions,
    LiveSource,
    ReplayFinished,
    Unit,
)
from rollgate.scoring import ScoreFn, load_score_fn, scored
from rollgate.trainer_client import TrainerClient

log = logging.getLogger("rollgate.slime")

GroupBy = Literal["call", "episode", "episode_group"]
DEFAULT_GROUP = "slime"
DEFAULT_REWARD_KEY = "score"
PROGRESS_EVERY_S = 30.0
T = TypeVar("T")


def _optional(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


class SampleStatus(Enum):
    """slime's `Sample.Status`."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class SpecInfo:
    """slime's `Sample.SpecInfo` counters (speculative decoding; unused by rollgate)."""

    spec_accept_token_num: int = 0
    spec_draft_token_num: int = 0
    spec_verify_ct: int = 0
    completion_token_num: int = 0


@dataclass
class PrefixCacheInfo:
    """slime's `Sample.PrefixCacheInfo` counters."""

    cached_tokens: int = 0
    total_prompt_tokens: int = 0


@dataclass
class FallbackSample:
    """slime's `slime.utils.types.Sample` fields, for when slime is not importable."""

    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: list[list[int]] | None = None
    remove_sample: bool = False
    status: SampleStatus = SampleStatus.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    generate_function_path: str | None = None
    train_metadata: dict[str, Any] | None = None
    non_generation_time: float = 0.0
    spec_info: SpecInfo = field(default_factory=SpecInfo)
    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)

    Status = SampleStatus


@dataclass
class FallbackTrainOutput:
    """slime's `RolloutFnTrainOutput`."""

    samples: list[list[Any]]
    metrics: dict[str, Any] | None = None


@dataclass
class FallbackEvalOutput:
    """slime's `RolloutFnEvalOutput`."""

    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


_slime_types = _optional("slime.utils.types")
_slime_base = _optional("slime.rollout.base_types")
SLIME_INSTALLED = _slime_types is not None and _slime_base is not None
SAMPLE_CLASS: Any = _slime_types.Sample if SLIME_INSTALLED else FallbackSample  # type: ignore[union-attr]
TRAIN_OUTPUT_CLASS: Any = (
    _slime_base.RolloutFnTrainOutput if SLIME_INSTALLED else FallbackTrainOutput  # type: ignore[union-attr]
)
EVAL_OUTPUT_CLASS: Any = (
    _slime_base.RolloutFnEvalOutput if SLIME_INSTALLED else FallbackEvalOutput  # type: ignore[union-attr]
)


@dataclass(frozen=True, slots=True, kw_only=True)
class SlimeOptions:
    """What the rollout does beyond where rollgate is (from `args.rollgate_*`)."""

    group_by: GroupBy = "call"
    reward_key: str = DEFAULT_REWARD_KEY
    turn_discount: float = 1.0
    pause_timeout_s: float = 30.0
    # None: wait for the batch as long as it takes (OpenClaw-RL's behaviour).
    wait_timeout_s: float | None = None
    # The trainer's own reward per sample (rollgate/scoring.py), before the turn discount.
    score_fn: ScoreFn | None = None


class SlimeRollout:
    """One consumer of rollgate's stream for slime, on its own event loop thread."""

    def __init__(self, settings: AdapterSettings, options: SlimeOptions) -> None:
        self.settings = settings
        self.options = options
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._client: TrainerClient | None = None
        self._source: EpisodeSource | None = None
        self._next_index = 0
        self._next_group = 0
        # The first rollout of a life may set an older version than rollgate holds (slime
        # restarted from a checkpoint: rollout ids start again from it); later ones may not.
        self._rollouts_run = 0
        # Groups made but not returned yet (a batch ended inside an episode).
        self._pending: list[tuple[list[Any], tuple[str, ...]]] = []
        # trajectory id → [unit, number of its groups not returned yet]
        self._owed: OrderedDict[str, list[Any]] = OrderedDict()

    def generate(self, args: Any, rollout_id: int) -> Any:
        """One rollout: version, resume, pull `args.rollout_batch_size` groups, pause."""
        return self._run(self._generate(args, rollout_id))

    def close(self) -> None:
        """Acks what was returned, closes the connection and stops the loop thread."""
        self._run(self._aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _generate(self, args: Any, rollout_id: int) -> Any:
        batch_size = int(args.rollout_batch_size)
        source = await self._ensure_source()
        control = self._client
        version = int(getattr(args, "rollgate_weight_version", None) or rollout_id)
        if control is not None:
            allow_rollback = bool(getattr(args, "rollgate_allow_rollback", None)) or (
                self._rollouts_run == 0
            )
            await control.set_weight_version(version, allow_rollback=allow_rollback)
            self._rollouts_run += 1
            await control.resume_submission()
        dropped = 0
        try:
            deadline = (
                None
                if self.options.wait_timeout_s is None
                else time.monotonic() + self.options.wait_timeout_s
            )
            last_progress = time.monotonic()
            while len(self._pending) < batch_size:
                try:
                    unit = await self._take(source, deadline)
                except ReplayFinished:
                    if self._pending:
                        break
                    raise
                if unit is None:
                    continue
                dropped += self._add(unit, await self._scored(unit))
                if time.monotonic() - last_progress > PROGRESS_EVERY_S:
                    log.info("waiting for episodes: %d/%d groups", len(self._pending), batch_size)
                    last_progress = time.monotonic()
        finally:
            if control is not None:
                await control.pause_submission(self.options.pause_timeout_s)
        batch, self._pending = self._pending[:batch_size], self._pending[batch_size:]
        self._settle(source, batch)
        samples = [group for group, _ in batch]
        samples.sort(key=lambda group: group[0].index if group[0].index is not None else -1)
        return TRAIN_OUTPUT_CLASS(
            samples=samples, metrics=rollout_metrics(samples, version, dropped=dropped)
        )

    async def _take(self, source: EpisodeSource, deadline: float | None) -> Unit | None:
        if deadline is None:
            return await source.take()
        try:
            return await asyncio.wait_for(
                source.take(), timeout=max(0.0, deadline - time.monotonic())
            )
        except TimeoutError:
            raise TimeoutError(
                f"only {len(self._pending)} groups arrived in {self.options.wait_timeout_s:g} s: "
                "are agents running episodes against the gateway?"
            ) from None

    async def _scored(self, unit: Unit) -> Unit:
        score_fn = self.options.score_fn
        if score_fn is None:
            return unit
        return tuple(
            [
                dataclasses.replace(episode, trajectory=await scored(episode.trajectory, score_fn))
                for episode in unit
            ]
        )

    def _add(self, unit: Unit, rows_from: Unit) -> int:
        """The unit's groups (made from `rows_from`, the unit as scored) go to the pending
        list; returns how many groups were dropped."""
        groups = make_groups(
            rows_from,
            sample_rewards=self.options.score_fn is not None,
            group_by=self.options.group_by,
            reward_key=self.options.reward_key,
            turn_discount=self.options.turn_discount,
            include_side_turns=self.settings.include_side_turns,
            first_index=self._next_index,
        )
        self._next_index += sum(len(group) for group in groups)
        kept = without_aborted(groups)
        ids = tuple(episode.trajectory.trajectory_id for episode in unit)
        self._owed[ids[0]] = [unit, len(kept)]
        for group in kept:
            for sample in group:
                sample.group_index = self._next_group
            self._next_group += 1
            self._pending.append((group, ids))
        if not kept:  # nothing of it reaches slime: it is consumed all the same
            self._settle_unit(ids[0])
        return len(groups) - len(kept)

    def _settle(
        self, source: EpisodeSource, batch: Sequence[tuple[list[Any], tuple[str, ...]]]
    ) -> None:
        for _group, ids in batch:
            self._owed[ids[0]][1] -= 1
        for trajectory_id in list(self._owed):
            if self._owed[trajectory_id][1] <= 0:
                self._settle_unit(trajectory_id)

    def _settle_unit(self, trajectory_id: str) -> None:
        """Every group of the unit was returned to slime (or dropped): ack it."""
        unit, _left = self._owed.pop(trajectory_id)
        assert self._source is not None
        self._source.taken(unit)

    async def _ensure_source(self) -> EpisodeSource:
        if self._source is not None:
            return self._source
        settings = self.settings
        episode_group_size = settings.episode_group_size
        if self.options.group_by == "episode_group" and episode_group_size < 2:
            raise ValueError(
                "rollgate_group_by='episode_group' needs rollgate_episode_group_size >= 2 "
                "(the group_size agents pass to start_session)"
            )
        if settings.replay is not None:
            self._source = FileSource(settings.replay, episode_group_size=episode_group_size)
            return self._source
        client = TrainerClient(settings.trainer_address, settings.admin_key)
        await client.__aenter__()
        source = LiveSource(
            client,
            LiveOptions(
                group=settings.group,
                consumer=settings.consumer,
                episode_group_size=episode_group_size,
                grant_capacity=False,
                dump=settings.dump,
                include_history=settings.include_history,
            ),
        )
        await source.start()
        self._client, self._source = client, source
        return source

    async def _aclose(self) -> None:
        if self._source is not None:
            await self._source.aclose()
            self._source = None
        if self._client is not None:
            await self._client.close()
            self._client = None


def make_groups(
    unit: Unit,
    *,
    group_by: GroupBy = "call",
    reward_key: str = DEFAULT_REWARD_KEY,
    turn_discount: float = 1.0,
    include_side_turns: bool = False,
    first_index: int = 0,
    sample_rewards: bool = False,
) -> list[list[Any]]:
    """A unit's samples in groups: per call, per episode, or the whole unit
    (`sample_rewards`: each extra sample has its own reward, a `score_fn`'s)."""
    per_episode: list[list[list[Any]]] = []
    index = first_index
    for episode in unit:
        made = episode_rows(
            episode,
            turn_discount=turn_discount,
            include_side_turns=include_side_turns,
            sample_rewards=sample_rewards,
        )
        calls: OrderedDict[str, list[Any]] = OrderedDict()
        for row in made.rows:
            calls.setdefault(row.call_group, []).append(to_sample(row, episode, index, reward_key))
            index += 1
        per_episode.append(list(calls.values()))
    if group_by == "call":
        groups = [group for episode_groups in per_episode for group in episode_groups]
    elif group_by == "episode":
        groups = [[s for g in episode_groups for s in g] for episode_groups in per_episode]
        groups = [group for group in groups if group]
    else:
        whole = [s for episode_groups in per_episode for g in episode_groups for s in g]
        groups = [whole] if whole else []
    for position, group in enumerate(groups):
        for sample in group:
            sample.group_index = position
    return groups


def without_aborted(groups: Sequence[list[Any]]) -> list[list[Any]]:
    """The groups none of whose samples was aborted (OpenClaw-RL drops the others)."""
    aborted = SAMPLE_CLASS.Status.ABORTED
    return [group for group in groups if not any(s.status == aborted for s in group)]


def to_sample(row: EpisodeRow, episode: Episode, index: int, reward_key: str) -> Any:
    """One row as a slime Sample: prompt + response ids, mask, logprobs, reward, status."""
    training = row.row
    prompt_length = len(row.interaction.prompt_token_ids)
    response_ids = training.input_ids[prompt_length:]
    versions = training.versions[prompt_length:]
    sample = SAMPLE_CLASS(
        index=index,
        prompt=list(row.interaction.messages),
        tokens=list(training.input_ids),
        response=_text(row.output),
        response_length=len(response_ids),
        reward={reward_key: float(training.reward)},
        loss_mask=[0] * len(response_ids) if row.side else [1] * len(response_ids),
        weight_versions=[str(v) for v in dict.fromkeys(versions)],
        rollout_log_probs=list(training.logprobs[prompt_length:]),
        status=_status(row.finish_reason),
        metadata={
            "trajectory_id": episode.trajectory.trajectory_id,
            "stream_id": episode.stream_id,
            "session_id": episode.trajectory.session_id,
            "task_id": episode.trajectory.task_id,
            "interaction_id": row.interaction.interaction_id,
            "sample_index": training.sample_index,
            "call_group": row.call_group,
            "episode_group_id": episode.group_id,
            "turn_type": row.interaction.turn_type,
            "exact_tokens": row.exact_tokens,
            "original_reward": float(training.original_reward),
        },
    )
    if hasattr(sample, "session_id"):
        sample.session_id = episode.trajectory.session_id
    return sample


def _text(output: Mapping[str, Any]) -> str:
    content = output.get("content")
    return content if isinstance(content, str) else ""


def _status(finish_reason: str) -> Any:
    status = SAMPLE_CLASS.Status
    if finish_reason == "abort":
        return status.ABORTED
    if finish_reason == "length":
        return status.TRUNCATED
    return status.COMPLETED


def rollout_metrics(
    groups: Sequence[Sequence[Any]], version: int, *, dropped: int
) -> dict[str, Any]:
    """Reward mean, exact-token ratio, staleness (versions behind the one slime trains from)."""
    samples = [s for group in groups for s in group]
    rewards = [float(next(iter(s.reward.values()))) for s in samples]
    exact = [bool(s.metadata.get("exact_tokens")) for s in samples]
    # Per sample: how many versions the oldest token it was sampled with is behind.
    behind = [
        version - min(int(v) for v in s.weight_versions) for s in samples if s.weight_versions
    ]
    return {
        "rollgate/groups": len(groups),
        "rollgate/samples": len(samples),
        "rollgate/reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        "rollgate/exact_token_ratio": sum(exact) / len(exact) if exact else 0.0,
        "rollgate/staleness_mean": sum(behind) / len(behind) if behind else 0.0,
        "rollgate/staleness_max": max(behind, default=0),
        "rollgate/groups_dropped_aborted": dropped,
    }


# slime calls a function by path, so the rollout lives across calls here, one per settings.
_rollouts: dict[tuple[Any, ...], SlimeRollout] = {}
_rollouts_lock = threading.Lock()


def rollout_for(args: Any, environ: Mapping[str, str] | None = None) -> SlimeRollout:
    """The process's SlimeRollout for these args (created on first use)."""
    settings = resolve(
        default_group=DEFAULT_GROUP,
        config=getattr(args, "rollgate_config", None),
        environ=environ,
        trainer_address=getattr(args, "rollgate_trainer_address", None),
        admin_key=getattr(args, "rollgate_admin_key", None),
        group=getattr(args, "rollgate_group", None),
        consumer=getattr(args, "rollgate_consumer", None),
        episode_group_size=getattr(args, "rollgate_episode_group_size", None),
        include_side_turns=getattr(args, "rollgate_include_side_turns", None),
        include_history=getattr(args, "rollgate_include_history", None),
        replay=getattr(args, "rollgate_replay", None),
        dump=getattr(args, "rollgate_dump", None),
    )
    options = SlimeOptions(
        group_by=getattr(args, "rollgate_group_by", None) or "call",
        reward_key=getattr(args, "reward_key", None) or DEFAULT_REWARD_KEY,
        turn_discount=float(getattr(args, "rollgate_turn_discount", None) or 1.0),
        pause_timeout_s=float(getattr(args, "rollgate_pause_timeout_s", None) or 30.0),
        wait_timeout_s=getattr(args, "rollgate_wait_timeout_s", None),
        score_fn=load_score_fn(getattr(args, "rollgate_score_fn", None)),
    )
    if options.group_by not in ("call", "episode", "episode_group"):
        raise ValueError(
            f"rollgate_group_by must be call, episode or episode_group, not {options.group_by!r}"
        )
    key = (settings, options)
    with _rollouts_lock:
        if key not in _rollouts:
            _rollouts[key] = SlimeRollout(settings, options)
        return _rollouts[key]


def generate_rollout(
    args: Any, rollout_id: int, data_buffer: Any = None, evaluation: bool = False
) -> Any:
    """slime's rollout function: `RolloutFnTrainOutput(samples=list[list[Sample]], metrics)`.

    With `evaluation=True` there is nothing to evaluate on (online episodes are training
    data): an empty `RolloutFnEvalOutput`.
    """
    if evaluation:
        return EVAL_OUTPUT_CLASS(data={}, metrics={"rollgate/eval": "online: no eval set"})
    return rollout_for(args).generate(args, rollout_id)


def close_rollouts() -> None:
    """Closes every rollout of the process (acks what was returned)."""
    with _rollouts_lock:
        rollouts = list(_rollouts.values())
        _rollouts.clear()
    for rollout in rollouts:
        rollout.close()
