"""An episode's training rows with what each came from: the adapters build on these.

A row is one interaction (or, `concat`, a chain ending in one) or one extra sample of a
group-sampled call. The G rows of one call form a *call group* and stay consecutive. A
call group missing a row (a sample without usable ids, or in `concat` an interaction that a
later turn extends, whose own row is the chain's) is left out whole: trainers normalise over
fixed-size groups of consecutive rows (AReaL's `reward_norm` with `group_size`, slime's
`n_samples_per_prompt`), and one short group would shift every group after it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from rollgate.episodes import Episode
from rollgate.tensors import Style, TrainingRow, training_rows
from rollgate.trajectory import Interaction, Sample


@dataclass(frozen=True, slots=True, kw_only=True)
class EpisodeRow:
    """One training row, its interaction (the leaf in `concat`) and its sample."""

    row: TrainingRow
    episode: Episode
    interaction: Interaction
    # The extra sample the row is (None: sample 0, the answer the agent received).
    sample: Sample | None

    @property
    def key(self) -> str:
        """A unique key: the interaction id, `#k` for sample k > 0."""
        if self.sample is None:
            return self.interaction.interaction_id
        return f"{self.interaction.interaction_id}#{self.sample.sample_index}"

    @property
    def call_group(self) -> str:
        """The G samples of one call share it: `<trajectory_id>/<interaction index>`."""
        return f"{self.episode.trajectory.trajectory_id}/{self.row.sample_group}"

    @property
    def finish_reason(self) -> str:
        """Why the row's last output stopped (`stop`, `length`, `tool_calls`, `abort`, …)."""
        return (self.sample or self.interaction).finish_reason

    @property
    def output(self) -> dict[str, Any]:
        """The assistant message of the row's last output."""
        return (self.sample or self.interaction).output

    @property
    def exact_tokens(self) -> bool:
        """Whether the row's output ids are the engine's own."""
        return (self.sample or self.interaction).exact_tokens

    @property
    def side(self) -> bool:
        """A side turn (header mode `X-Turn-Type: side`)."""
        return self.interaction.turn_type == "side"


@dataclass(frozen=True, slots=True, kw_only=True)
class EpisodeRows:
    """An episode's rows, in order, and what was left out."""

    rows: tuple[EpisodeRow, ...]
    # Interactions (or `<id>#<k>` samples) without usable ids, as `to_tensors` reports them.
    skipped: tuple[str, ...]
    # Call groups left out whole because one of their rows was missing.
    incomplete_groups: tuple[str, ...]


def episode_rows(
    episode: Episode,
    *,
    style: Style = "individual",
    turn_discount: float = 1.0,
    include_side_turns: bool = False,
    drop_retry_orphans: bool = False,
    sample_rewards: bool = False,
) -> EpisodeRows:
    """The rows of one episode, whole call groups only, in `to_tensors` order
    (`sample_rewards`: each extra sample has its own reward, a `score_fn`'s)."""
    trajectory = episode.trajectory
    made = training_rows(
        trajectory,
        style=style,
        turn_discount=turn_discount,
        drop_retry_orphans=drop_retry_orphans,
        include_side_turns=include_side_turns,
        sample_rewards=sample_rewards,
    )
    by_index = {i.index: i for i in trajectory.interactions}
    counts = Counter(row.sample_group for row in made.rows)
    rows: list[EpisodeRow] = []
    incomplete: list[str] = []
    for row in made.rows:
        interaction = by_index[row.sample_group]
        if counts[row.sample_group] != 1 + len(interaction.samples):
            group = f"{trajectory.trajectory_id}/{row.sample_group}"
            if group not in incomplete:
                incomplete.append(group)
            continue
        sample = None
        if row.sample_index:
            sample = next(s for s in interaction.samples if s.sample_index == row.sample_index)
        rows.append(EpisodeRow(row=row, episode=episode, interaction=interaction, sample=sample))
    return EpisodeRows(rows=tuple(rows), skipped=made.skipped, incomplete_groups=tuple(incomplete))
