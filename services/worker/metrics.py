"""The worker's own metrics (each worker counts its own turns: summing over workers is right)."""

from __future__ import annotations

from prometheus_client import Gauge

from services.runtime.metrics import ServiceMetrics
from services.worker.turns import TurnRunner


def worker_metrics(metrics: ServiceMetrics, runner: TurnRunner) -> None:
    """Registers the worker's gauges; they read the runner when scraped (no hot-path cost)."""
    in_flight = Gauge(
        "rollgate_worker_turns_in_flight",
        "Turns this worker is generating now.",
        registry=metrics.registry,
    )
    in_flight.set_function(lambda: runner.in_flight)
