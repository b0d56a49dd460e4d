"""A trajectory as the tensors AReaL's trainer uses, as lists or numpy arrays (no torch)."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from rollgate.trajectory import Interaction, Sample, Trajectory

Style = Literal["individual", "concat"]

# The keys of AReaL's tensor dict, in the order `as_dict` gives them.
TENSOR_KEYS = (
    "input_ids",
    "loss_mask",
    "logprobs",
    "versions",
    "turn_ids",
    "attention_mask",
    "rewards",
    "original_rewards",
)
# dtypes per key, AReaL's (InteractionWithTokenLogpReward.to_tensor_dict; torch:
# `torch.from_numpy(a)` keeps them). The AReaL workflow builds its tensors with these too.
AREAL_DTYPES = {
    "input_ids": "int64",
    "loss_mask": "int64",
    "logprobs": "float32",
    "versions": "int64",
    "turn_ids": "int32",
    "attention_mask": "bool",
    "rewards": "float32",
    "original_rewards": "float32",
}
# AReaL's concat_padded_tensors pads every key with 0 (attention_mask with False).
_PAD: dict[str, Any] = {
    "input_ids": 0,
    "loss_mask": 0,
    "logprobs": 0.0,
    "versions": 0,
    "turn_ids": 0,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingTensors:
    """Rows of one trajectory, right-padded to one length; `attention_mask` marks real tokens."""

    input_ids: Any
    loss_mask: Any
    logprobs: Any
    versions: Any
    turn_ids: Any
    attention_mask: Any
    rewards: Any
    original_rewards: Any
    # Per row: the interaction whose output ends the row (the leaf in `concat`).
    interaction_ids: tuple[str, ...]
    # Interactions left out: no prompt or output ids, or logprobs not one per output id.
    skipped: tuple[str, ...]
    # Interactions dropped as retries of the same request (`drop_retry_orphans`).
    dropped_orphans: tuple[str, ...]
    # Per row: the `index` of the interaction whose LLM call produced the row's last output.
    # Rows with the same value are the G samples of one group-sampled call: normalise within.
    sample_group: tuple[int, ...] = ()
    # Per row: which sample of that call (0: the one the agent received).
    sample_index: tuple[int, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """AReaL's tensor dict: key → [rows, length] (`rewards`: [rows])."""
        return {key: getattr(self, key) for key in TENSOR_KEYS}


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingRow:
    """One unpadded row: what a padded row of `to_tensors` holds before padding."""

    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    turn_ids: list[int]
    reward: float
    original_reward: float
    interaction_id: str
    sample_group: int = 0
    sample_index: int = 0


def to_tensors(
    trajectory: Trajectory,
    *,
    style: Style = "individual",
    turn_discount: float = 1.0,
    drop_retry_orphans: bool = False,
    as_numpy: bool = False,
    include_side_turns: bool = False,
) -> TrainingTensors:
    """Training rows: one per interaction (`individual`) or per exactly-joined chain (`concat`).

    Side turns (`turn_type == "side"`: heartbeats, memory flushes) are left out unless
    `include_side_turns`.
    """
    rows = training_rows(
        trajectory,
        style=style,
        turn_discount=turn_discount,
        drop_retry_orphans=drop_retry_orphans,
        include_side_turns=include_side_turns,
    )
    return _assemble(
        list(rows.rows), skipped=rows.skipped, dropped=rows.dropped_orphans, as_numpy=as_numpy
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingRows:
    """The unpadded rows of a trajectory, and what was left out."""

    rows: tuple[TrainingRow, ...]
    skipped: tuple[str, ...]
    dropped_orphans: tuple[str, ...]


def training_rows(
    trajectory: Trajectory,
    *,
    style: Style = "individual",
    turn_discount: float = 1.0,
    drop_retry_orphans: bool = False,
    include_side_turns: bool = False,
    sample_rewards: bool = False,
) -> TrainingRows:
    """The rows `to_tensors` pads, unpadded, in its order (what adapters build one row at a
    time from: AReaL's [1, L] interaction tensors, slime's samples).

    An extra sample's row gets the call's reward after the discount, as the call's own row;
    with `sample_rewards` (a trainer-side `score_fn` scored each sample) its own reward
    plus the discounted return of the turns after the call: `r_s + turn_discount * r_{i+1}`.
    """
    if style not in ("individual", "concat"):
        raise ValueError(f"style must be 'individual' or 'concat', not {style!r}")
    interactions = [
        i for i in trajectory.interactions if include_side_turns or i.turn_type != "side"
    ]
    dropped: list[str] = []
    if drop_retry_orphans:
        interactions, dropped = retry_orphans_dropped(interactions)
    rewards = discounted_rewards(interactions, turn_discount)
    tokens = {i.index: _Tokens.of(i) for i in interactions}
    usable = [i for i in interactions if tokens[i.index].usable]
    skipped = [i.interaction_id for i in interactions if not tokens[i.index].usable]
    if style == "individual":
        rows = [_single_row(i, tokens[i.index], rewards[i.index]) for i in usable]
    else:
        rows = _concat_rows(usable, tokens, rewards)
    following = _following(interactions, rewards, turn_discount) if sample_rewards else None
    rows += _sample_rows(usable, tokens, rewards, skipped, following)
    rows.sort(key=lambda row: (row.sample_group, row.sample_index))
    return TrainingRows(rows=tuple(rows), skipped=tuple(skipped), dropped_orphans=tuple(dropped))


def _sample_rows(
    usable: Sequence[Interaction],
    tokens: dict[int, _Tokens],
    rewards: dict[int, float],
    skipped: list[str],
    following: dict[int, float] | None = None,
) -> list[TrainingRow]:
    """Group sampling: each extra sample of a call is its own row on the call's prompt;
    `following` (per interaction, the discounted return after it): samples have their own
    rewards."""
    rows = []
    for interaction in usable:
        for sample in interaction.samples:
            sample_tokens = _Tokens.of_sample(sample, prompt=tokens[interaction.index].prompt)
            if not sample_tokens.usable:
                skipped.append(f"{interaction.interaction_id}#{sample.sample_index}")
                continue
            reward = rewards[interaction.index]
            if following is not None:
                reward = sample.reward + following[interaction.index]
            row = _single_row(interaction, sample_tokens, reward)
            rows.append(
                dataclasses.replace(
                    row, original_reward=sample.reward, sample_index=sample.sample_index
                )
            )
    return rows


def discounted_rewards(
    interactions: Sequence[Interaction], turn_discount: float
) -> dict[int, float]:
    """AReaL's discount, from the last interaction back: `r_i += turn_discount * r_{i+1}`."""
    out: dict[int, float] = {}
    following = 0.0
    for interaction in reversed(interactions):
        following = interaction.reward + turn_discount * following
        out[interaction.index] = following
    return out


def _following(
    interactions: Sequence[Interaction], rewards: dict[int, float], turn_discount: float
) -> dict[int, float]:
    """Per interaction: `turn_discount` times the discounted return of the next one (0 last)."""
    out: dict[int, float] = {}
    after = 0.0
    for interaction in reversed(interactions):
        out[interaction.index] = turn_discount * after
        after = rewards[interaction.index]
    return out


def retry_orphans_dropped(
    interactions: Sequence[Interaction],
) -> tuple[list[Interaction], list[str]]:
    """AReaL's `drop_retry_orphans`: of calls with identical input, keep the one continued."""
    has_children = {i.parent for i in interactions if i.parent is not None}
    by_input: dict[bytes, list[Interaction]] = {}
    for interaction in interactions:
        by_input.setdefault(_input_key(interaction), []).append(interaction)
    keep: set[int] = set()
    for same in by_input.values():
        continued = [i.index for i in same if i.index in has_children]
        if continued:
            keep.update(continued)
        else:  # latest created_at; on a tie the later one
            keep.add(max(same, key=lambda i: (i.created_at, i.index)).index)
    kept = [i for i in interactions if i.index in keep]
    dropped = [i.interaction_id for i in interactions if i.index not in keep]
    return kept, dropped


def _input_key(interaction: Interaction) -> bytes:
    if interaction.messages:
        text = orjson.dumps(interaction.messages, option=orjson.OPT_SORT_KEYS)
        return b"m" + hashlib.sha1(text, usedforsecurity=False).digest()
    return b"p" + interaction.prompt_token_ids_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class _Tokens:
    """An interaction's arrays, unpacked once."""

    prompt: list[int]
    output: list[int]
    logprobs: list[float]
    versions: list[int]
    exact: bool

    @classmethod
    def of(cls, interaction: Interaction) -> _Tokens:
        output = interaction.output_token_ids
        versions = interaction.output_versions
        if len(versions) != len(output):  # older blobs: one version per logprob
            versions = (versions[:1] or [-1]) * len(output)
        return cls(
            prompt=interaction.prompt_token_ids,
            output=output,
            logprobs=interaction.output_logprobs,
            versions=versions,
            exact=interaction.exact_tokens,
        )

    @classmethod
    def of_sample(cls, sample: Sample, *, prompt: list[int]) -> _Tokens:
        output = sample.output_token_ids
        versions = sample.output_versions
        if len(versions) != len(output):
            versions = (versions[:1] or [-1]) * len(output)
        return cls(
            prompt=prompt,
            output=output,
            logprobs=sample.output_logprobs,
            versions=versions,
            exact=sample.exact_tokens,
        )

    @property
    def usable(self) -> bool:
        return bool(self.prompt) and bool(self.output) and len(self.logprobs) == len(self.output)

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.output


def _single_row(interaction: Interaction, tokens: _Tokens, reward: float) -> TrainingRow:
    n_prompt, n_output = len(tokens.prompt), len(tokens.output)
    return TrainingRow(
        input_ids=tokens.sequence,
        loss_mask=[0] * n_prompt + [1] * n_output,
        logprobs=[0.0] * n_prompt + tokens.logprobs,
        versions=[-1] * n_prompt + tokens.versions,
        turn_ids=[-1] * n_prompt + [0] * n_output,
        reward=reward,
        original_reward=interaction.reward,
        interaction_id=interaction.interaction_id,
        sample_group=interaction.index,
    )


def _concat_rows(
    usable: Sequence[Interaction], tokens: dict[int, _Tokens], rewards: dict[int, float]
) -> list[TrainingRow]:
    """One row per interaction no usable child extends exactly, joined up its exact chain."""
    by_index = {i.index: i for i in usable}
    exact_parent: dict[int, int] = {}
    for child in usable:
        parent = by_index.get(child.parent) if child.parent is not None else None
        if parent is not None and _extends(tokens[parent.index], tokens[child.index]):
            exact_parent[child.index] = parent.index
    extended = set(exact_parent.values())
    rows = []
    for leaf in usable:
        if leaf.index in extended:
            continue
        chain = [leaf.index]
        while chain[-1] in exact_parent:
            chain.append(exact_parent[chain[-1]])
        chain.reverse()
        rows.append(_chain_row(chain, by_index[leaf.index], tokens, rewards[leaf.index]))
    return rows


def _extends(parent: _Tokens, child: _Tokens) -> bool:
    """The child's prompt starts with the parent's exact prompt + output ids."""
    if not (parent.exact and child.exact):
        return False
    joined = parent.sequence
    return len(child.prompt) >= len(joined) and child.prompt[: len(joined)] == joined


def _chain_row(
    chain: list[int], leaf: Interaction, tokens: dict[int, _Tokens], reward: float
) -> TrainingRow:
    last = tokens[chain[-1]]
    length = len(last.sequence)
    loss_mask, logprobs = [0] * length, [0.0] * length
    versions, turn_ids = [-1] * length, [-1] * length
    for turn, index in enumerate(chain):
        part = tokens[index]
        start = len(part.prompt)
        end = start + len(part.output)
        loss_mask[start:end] = [1] * len(part.output)
        logprobs[start:end] = part.logprobs
        versions[start:end] = part.versions
        turn_ids[start:end] = [turn] * len(part.output)
    return TrainingRow(
        input_ids=last.sequence,
        loss_mask=loss_mask,
        logprobs=logprobs,
        versions=versions,
        turn_ids=turn_ids,
        reward=reward,
        original_reward=leaf.reward,
        interaction_id=leaf.interaction_id,
        sample_group=leaf.index,
    )


def _assemble(
    rows: list[TrainingRow], *, skipped: tuple[str, ...], dropped: tuple[str, ...], as_numpy: bool
) -> TrainingTensors:
    width = max((len(row.input_ids) for row in rows), default=0)
    columns: dict[str, Any] = {}
    for key, pad in _PAD.items():
        columns[key] = [getattr(row, key) + [pad] * (width - len(row.input_ids)) for row in rows]
    columns["attention_mask"] = [
        [True] * len(row.input_ids) + [False] * (width - len(row.input_ids)) for row in rows
    ]
    columns["rewards"] = [row.reward for row in rows]
    columns["original_rewards"] = [row.original_reward for row in rows]
    if as_numpy:
        columns = _numpy(columns, rows=len(rows), width=width)
    return TrainingTensors(
        **columns,
        interaction_ids=tuple(row.interaction_id for row in rows),
        skipped=skipped,
        dropped_orphans=dropped,
        sample_group=tuple(row.sample_group for row in rows),
        sample_index=tuple(row.sample_index for row in rows),
    )


def _numpy(columns: dict[str, Any], *, rows: int, width: int) -> dict[str, Any]:
    try:
        import numpy as np
    except ImportError as err:  # pragma: no cover - numpy is optional
        raise ImportError("as_numpy=True needs numpy: pip install numpy") from err
    out: dict[str, Any] = {}
    for key, values in columns.items():
        shape = (rows,) if key in ("rewards", "original_rewards") else (rows, width)
        out[key] = np.asarray(values, dtype=AREAL_DTYPES[key]).reshape(shape)
    return out
