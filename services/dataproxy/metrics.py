"""The dataproxy's metrics: what this replica counted, and the deployment's global state read
from Redis (exported only by the replica holding the exporter lease; docs/metrics.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import Metric

from services.dataproxy.overview import Overview
from services.runtime.metrics import DURATION_BUCKETS, Refresh, counter, gauge, labelled_gauge


class DataProxyMetrics:
    """Counters of this replica (summing over replicas is right)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.pauses = Counter(
            "rollgate_dataproxy_pauses",
            "PauseSubmission calls served by this replica.",
            registry=registry,
        )
        self.pause_duration = Histogram(
            "rollgate_dataproxy_pause_duration_seconds",
            "How long submission stayed paused, observed by the replica that resumed it.",
            buckets=DURATION_BUCKETS,
            registry=registry,
        )

        self.episodes_ended = Counter(
            "rollgate_dataproxy_episodes_ended",
            "Episodes this replica ended, by outcome (published, empty, held for a late "
            "reward) and reason (end_session, refresh, idle, session_done; empty for the "
            "publication of a held episode).",
            ["status", "reason"],
            registry=registry,
        )
        self.publication_lag = Histogram(
            "rollgate_dataproxy_publication_lag_seconds",
            "From an episode's end to its trajectory on the stream (for an episode held for a "
            "late reward: the wait for it).",
            buckets=DURATION_BUCKETS,
            registry=registry,
        )

    def ended(self, status: str, reason: str, lag_s: float) -> None:
        """Counts an episode this replica ended."""
        self.episodes_ended.labels(status=status, reason=reason).inc()
        if status == "published":
            self.publication_lag.observe(lag_s)

    def paused(self) -> None:
        """Counts a PauseSubmission."""
        self.pauses.inc()

    def resumed(self, paused_s: float) -> None:
        """Observes how long the pause that just ended lasted."""
        self.pause_duration.observe(paused_s)


def global_values(overview: Overview) -> Refresh:
    """The deployment's counters, read from Redis at scrape time."""

    async def refresh() -> list[Metric]:
        c = await overview.counters()
        families = [
            gauge(
                "rollgate_episodes_open", "Episodes bound and not yet published.", c.open_episodes
            ),
            gauge(
                "rollgate_episodes_awaiting_reward",
                "Ended episodes held for a late reward.",
                c.awaiting_reward,
            ),
            counter(
                "rollgate_trajectories_published",
                "Trajectories published on the stream, all time.",
                c.published,
            ),
            counter(
                "rollgate_trajectories_acked",
                "Trajectories acknowledged by trainers through the Trainer service.",
                c.consumed,
            ),
            counter(
                "rollgate_episodes_empty",
                "Episodes that ended without an interaction (not published).",
                c.empty_episodes,
            ),
            counter(
                "rollgate_interactions_published",
                "Interactions in published trajectories.",
                c.interactions,
            ),
            counter(
                "rollgate_interactions_joined",
                "Published interactions whose parent turn was found (prefix join).",
                c.joined,
            ),
            counter(
                "rollgate_interactions_exact_tokens",
                "Published interactions whose token ids are the engine's sampled ids.",
                c.exact_interactions,
            ),
            counter(
                "rollgate_interactions_length_mismatch",
                "Published interactions whose logprobs and token ids differ in length.",
                c.length_mismatches,
            ),
            counter(
                "rollgate_output_tokens_published",
                "Sampled output tokens in published trajectories.",
                c.output_tokens,
            ),
            # Rewards can be negative and a counter never decreases: their sum is
            # positive - negative (docs/metrics.md).
            counter(
                "rollgate_final_reward_positive",
                "Sum of the positive final rewards of published trajectories.",
                c.reward_positive,
            ),
            counter(
                "rollgate_final_reward_negative",
                "Sum of the magnitudes of the negative final rewards of published trajectories.",
                c.reward_negative,
            ),
            gauge(
                "rollgate_prefix_join_ratio",
                "Joined / interactions that could join (all but each episode's first).",
                c.join_rate,
            ),
            gauge(
                "rollgate_exact_token_ratio",
                "Exact-token interactions / published interactions.",
                c.exact_token_ratio,
            ),
            counter(
                "rollgate_rpc_errors_recorded",
                "Failed dataproxy RPCs and failed turns of every replica (the console's error list).",
                c.errors,
            ),
            gauge("rollgate_weight_version", "The current weight version.", c.weight_version),
            gauge(
                "rollgate_submission_paused",
                "1 while submission is paused for a weight update.",
                1.0 if c.paused else 0.0,
            ),
            gauge(
                "rollgate_turns_in_flight",
                "Turns running on every replica (live leases).",
                c.in_flight,
            ),
            gauge(
                "rollgate_capacity_used_episodes",
                "Open + published episodes: what the staleness bound counts.",
                c.capacity_used,
            ),
            gauge(
                "rollgate_stream_length_entries",
                "Entries on the trajectories stream (trimmed below what every group acked).",
                c.stream_length,
            ),
            labelled_gauge(
                "rollgate_stream_backlog_entries",
                "Published trajectories not yet delivered to the consumer group.",
                "group",
                {g.name: g.backlog for g in c.groups},
            ),
            labelled_gauge(
                "rollgate_stream_pending_entries",
                "Trajectories delivered to the consumer group and not acked yet.",
                "group",
                {g.name: g.pending for g in c.groups},
            ),
            labelled_gauge(
                "rollgate_stream_consumers",
                "Consumers of the consumer group.",
                "group",
                {g.name: g.consumers for g in c.groups},
            ),
            labelled_gauge(
                "rollgate_stream_oldest_undelivered_age_seconds",
                "Age of the oldest trajectory the group has not received (0: none).",
                "group",
                {g.name: g.oldest_undelivered_age_s for g in c.groups},
            ),
            labelled_gauge(
                "rollgate_stream_oldest_pending_age_seconds",
                "Age of the oldest trajectory the group received and has not acked (0: none).",
                "group",
                {g.name: g.oldest_pending_age_s for g in c.groups},
            ),
        ]
        if c.paused:
            families.append(
                gauge(
                    "rollgate_submission_paused_since_timestamp_seconds",
                    "Unix time the current pause began (only while paused).",
                    c.paused_since,
                )
            )
        if c.capacity_left >= 0:
            families.append(
                gauge(
                    "rollgate_capacity_left_episodes",
                    "Episodes that may still start (absent: unlimited).",
                    c.capacity_left,
                )
            )
        if c.capacity_granted is not None:
            families.append(
                gauge(
                    "rollgate_capacity_granted_episodes",
                    "Starts granted by GrantCapacity and not yet taken.",
                    c.capacity_granted,
                )
            )
        if c.capacity_bound is not None:
            families.append(
                gauge(
                    "rollgate_capacity_bound_episodes",
                    "The staleness bound: (max_head_offpolicyness + version + 1) x batch size.",
                    c.capacity_bound,
                )
            )
        return families

    return refresh
