"""Rewards computed on the trainer side: a `score_fn` the adapters call for every row.

An episode may carry no reward (the agent never called `set_reward`: a verifier on the trainer
side scores it), or one the trainer wants to transform (clip, shape, combine with a verifier).
Both adapters take `score_fn`: a callable, or an import path `package.module:function`. It is
called once per row before anything else (the turn discount applies to what it returns):

    def score(request: ScoreRequest) -> float | None: ...     # or `async def`

`request` names the trajectory, the interaction, and the extra sample the row is (None: the
answer the agent received); `reward` is the reward rollgate holds for that row (None: never
set). Returning None keeps it (an extra sample then keeps its call's reward, as without a
score_fn). Every extra sample is scored on its own output, so the G rows of a group-sampled
call can differ, which is what group normalisation needs.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from rollgate.trajectory import Interaction, Sample, Trajectory


@dataclass(frozen=True, slots=True, kw_only=True)
class ScoreRequest:
    """One row to score: its episode, its interaction, and which sample of the call it is."""

    trajectory: Trajectory
    interaction: Interaction
    # The extra sample the row is; None: sample 0, the answer the agent received.
    sample: Sample | None = None

    @property
    def task_id(self) -> str:
        """The episode's task (what a verifier looks the expected answer up by)."""
        return self.trajectory.task_id

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The request's messages (the prompt the row's output answers)."""
        return list(self.interaction.messages)

    @property
    def output(self) -> dict[str, Any]:
        """The assistant message to score."""
        return dict((self.sample or self.interaction).output)

    @property
    def sample_index(self) -> int:
        """Which sample of the call (0: the agent's)."""
        return self.sample.sample_index if self.sample is not None else 0

    @property
    def reward(self) -> float | None:
        """The reward rollgate holds for the row; None when none was ever set."""
        if self.sample is not None and self.sample.reward_set:
            return self.sample.reward
        if self.interaction.reward_set:
            return self.interaction.reward
        return None


ScoreFn = Callable[[ScoreRequest], float | Awaitable[float | None] | None]


class ScoreFnError(ValueError):
    """`score_fn` cannot be loaded or returned something that is not a reward."""


def load_score_fn(value: ScoreFn | str | None) -> ScoreFn | None:
    """A callable as it is; `package.module:function` (or `package.module.function`) imported."""
    if value is None or value == "":
        return None
    if callable(value):
        return value
    if not isinstance(value, str):
        raise ScoreFnError(f"score_fn must be a callable or an import path, not {value!r}")
    module_name, sep, attribute = value.partition(":")
    if not sep:
        module_name, _, attribute = value.rpartition(".")
    if not module_name or not attribute:
        raise ScoreFnError(f"score_fn {value!r} is not an import path like package.module:fn")
    try:
        loaded = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        raise ScoreFnError(f"score_fn {value!r} cannot be imported: {err}") from err
    if not callable(loaded):
        raise ScoreFnError(f"score_fn {value!r} is not callable")
    return loaded  # type: ignore[no-any-return]


async def scored(trajectory: Trajectory, score_fn: ScoreFn) -> Trajectory:
    """The trajectory with every interaction's and extra sample's reward as `score_fn` says."""
    interactions = []
    for interaction in trajectory.interactions:
        own = await _score(score_fn, ScoreRequest(trajectory=trajectory, interaction=interaction))
        reward = interaction.reward if own is None else own
        samples = []
        for sample in interaction.samples:
            request = ScoreRequest(trajectory=trajectory, interaction=interaction, sample=sample)
            value = await _score(score_fn, request)
            samples.append(
                dataclasses.replace(
                    sample, reward=reward if value is None else value, reward_set=True
                )
            )
        interactions.append(
            dataclasses.replace(
                interaction,
                reward=reward,
                reward_set=interaction.reward_set or own is not None,
                samples=tuple(samples),
            )
        )
    return dataclasses.replace(trajectory, interactions=tuple(interactions))


async def _score(score_fn: ScoreFn, request: ScoreRequest) -> float | None:
    value = score_fn(request)
    if inspect.isawaitable(value):
        value = await value
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ScoreFnError(
            f"score_fn returned {value!r} for {request.interaction.interaction_id}"
            f"#{request.sample_index}: return a number (or None to keep the reward)"
        )
    return float(value)
