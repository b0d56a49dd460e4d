"""AReaL's online workflow on rollgate: a `RolloutWorkflow` in place of `OpenAIProxyWorkflow`.

    trainer = PPOTrainer(config)
    attach_weight_sync(trainer.rollout, WeightSync.from_config(config_path))
    trainer.train(workflow="rollgate.areal_workflow.RollgateWorkflow",
                  workflow_kwargs={"config": config_path})

`arun_episode(engine, data)` grants rollgate capacity for what the call will consume (AReaL's
staleness manager decided that it may run), waits for the next published episode, and returns
what `OpenAIProxyWorkflow(mode="online")` returns: interaction id → interaction whose
`to_tensor_dict()` is one row ([1, L]) with AReaL's keys and dtypes (docs/training.md, *AReaL*),
or None when the episode had nothing to train on. With AReaL installed the class subclasses its
`RolloutWorkflow` and the values are its `InteractionWithTokenLogpReward`; without it the same
interface is duck-typed. Tensors are torch tensors when torch imports, numpy arrays otherwise.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal

from rollgate.adapter_settings import AdapterSettings, resolve
from rollgate.episode_rows import EpisodeRow, episode_rows
from rollgate.episodes import (
    Episode,
    EpisodeSource,
    FileSource,
    LiveOptions,
    LiveSource,
    SharedSources,
    SourceIdentity,
    Unit,
)
from rollgate.scoring import ScoreFn, load_score_fn, scored
from rollgate.tensors import AREAL_DTYPES, Style
from rollgate.trainer_client import PauseResult, TrainerClient, TrainerControl, TrainerStats

TensorKeys = Literal["areal1", "areal2"]
DEFAULT_GROUP = "areal"
# AReaL 1.x (the PyPI wheel) builds these keys; the 2.x repo adds turn_ids, original_rewards.
AREAL1_KEYS = ("input_ids", "loss_mask", "logprobs", "versions", "attention_mask", "rewards")
AREAL2_KEYS = (*AREAL1_KEYS, "turn_ids", "original_rewards")
# dtype per key, as AReaL's InteractionWithTokenLogpReward.to_tensor_dict makes them.
DTYPES = AREAL_DTYPES


def _optional(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


_workflow_api = _optional("areal.api.workflow_api")
_areal_types = _optional("areal.experimental.openai.types") if _workflow_api else None
_torch = _optional("torch")
AREAL_INSTALLED = _workflow_api is not None and _areal_types is not None
_WorkflowBase: type = _workflow_api.RolloutWorkflow if AREAL_INSTALLED else object  # type: ignore[union-attr]


class StalenessConflict(RuntimeError):
    """rollgate's own staleness bound is configured while AReaL's staleness manager grants."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RowInfo:
    """Where an interaction's row came from, for grouping and deduplication."""

    # The G rows of one call share it (`<trajectory_id>/<index>`); with episode groups, the
    # episode group's id.
    group_id: str
    # Which sample of the call (0: the answer the agent received).
    sample_index: int
    trajectory_id: str
    stream_id: str
    session_id: str
    # The episode group (`start_session(group_size=G)`), "" without one.
    episode_group_id: str
    turn_type: str
    exact_tokens: bool


@dataclass(kw_only=True)
class DuckInteraction:
    """AReaL's interaction interface without AReaL: `to_tensor_dict()`, `reward`, ids, messages."""

    reward: float | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    output_message_list: list[dict[str, Any]] | None = None
    _cache: dict[str, Any] | None = None
    _interaction_id: str | None = None
    rollgate: RowInfo | None = None
    parent: Any = None
    chat_template_type: str = "hf"

    @property
    def interaction_id(self) -> str | None:
        """The id the client saw (`#k` appended for sample k > 0)."""
        return self._interaction_id

    @property
    def has_tensor_data(self) -> bool:
        """Always true: rollgate records token ids."""
        return self._cache is not None

    def to_tensor_dict(self) -> dict[str, Any]:
        """The row's tensors, each with a leading batch dimension of 1."""
        assert self._cache is not None
        return self._cache


def _interaction_class() -> type:
    """AReaL's InteractionWithTokenLogpReward with a `rollgate` field, else DuckInteraction."""
    if _areal_types is None:
        return DuckInteraction
    base: type = _areal_types.InteractionWithTokenLogpReward

    @dataclass
    class RollgateInteraction(base):  # type: ignore[misc]
        """AReaL's interaction, built from a rollgate row; `rollgate` says where it came from."""

        rollgate: RowInfo | None = None

    return RollgateInteraction


INTERACTION_CLASS = _interaction_class()


def areal_major_version() -> int | None:
    """The installed AReaL's major version, None when it is not installed."""
    if not AREAL_INSTALLED:
        return None
    version = _optional("areal.version")
    text = str(getattr(version, "__version__", "1"))
    try:
        return int(text.split(".", 1)[0])
    except ValueError:
        return None


class RollgateWorkflow(_WorkflowBase):  # type: ignore[misc]
    """AReaL's `RolloutWorkflow` over rollgate's published episodes."""

    def __init__(
        self,
        *,
        config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
        trainer_address: str | None = None,
        admin_key: str | None = None,
        group: str | None = None,
        consumer: str | None = None,
        style: Style | None = None,
        discount: float | None = None,
        episode_group_size: int | None = None,
        include_side_turns: bool | None = None,
        include_history: bool | None = None,
        drop_retry_orphans: bool = False,
        score_fn: ScoreFn | str | None = None,
        replay: str | None = None,
        dump: str | None = None,
        tensor_keys: TensorKeys | None = None,
        tensor_backend: Literal["torch", "numpy"] | None = None,
        check_staleness: bool = True,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.settings: AdapterSettings = resolve(
            default_group=DEFAULT_GROUP,
            config=config,
            environ=environ,
            trainer_address=trainer_address,
            admin_key=admin_key,
            group=group,
            consumer=consumer,
            style=style,
            discount=discount,
            episode_group_size=episode_group_size,
            include_side_turns=include_side_turns,
            include_history=include_history,
            replay=replay,
            dump=dump,
        )
        self.drop_retry_orphans = drop_retry_orphans
        # The trainer's own reward per row (rollgate/scoring.py), before the turn discount.
        self.score_fn = load_score_fn(score_fn)
        major = areal_major_version()
        self.tensor_keys: TensorKeys = tensor_keys or (
            "areal1" if major is not None and major < 2 else "areal2"
        )
        self.tensor_backend = tensor_backend or ("torch" if _torch is not None else "numpy")
        if self.tensor_backend == "torch" and _torch is None:
            raise ImportError("tensor_backend='torch' needs torch: pip install torch")
        self._source: EpisodeSource | None = None
        self._start_lock: asyncio.Lock | None = None
        # AReaL makes one object per task: the first opens the source, the others share it.
        if (
            check_staleness
            and self.settings.replay is None
            and not SOURCES.is_open(self.source_identity)
        ):
            with TrainerControl(self.settings.trainer_address, self.settings.admin_key) as tc:
                refuse_own_staleness_bound(tc.stats())

    @property
    def source_identity(self) -> SourceIdentity:
        """Which of the process's shared sources this workflow reads."""
        settings = self.settings
        if settings.replay is not None:
            return ("replay", settings.replay)
        return ("live", settings.trainer_address, settings.group, settings.consumer)

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, Any] | None:
        """The next published episode (or episode group) as AReaL's interactions; None when it
        has nothing to train on (AReaL then rejects it and starts another call)."""
        source = await self._ensure_source()
        unit = await source.take()
        if unit is None:
            return None
        try:
            interactions = self.interactions(await self.scored(unit))
        except BaseException:
            source.give_back(unit)
            raise
        # Handed to AReaL as this call returns: acked in the background from here on.
        source.taken(unit)
        if not interactions:
            return None
        _record_reward(next(reversed(interactions.values())).reward)
        return interactions

    async def scored(self, unit: Unit) -> Unit:
        """The unit with `score_fn`'s rewards (as it is without one)."""
        if self.score_fn is None:
            return unit
        score_fn = self.score_fn
        return tuple(
            [
                dataclasses.replace(episode, trajectory=await scored(episode.trajectory, score_fn))
                for episode in unit
            ]
        )

    def interactions(self, unit: Unit) -> dict[str, Any]:
        """A unit's rows as AReaL's interaction dict, in row order (call groups consecutive)."""
        out: dict[str, Any] = {}
        for episode in unit:
            made = episode_rows(
                episode,
                style="concat" if self.settings.style == "concat" else "individual",
                turn_discount=self.settings.discount,
                include_side_turns=self.settings.include_side_turns,
                drop_retry_orphans=self.drop_retry_orphans,
                sample_rewards=self.score_fn is not None,
            )
            for row in made.rows:
                out[row.key] = self._interaction(row, episode)
        return out

    async def aclose(self) -> None:
        """Lets go of the shared source: the last workflow to let go acks what was taken and
        closes the connection. AReaL never calls it (its per-task objects keep the source
        open): at the end of training, `await close_sources()`."""
        if self._source is not None:
            self._source = None
            await SOURCES.release(self.source_identity)

    def _interaction(self, item: EpisodeRow, episode: Episode) -> Any:
        row = item.row
        tensors = self._tensors(item)
        info = RowInfo(
            group_id=episode.group_id if self.settings.episode_group_size > 1 else item.call_group,
            sample_index=row.sample_index,
            trajectory_id=episode.trajectory.trajectory_id,
            stream_id=episode.stream_id,
            session_id=episode.trajectory.session_id,
            episode_group_id=episode.group_id,
            turn_type=item.interaction.turn_type,
            exact_tokens=item.exact_tokens,
        )
        return INTERACTION_CLASS(
            reward=float(row.reward),
            messages=list(item.interaction.messages),
            output_message_list=[dict(item.output)],
            _cache=tensors,
            _interaction_id=item.key,
            rollgate=info,
        )

    def _tensors(self, item: EpisodeRow) -> dict[str, Any]:
        row = item.row
        values: dict[str, Any] = {
            "input_ids": row.input_ids,
            "loss_mask": row.loss_mask,
            "logprobs": row.logprobs,
            "versions": row.versions,
            "attention_mask": [True] * len(row.input_ids),
            "rewards": [row.reward],
            "turn_ids": row.turn_ids,
            "original_rewards": [row.original_reward],
        }
        keys = AREAL1_KEYS if self.tensor_keys == "areal1" else AREAL2_KEYS
        return {key: self._tensor(values[key], key) for key in keys}

    def _tensor(self, values: list[Any], key: str) -> Any:
        per_row = key not in ("rewards", "original_rewards")
        if self.tensor_backend == "torch":
            assert _torch is not None
            tensor = _torch.tensor(values, dtype=getattr(_torch, DTYPES[key]))
            return tensor.unsqueeze(0) if per_row else tensor
        import numpy as np

        array = np.asarray(values, dtype=DTYPES[key])
        return array[np.newaxis, :] if per_row else array

    async def _ensure_source(self) -> EpisodeSource:
        if self._source is not None:
            return self._source
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._source is None:
                settings = self.settings
                how = (settings.episode_group_size, settings.dump, settings.include_history)
                self._source = await SOURCES.acquire(self.source_identity, how, self._open_source)
        return self._source

    async def _open_source(self) -> tuple[EpisodeSource, Callable[[], Awaitable[None]]]:
        settings = self.settings
        if settings.replay is not None:
            replay = FileSource(settings.replay, episode_group_size=settings.episode_group_size)
            return replay, replay.aclose
        client = TrainerClient(settings.trainer_address, settings.admin_key)
        await client.__aenter__()
        try:
            refuse_own_staleness_bound(await client.stats())
            source = LiveSource(
                client,
                LiveOptions(
                    group=settings.group,
                    consumer=settings.consumer,
                    episode_group_size=settings.episode_group_size,
                    grant_capacity=True,
                    dump=settings.dump,
                    include_history=settings.include_history,
                ),
            )
            await source.start()
        except BaseException:
            await client.close()
            raise

        async def close() -> None:
            try:
                await source.aclose()
            finally:
                await client.close()

        return source, close


# The process's sources: AReaL's per-task workflow objects share them (rollgate/episodes.py).
SOURCES = SharedSources()


async def close_sources() -> None:
    """Closes the sources every RollgateWorkflow of this event loop read (acks what was taken):
    call it once training ends, on the loop AReaL ran the workflows on."""
    await SOURCES.close_all()


def with_rollgate_section(config_cls: type) -> type:
    """AReaL's config class (PPOConfig, GRPOConfig, …) plus a `rollgate:` mapping, so that
    `load_expr_config(argv, with_rollgate_section(PPOConfig))` accepts the section (AReaL's
    structured config refuses keys it does not know)."""

    @dataclass
    class WithRollgate(config_cls):  # type: ignore[misc]
        rollgate: dict[str, Any] = field(default_factory=dict)

    WithRollgate.__name__ = WithRollgate.__qualname__ = config_cls.__name__
    return WithRollgate


def refuse_own_staleness_bound(stats: TrainerStats) -> None:
    """Raises StalenessConflict when rollgate's own staleness bound is configured."""
    if stats.max_head_offpolicyness is None:
        return
    raise StalenessConflict(
        "rollgate's own staleness bound is configured (max_head_offpolicyness="
        f"{stats.max_head_offpolicyness}, batch_size={stats.staleness_batch_size}), but with "
        "RollgateWorkflow AReaL's staleness manager is the one authority: each arun_episode "
        "grants rollgate capacity for the episode it consumes. Remove the bound from "
        "rollgate's configuration (ROLLGATE_MAX_HEAD_OFFPOLICYNESS, dataproxy."
        "max_head_offpolicyness, or rollout.max_head_offpolicyness in the file `rollgate up "
        "--config` reads) and restart rollgate's dataproxy."
    )


def _record_reward(reward: float | None) -> None:
    """AReaL's rollout stats get the episode's last reward, as OpenAIProxyWorkflow records."""
    if not AREAL_INSTALLED or reward is None:
        return
    context = _optional("areal.infra.workflow_context")
    stats = _optional("areal.utils.stats_tracker")
    if context is None or stats is None:
        return
    stats.get(context.stat_scope()).scalar(reward=reward)


class WeightSync:
    """AReaL's weight-update step reaching rollgate: pause, version, resume (synchronous)."""

    def __init__(
        self, trainer_address: str, admin_key: str, *, pause_timeout_s: float = 30.0
    ) -> None:
        self._control = TrainerControl(trainer_address, admin_key)
        self.pause_timeout_s = pause_timeout_s
        self.last_pause: PauseResult | None = None
        # AReaL's first set_version after a start is its checkpoint's (recover): it may be
        # lower than what the crashed run reached. Later ones only move forward.
        self._versions_set = 0

    @classmethod
    def from_config(
        cls,
        config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
        *,
        environ: Mapping[str, str] | None = None,
        pause_timeout_s: float = 30.0,
    ) -> WeightSync:
        """The Trainer address and key as RollgateWorkflow finds them."""
        settings = resolve(default_group=DEFAULT_GROUP, config=config, environ=environ)
        return cls(settings.trainer_address, settings.admin_key, pause_timeout_s=pause_timeout_s)

    def pause(self) -> PauseResult:
        """New agent turns wait; returns once running turns finished (or the timeout)."""
        self.last_pause = self._control.pause_submission(self.pause_timeout_s)
        return self.last_pause

    def resume(self) -> None:
        """Agent turns proceed again."""
        self._control.resume_submission()

    def set_version(self, version: int, *, allow_rollback: bool | None = None) -> int:
        """Later tokens are stamped with `version`. A version lower than rollgate's current
        one is accepted on this object's first call (a trainer restarted from an older
        checkpoint) or with `allow_rollback=True`; otherwise refused (TrainerError)."""
        if allow_rollback is None:
            allow_rollback = self._versions_set == 0
        result = self._control.set_weight_version(version, allow_rollback=allow_rollback)
        self._versions_set += 1
        return result

    def close(self) -> None:
        """Closes the channel."""
        self._control.close()


def attach_weight_sync(rollout: Any, sync: WeightSync) -> Any:
    """Wraps `rollout.pause`, `.resume` and `.set_version` (AReaL's RolloutController, which
    PPOTrainer calls around every weight update) so that each also reaches rollgate:
    PauseSubmission before AReaL pauses, SetWeightVersion after AReaL's, ResumeSubmission
    after AReaL resumes. Returns `rollout`."""
    pause, resume, set_version = rollout.pause, rollout.resume, rollout.set_version

    def paused(*args: Any, **kwargs: Any) -> Any:
        sync.pause()
        return pause(*args, **kwargs)

    def resumed(*args: Any, **kwargs: Any) -> Any:
        result = resume(*args, **kwargs)
        sync.resume()
        return result

    def versioned(version: int, *args: Any, **kwargs: Any) -> Any:
        result = set_version(version, *args, **kwargs)
        sync.set_version(int(version))
        return result

    rollout.pause, rollout.resume, rollout.set_version = paused, resumed, versioned
    return rollout
