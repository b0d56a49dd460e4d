"""The one-line summary of a published trajectory: what the console lists, and the counters
publication adds to `P stats` (output tokens, exact interactions, mismatches, rewards)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

# Summaries kept in `P recent` (newest first); older ones are trimmed by the publish script.
RECENT_KEPT = 1000


def trajectory_summary(trajectory: Mapping[str, Any]) -> bytes:
    """JSON: ids, task, turns, final reward, token counts, versions and timing."""
    interactions = trajectory.get("interactions", [])
    versions = list(trajectory.get("weight_versions", []))
    output_tokens = sum(_output_tokens(i) for i in interactions)
    summary = {
        "trajectory_id": trajectory.get("trajectory_id", ""),
        "session_id": trajectory.get("session_id", ""),
        "task_id": trajectory.get("task_id", ""),
        "turns": len(interactions),
        "final_reward": float(trajectory.get("final_reward", 0.0) or 0.0),
        "output_tokens": output_tokens,
        "exact_interactions": sum(bool(i.get("exact_tokens")) for i in interactions),
        "length_mismatches": sum(bool(i.get("length_mismatch")) for i in interactions),
        "joined": int(trajectory.get("stats", {}).get("joined", 0)),
        "min_version": min(versions) if versions else 0,
        "max_version": max(versions) if versions else 0,
        "started_at": float(trajectory.get("started_at", 0.0)),
        "ended_at": float(trajectory.get("ended_at", 0.0)),
        "end_reason": trajectory.get("end_reason", ""),
    }
    return orjson.dumps(summary)


def _output_tokens(interaction: Mapping[str, Any]) -> int:
    """Sampled tokens of one interaction: its ids (int32), else its logprobs (float32)."""
    ids = bytes(interaction.get("output_token_ids", b""))
    if ids:
        return len(ids) // 4
    return len(bytes(interaction.get("output_logprobs", b""))) // 4
