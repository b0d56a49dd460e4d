"""The router's global metrics: the worker registry as Redis holds it (one exporting replica)."""

from __future__ import annotations

from prometheus_client.metrics_core import Metric

from services.router.registry import Registry
from services.runtime.metrics import GLOBAL_READ_TIMEOUT_S, Refresh, labelled_gauge


def registry_values(registry: Registry) -> Refresh:
    """Reads every registered worker (one script) into gauges labelled by worker id."""

    async def refresh() -> list[Metric]:
        workers = await registry.list_workers(timeout_s=GLOBAL_READ_TIMEOUT_S)
        live = sum(1 for w in workers if w.live)
        by_worker = {w.worker_id: w for w in workers}
        return [
            labelled_gauge(
                "rollgate_workers",
                "Registered workers, live (heartbeat within the lease) or stale.",
                "state",
                {"live": live, "stale": len(workers) - live},
            ),
            labelled_gauge(
                "rollgate_worker_live",
                "1 while the worker's heartbeat is within its lease, else 0.",
                "worker",
                {k: 1.0 if w.live else 0.0 for k, w in by_worker.items()},
            ),
            labelled_gauge(
                "rollgate_worker_session_affinities",
                "Session affinities naming the worker: sessions placed on it and used within "
                "the affinity TTL (24 h), not sessions running now.",
                "worker",
                {k: w.sessions for k, w in by_worker.items()},
            ),
            labelled_gauge(
                "rollgate_worker_reported_turns_in_flight",
                "Turns in flight the worker reported at its last heartbeat.",
                "worker",
                {k: w.in_flight for k, w in by_worker.items()},
            ),
            labelled_gauge(
                "rollgate_worker_heartbeat_age_seconds",
                "Seconds since the worker's last heartbeat (no sample while none is recorded).",
                "worker",
                {
                    k: w.last_heartbeat_age_s
                    for k, w in by_worker.items()
                    if w.last_heartbeat_age_s >= 0
                },
            ),
        ]

    return refresh
