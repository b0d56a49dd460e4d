"""Which worker serves a session: pure functions over a snapshot of the workers."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.runtime.errors import NotFound, Unavailable

NO_LIVE_WORKER = (
    "no live worker: start a worker (rollgate up starts two) "
    "or check that workers can reach the router"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerState:
    """One registered worker as the router sees it at one moment."""

    worker_id: str
    address: str
    # Empty: the worker serves any model.
    models: tuple[str, ...]
    live: bool
    in_flight: int
    sessions: int
    # -1 when no heartbeat was ever recorded.
    last_heartbeat_age_s: float


def is_live(last_heartbeat_at: float | None, *, now: float, lease_s: float) -> bool:
    """True when the last heartbeat is within the lease."""
    return last_heartbeat_at is not None and now - last_heartbeat_at <= lease_s


def serves(worker: WorkerState, model: str) -> bool:
    """True when the worker serves `model` (an empty model list, or model, means any)."""
    return not worker.models or not model or model in worker.models


def keeps_affinity(worker: WorkerState | None, *, model: str, avoid_worker_id: str) -> bool:
    """True when a session may stay on `worker`, the one its affinity names."""
    return (
        worker is not None
        and worker.live
        and serves(worker, model)
        and worker.worker_id != avoid_worker_id
    )


def available_models(workers: Iterable[WorkerState]) -> list[str]:
    """The models that live workers name, sorted."""
    return sorted({m for w in workers if w.live for m in w.models})


def choose(workers: Sequence[WorkerState], *, model: str, avoid_worker_id: str = "") -> WorkerState:
    """The least-loaded live worker serving `model` (Unavailable / NotFound when none)."""
    # `avoid_worker_id` is skipped only when another worker can serve.
    live = [w for w in workers if w.live]
    if not live:
        raise Unavailable(NO_LIVE_WORKER, code="no_live_worker", retry_after_s=1.0)
    serving = [w for w in live if serves(w, model)]
    if not serving:
        listed = ", ".join(available_models(live))
        raise NotFound(
            f"model '{model}' is not served here; available models: {listed}",
            code="model_not_found",
        )
    preferred = [w for w in serving if w.worker_id != avoid_worker_id] or serving
    return min(preferred, key=lambda w: (w.in_flight, w.sessions, w.worker_id))
