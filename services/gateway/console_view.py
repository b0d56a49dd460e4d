"""What the console's pages show, as JSON: the live page's overview (counters, groups,
sessions, workers, rates over time from the history snapshots) and a published trajectory
turned into turns, messages and per-token (id, logprob, version) for the viewer."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack  # type: ignore[import-untyped]

from protos import console_pb2, router_pb2
from schema.packing import unpack_float32, unpack_int32

# The viewer shows at most this much of one message (a 48 KB system prompt stays readable).
MAX_MESSAGE_CHARS = 200_000


def _dict(message: Any) -> dict[str, Any]:
    """A flat protobuf message as JSON-ready values (int64 stays a number, unlike proto JSON)."""
    values: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        values[field.name] = list(value) if field.is_repeated else value
    return values


def overview_json(
    overview: console_pb2.OverviewResponse,
    workers: router_pb2.ListWorkersResponse | None,
    recent: console_pb2.ListTrajectoriesResponse,
) -> dict[str, Any]:
    """The live page's data: every value global (read from Redis by the dataproxy)."""
    counters = _dict(overview.counters)
    return {
        "now": overview.now_unix,
        "counters": counters,
        "groups": [_dict(g) for g in overview.groups],
        "sessions": [_dict(s) for s in overview.sessions],
        "sessions_total": int(overview.sessions_total),
        "workers": None if workers is None else [_dict(w) for w in workers.workers],
        "history": history_series(overview.history),
        "rewards": [
            {"t": t.ended_at_unix, "reward": t.final_reward, "stream_id": t.stream_id}
            for t in reversed(recent.trajectories)
        ],
        "recent": [summary_json(t) for t in recent.trajectories[:20]],
        "errors": [_dict(e) for e in overview.errors],
    }


def summary_json(summary: console_pb2.TrajectorySummary) -> dict[str, Any]:
    """One published trajectory's summary (the lists of the live page and the viewer)."""
    return _dict(summary)


def history_series(points: Sequence[console_pb2.HistoryPoint]) -> dict[str, list[float | None]]:
    """Rates between consecutive snapshots (per second) and the sampled levels."""
    series: dict[str, list[float | None]] = {
        key: []
        for key in (
            "t",
            "tokens_per_s",
            "published_per_s",
            "acked_per_s",
            "interactions_per_s",
            "errors_per_s",
            "mean_reward",
            "backlog",
            "pending",
            "in_flight",
            "open_episodes",
            "weight_version",
            "paused",
        )
    }
    for before, after in itertools.pairwise(points):
        dt = after.t_unix - before.t_unix
        if dt <= 0:
            continue
        published = after.published - before.published
        series["t"].append(after.t_unix)
        series["tokens_per_s"].append(max(0, after.output_tokens - before.output_tokens) / dt)
        series["published_per_s"].append(max(0, published) / dt)
        series["acked_per_s"].append(max(0, after.consumed - before.consumed) / dt)
        series["interactions_per_s"].append(max(0, after.interactions - before.interactions) / dt)
        series["errors_per_s"].append(max(0, after.errors - before.errors) / dt)
        # The mean final reward of what was published in the interval (none: no point).
        reward = (after.reward_sum - before.reward_sum) / published if published > 0 else None
        series["mean_reward"].append(reward)
        series["backlog"].append(after.backlog)
        series["pending"].append(after.pending)
        series["in_flight"].append(after.in_flight)
        series["open_episodes"].append(after.open_episodes)
        series["weight_version"].append(after.weight_version)
        series["paused"].append(1 if after.paused else 0)
    return series


# -- the trajectory viewer -------------------------------------------------------------------


def trajectory_json(reply: console_pb2.GetTrajectoryResponse) -> dict[str, Any]:
    """A published trajectory (schema 1 or 2) as the viewer shows it."""
    raw = msgpack.unpackb(reply.data, raw=False)
    table = raw.get("messages_table") or []
    interactions = raw.get("interactions") or []
    prompt_lengths: list[int] = []
    turns = []
    for interaction in interactions:
        prompt_lengths.append(_prompt_length(interaction, prompt_lengths))
        turns.append(_turn(interaction, table, prompt_lengths[-1]))
    return {
        "stream_id": reply.stream_id,
        "trajectory_id": raw.get("trajectory_id", ""),
        "schema_version": raw.get("schema_version", 1),
        "session_id": raw.get("session_id", ""),
        "task_id": raw.get("task_id", ""),
        "key_id": raw.get("key_id", ""),
        "group_id": raw.get("group_id"),
        "started_at": raw.get("started_at", 0.0),
        "ended_at": raw.get("ended_at", 0.0),
        "end_reason": raw.get("end_reason", ""),
        "final_reward": raw.get("final_reward", 0.0),
        "weight_versions": list(raw.get("weight_versions") or []),
        "stats": dict(raw.get("stats") or {}),
        "turns": turns,
    }


def _turn(
    interaction: Mapping[str, Any], table: Sequence[Any], prompt_tokens: int
) -> dict[str, Any]:
    if "messages_ref" in interaction:
        messages = [table[i] for i in interaction.get("messages_ref") or [] if i < len(table)]
    else:
        messages = list(interaction.get("messages") or [])
    ids = _unpack("i", interaction.get("output_token_ids"))
    logprobs = _unpack("f", interaction.get("output_logprobs"))
    versions = _unpack("i", interaction.get("output_versions"))
    count = max(len(ids), len(logprobs))
    tokens = [
        {
            "id": ids[i] if i < len(ids) else None,
            "logprob": round(logprobs[i], 4) if i < len(logprobs) else None,
            "version": versions[i] if i < len(versions) else None,
        }
        for i in range(count)
    ]
    output = interaction.get("output") or {}
    return {
        "index": interaction.get("index", 0),
        "interaction_id": interaction.get("interaction_id", ""),
        "parent": interaction.get("parent"),
        "created_at": interaction.get("created_at", 0.0),
        "latency_s": interaction.get("latency_s", 0.0),
        "ttft_s": interaction.get("ttft_s", 0.0),
        "model": interaction.get("model", ""),
        "upstream_kind": interaction.get("upstream_kind", ""),
        "finish_reason": interaction.get("finish_reason", ""),
        "turn_type": interaction.get("turn_type", "main"),
        "reward": interaction.get("reward", 0.0),
        "reward_set": bool(interaction.get("reward_set", False)),
        "exact_tokens": bool(interaction.get("exact_tokens", False)),
        "length_mismatch": bool(interaction.get("length_mismatch", False)),
        "weight_version_end": interaction.get("weight_version_end"),
        "output_versions_source": interaction.get("output_versions_source", "admission"),
        "prompt_tokens": prompt_tokens,
        "samples": len(interaction.get("samples") or []),
        "messages": [_message(m) for m in messages],
        "output": _message(output),
        "tokens": tokens,
    }


def _prompt_length(interaction: Mapping[str, Any], earlier: Sequence[int]) -> int:
    """Ids in the whole prompt: a shared prefix's length plus the interaction's own ids."""
    own = len(bytes(interaction.get("prompt_token_ids") or b"")) // 4
    prefix = interaction.get("prompt_prefix")
    return own + int(prefix.get("length", 0)) if isinstance(prefix, Mapping) else own


def _message(message: Any) -> dict[str, Any]:
    """role, text content (parts joined), and the tool calls / reasoning when present."""
    if not isinstance(message, Mapping):
        return {"role": "?", "content": str(message)[:MAX_MESSAGE_CHARS]}
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, Mapping):
                texts.append(str(part.get("text", f"[{part.get('type', 'part')}]")))
            else:
                texts.append(str(part))
        text = "\n".join(texts)
    else:
        text = "" if content is None else str(content)
    shown: dict[str, Any] = {
        "role": str(message.get("role", "")),
        "content": text[:MAX_MESSAGE_CHARS],
    }
    for extra in ("reasoning_content", "tool_calls", "tool_call_id", "name"):
        if message.get(extra):
            shown[extra] = message[extra]
    return shown


def _unpack(kind: str, packed: Any) -> list[Any]:
    data = bytes(packed or b"")
    whole = data[: len(data) - len(data) % 4]  # a torn array shows what it holds
    return unpack_int32(whole) if kind == "i" else unpack_float32(whole)
