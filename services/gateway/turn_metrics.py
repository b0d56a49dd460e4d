"""The gateway's per-turn metrics, observed by the one relay every protocol shares: turn
latency, the latency rollgate adds over the upstream's own, time to first token (and what
rollgate adds to it), tokens in and out, turns by outcome."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram

from protos import common_pb2
from services.runtime.errors import RollgateError
from services.runtime.metrics import DURATION_BUCKETS

# Added latency is small: finer buckets than DURATION_BUCKETS at the low end.
ADDED_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip


class TurnMetrics:
    """Counted by this gateway replica (summing over replicas is right)."""

    def stream_opened(self, peer: str, transport: str) -> None:
        """A Turns or Ledger stream was opened (services/runtime/framed.py, PeerStream)."""
        self.peer_streams.labels(peer=peer, transport=transport).inc()

    def __init__(self, registry: CollectorRegistry) -> None:
        self.turns = Counter(
            "rollgate_gateway_turns",
            "Turns relayed, by whether the client streamed and the outcome (ok, or the HTTP "
            "status the client got).",
            ["stream", "outcome"],
            registry=registry,
        )
        self.duration = Histogram(
            "rollgate_gateway_turn_duration_seconds",
            "From the relay's start (route, admission) to the recorded end of the turn.",
            ["stream"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.added = Histogram(
            "rollgate_gateway_turn_added_seconds",
            "Turn duration minus the upstream's own (request to last byte): what rollgate adds.",
            ["stream"],
            buckets=ADDED_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            "rollgate_gateway_time_to_first_token_seconds",
            "Streamed turns: from the relay's start to the first batch with output.",
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.added_ttft = Histogram(
            "rollgate_gateway_added_time_to_first_token_seconds",
            "Time to first token minus the upstream's own: what rollgate adds before it.",
            buckets=ADDED_BUCKETS,
            registry=registry,
        )
        self.peer_streams = Counter(
            "rollgate_gateway_peer_streams",
            "Streams opened to workers (Turns) and dataproxies (Ledger), by peer and transport: "
            "framed, or grpc (the peer offers none, or its framed port could not be reached).",
            ["peer", "transport"],
            registry=registry,
        )
        self.tokens = Counter(
            "rollgate_gateway_tokens",
            "Tokens of recorded turns: the prompt as the model saw it (in), sampled (out).",
            ["direction"],
            registry=registry,
        )
        # The children every recorded turn touches, looked up once (no label lookup per turn).
        self.ok = {s: self.turns.labels(stream=s, outcome="ok") for s in ("true", "false")}
        self.durations = {s: self.duration.labels(stream=s) for s in ("true", "false")}
        self.added_by = {s: self.added.labels(stream=s) for s in ("true", "false")}
        self.tokens_in = self.tokens.labels(direction="in")
        self.tokens_out = self.tokens.labels(direction="out")


class TurnClock:
    """One turn's timing, from the relay's start."""

    __slots__ = ("_first_s", "_metrics", "_started", "_stream")

    def __init__(self, metrics: TurnMetrics | None, *, stream: bool) -> None:
        self._metrics = metrics
        self._stream = stream
        self._started = time.perf_counter()
        self._first_s = -1.0

    def output(self) -> None:
        """A batch with output reached the caller (the first one sets the time to first token)."""
        if self._first_s < 0:
            self._first_s = time.perf_counter() - self._started

    def recorded(self, record: common_pb2.TurnRecord) -> None:
        """The turn is recorded: its durations and tokens."""
        m = self._metrics
        if m is None:
            return
        stream = "true" if self._stream else "false"
        elapsed = time.perf_counter() - self._started
        m.ok[stream].inc()
        m.durations[stream].observe(elapsed)
        m.added_by[stream].observe(max(0.0, elapsed - record.latency_s))
        if self._stream and self._first_s >= 0:
            m.ttft.observe(self._first_s)
            if record.ttft_s > 0:
                m.added_ttft.observe(max(0.0, self._first_s - record.ttft_s))
        m.tokens_in.inc(len(record.prompt_token_ids) // 4)
        output = record.output_token_ids or record.output_logprobs
        m.tokens_out.inc(len(output) // 4)

    def failed(self, err: RollgateError) -> None:
        """The turn ended with an error the client gets."""
        if self._metrics is not None:
            stream = "true" if self._stream else "false"
            self._metrics.turns.labels(stream=stream, outcome=str(err.http_status)).inc()
