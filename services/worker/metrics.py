"""The worker's own metrics (each worker counts its own turns: summing over workers is right)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from services.runtime.errors import RollgateError
from services.runtime.metrics import DURATION_BUCKETS, Children, ServiceMetrics
from services.worker.turn import TurnResult
from services.worker.turns import TurnRunner


class WorkerMetrics:
    """Turns by outcome, tokens, exactness, upstream timing and upstream errors by kind."""

    def __init__(self, metrics: ServiceMetrics, runner: TurnRunner) -> None:
        registry = metrics.registry
        in_flight = Gauge(
            "rollgate_worker_turns_in_flight",
            "Turns this worker is generating now.",
            registry=registry,
        )
        # Read when scraped: nothing on the hot path.
        in_flight.set_function(lambda: runner.in_flight)
        self.turns = Counter(
            "rollgate_worker_turns",
            "Turns this worker finished, by whether the client streamed and the outcome "
            "(ok, or the error's code: upstream_timeout, upstream_unavailable, ...).",
            ["stream", "outcome"],
            registry=registry,
        )
        self.tokens = Counter(
            "rollgate_worker_tokens",
            "Tokens of finished turns: the prompt as the model saw it (in), sampled (out).",
            ["direction"],
            registry=registry,
        )
        self.exact = Counter(
            "rollgate_worker_turns_exact_tokens",
            "Finished turns by whether their token ids are the engine's own sampled ids.",
            ["exact"],
            registry=registry,
        )
        self.mismatches = Counter(
            "rollgate_worker_length_mismatches",
            "Finished turns whose logprobs and output ids differ in length.",
            registry=registry,
        )
        self.upstream_errors = Counter(
            "rollgate_worker_upstream_errors",
            "Failed turns by kind (the error code: upstream_timeout, upstream_unavailable, "
            "upstream_auth_failed, upstream_rate_limited, upstream_broken_stream, ...).",
            ["kind"],
            registry=registry,
        )
        self.upstream_latency = Histogram(
            "rollgate_worker_upstream_duration_seconds",
            "The upstream call: request to its last byte.",
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.upstream_ttft = Histogram(
            "rollgate_worker_upstream_time_to_first_token_seconds",
            "The upstream call: request to its first token.",
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        # Read when scraped, from the runner's prompt cache: nothing on the hot path.
        registry.register(_PromptIds(runner))
        self._turns = Children(self.turns)
        self._tokens = Children(self.tokens)
        self._exact = Children(self.exact)

    def finished(self, result: TurnResult, *, stream: bool) -> None:
        """Counts a turn whose record is ready."""
        self._turns(_flag(stream), "ok").inc()
        self._tokens("in").inc(len(result.prompt_token_ids))
        self._tokens("out").inc(len(result.output_token_ids) or len(result.output_logprobs))
        self._exact(_flag(result.exact_tokens)).inc()
        if result.length_mismatch:
            self.mismatches.inc()
        self.upstream_latency.observe(result.latency_s)
        if result.ttft_s > 0:
            self.upstream_ttft.observe(result.ttft_s)

    def failed(self, err: RollgateError, *, stream: bool) -> None:
        """Counts a turn that failed (its code is bounded: the error tree's codes)."""
        self._turns(_flag(stream), err.code).inc()
        self.upstream_errors.labels(kind=err.code).inc()


class _PromptIds(Collector):
    """`rollgate_worker_prompt_token_ids_total`: the prompt ids of answers read through the
    prompt cache (services/worker/prompt_ids.py), reused from an earlier prompt or parsed."""

    def __init__(self, runner: TurnRunner) -> None:
        self._runner = runner

    def collect(self) -> Iterator[CounterMetricFamily]:
        cache = self._runner.prompt_ids
        family = CounterMetricFamily(
            "rollgate_worker_prompt_token_ids",
            "Prompt token ids of answers read through the worker's prompt cache: reused from "
            "an earlier prompt that began alike, or parsed.",
            labels=["source"],
        )
        family.add_metric(["reused"], cache.reused)
        family.add_metric(["parsed"], cache.parsed)
        yield family


def _flag(value: bool) -> str:
    return "true" if value else "false"
