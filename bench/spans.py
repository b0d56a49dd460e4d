"""Where a turn's added time goes, hop by hop, from the services' own spans.

Starts one cell's environment as `bench/run.py` does, with every service exporting its spans
(`ROLLGATE_OTLP_ENDPOINT`) to a collector in this process, drives rollgate for `--seconds`
(`--clients` overrides the cell's), then prints, per span the turns have (the gateway's HTTP
request, the dataproxy's `Ledger.begin` / `Ledger.record`, the worker's `Generate`), when it
started and ended relative to its turn's gateway span (p50 and p90 over the turns), and the
gaps between them: what the turn spent outside any service's own span — the hops and the
waits for a core.

Usage: `.venv/bin/python bench/spans.py --cell openclaw-16 [--clients 1] [--seconds 6]`
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import http.server
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hotspots
import run

GATEWAY_SPAN = "POST /v1/chat/completions"
# The spans of one turn, in the order the turn reaches them, and the gap names between them.
TURN_SPANS = (
    ("gateway", GATEWAY_SPAN),
    ("dataproxy", "rollgate.v1.DataProxy/Ledger.begin"),
    ("worker", "rollgate.v1.Worker/Generate"),
    ("dataproxy", "rollgate.v1.DataProxy/Ledger.record"),
)
# A unary turn's worker span is named after the call it replaces (`Complete`): the report
# places it where a streamed turn's `Generate` goes.
SAME_SPAN = {("worker", "rollgate.v1.Worker/Complete"): ("worker", "rollgate.v1.Worker/Generate")}


class Collector:
    """An OTLP/HTTP endpoint on a thread of its own: keeps every span posted to it."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, dict[str, Any]]] = []
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                collector.add(orjson.loads(body))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._lock = threading.Lock()
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def add(self, document: dict[str, Any]) -> None:
        for resource in document.get("resourceSpans", ()):
            attributes = resource.get("resource", {}).get("attributes", ())
            service = next(
                (
                    a["value"].get("stringValue", "")
                    for a in attributes
                    if a["key"] == "service.name"
                ),
                "",
            ).removeprefix("rollgate-")
            with self._lock:
                for scope in resource.get("scopeSpans", ()):
                    self.spans += [(service, span) for span in scope.get("spans", ())]

    def close(self) -> None:
        self._server.shutdown()


def turns(
    spans: list[tuple[str, dict[str, Any]]],
) -> list[dict[tuple[str, str], tuple[float, float]]]:
    """Per turn (a trace with one gateway span): each (service, span name)'s start and end,
    in ms from the gateway span's start."""
    by_trace: dict[str, list[tuple[str, dict[str, Any]]]] = collections.defaultdict(list)
    for service, span in spans:
        by_trace[span["traceId"]].append((service, span))
    out = []
    for trace in by_trace.values():
        roots = [s for svc, s in trace if svc == "gateway" and s["name"] == GATEWAY_SPAN]
        if len(roots) != 1:
            continue
        zero = int(roots[0]["startTimeUnixNano"])
        out.append(
            {
                SAME_SPAN.get((service, span["name"]), (service, span["name"])): (
                    (int(span["startTimeUnixNano"]) - zero) / 1e6,
                    (int(span["endTimeUnixNano"]) - zero) / 1e6,
                )
                for service, span in trace
            }
        )
    return out


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def report(spans: list[tuple[str, dict[str, Any]]]) -> str:
    """The turn's spans (p50 / p90 start and end) and the gaps between them (p50), over the
    turns that have all four."""
    whole = [t for t in turns(spans) if all(key in t for key in TURN_SPANS)]
    lines = [
        f"{len(whole)} turns with all four spans",
        f"{'span':48s} {'start p50 / p90 ms':>20s} {'end p50 / p90 ms':>20s}",
    ]
    for key in TURN_SPANS:
        starts = [t[key][0] for t in whole]
        ends = [t[key][1] for t in whole]
        lines.append(
            f"{key[0] + ' ' + key[1]:48s} {_pct(starts, 0.5):9.2f} /{_pct(starts, 0.9):8.2f}"
            f"  {_pct(ends, 0.5):9.2f} /{_pct(ends, 0.9):8.2f}"
        )
    gateway, begin, generate, record = TURN_SPANS
    # One span's end to the next one's start: the hop and the wait for a core between them.
    gaps = {
        "gateway start → begin arrives": [t[begin][0] for t in whole],
        "begin answered → worker starts": [t[generate][0] - t[begin][1] for t in whole],
        "worker ends → record arrives": [t[record][0] - t[generate][1] for t in whole],
        "record answered → gateway ends": [t[gateway][1] - t[record][1] for t in whole],
    }
    lines.append("gaps (outside every service's span), p50 / p90 ms:")
    lines += [
        f"  {name:40s} {_pct(values, 0.5):7.2f} /{_pct(values, 0.9):7.2f}"
        for name, values in gaps.items()
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--cell", default="openclaw-16", choices=[c.name for c in run.CELLS])
    parser.add_argument("--clients", type=int, help="instead of the cell's")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rollgate-root", default=str(run.REPO))
    args = parser.parse_args(argv)
    uvloop.install()
    cell = next(c for c in run.CELLS if c.name == args.cell)
    if args.clients:
        cell = dataclasses.replace(cell, clients=args.clients)
    collector = Collector()
    env_vars = [("ROLLGATE_OTLP_ENDPOINT", collector.url)]
    try:
        with tempfile.TemporaryDirectory(prefix="rollgate-spans-") as tmp:
            run_args = argparse.Namespace(
                rollgate_root=args.rollgate_root, workers=args.workers, env=env_vars
            )
            with run.environment(cell, run_args, Path(tmp)) as env:
                asyncio.run(hotspots._load(env, cell, args.warmup_s))
                warm = len(collector.spans)
                requests, errors = asyncio.run(hotspots._load(env, cell, args.seconds))
                # The services export once a second: wait until the measured turns are in.
                due = time.monotonic() + 10
                while time.monotonic() < due:
                    seen = sum(
                        1 for s, span in collector.spans[warm:] if span["name"] == GATEWAY_SPAN
                    )
                    if seen >= requests:
                        break
                    time.sleep(0.2)  # polling the collector's thread, with a due time
                spans = collector.spans[warm:]
    finally:
        collector.close()
    print(f"{cell.name}, {cell.clients} clients: {requests} requests, {errors} errors")
    print(report(spans))
    return 0


if __name__ == "__main__":
    sys.exit(main())
