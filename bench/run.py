"""Throughput and added latency through the gateway versus directly to the mock upstream.

Starts the real stack (separate processes, embedded Redis, mock LLM answering after
`--upstream-ms`), then, in one run, drives the same requests directly at the mock and through
the gateway at concurrency 1 and 16, streaming and not. Prints a table and writes JSON to
bench/results/. Usage: `make bench` or `.venv/bin/python bench/run.py [--seconds 5]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import aiohttp

from rollgate.redis_server import free_port
from rollgate.stack import Stack, StackConfig

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    """One scenario's measurements."""

    target: str
    stream: bool
    concurrency: int
    requests: int
    errors: int
    rps: float
    p50_ms: float
    p99_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    # CPU milliseconds each kind of process spent per request (gateway runs only).
    cpu_ms_per_request: dict[str, float] = field(default_factory=dict)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    key: str,
    stream: bool,
    lat: list[float],
    ttft: list[float],
) -> bool:
    body = {
        "model": "rollgate-mock",
        "messages": [{"role": "user", "content": "benchmark request, please answer briefly"}],
        "max_tokens": 16,
        "stream": stream,
    }
    started = time.perf_counter()
    async with session.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
        if resp.status != 200:
            await resp.read()
            return False
        if stream:
            first = None
            async for line in resp.content:
                if first is None and line.startswith(b"data: {"):
                    first = time.perf_counter()
                if line.startswith(b"data: [DONE]"):
                    break
            ttft.append(((first or time.perf_counter()) - started) * 1000)
        else:
            await resp.read()
    lat.append((time.perf_counter() - started) * 1000)
    return True


async def _scenario(
    target: str, url: str, keys: list[str], stream: bool, concurrency: int, seconds: float
) -> Result:
    lat: list[float] = []
    ttft: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(3):  # warm-up: connections, routes and caches
            await _one(session, url, keys[0], stream, [], [])
        deadline = time.perf_counter() + seconds
        started = time.perf_counter()

        async def client(i: int) -> None:
            nonlocal errors
            while time.perf_counter() < deadline:
                if not await _one(session, url, keys[i % len(keys)], stream, lat, ttft):
                    errors += 1

        await asyncio.gather(*(client(i) for i in range(concurrency)))
        elapsed = time.perf_counter() - started
    return Result(
        target=target,
        stream=stream,
        concurrency=concurrency,
        requests=len(lat),
        errors=errors,
        rps=len(lat) / elapsed,
        p50_ms=statistics.median(lat) if lat else float("nan"),
        p99_ms=_pct(lat, 0.99),
        ttft_p50_ms=statistics.median(ttft) if ttft else float("nan"),
        ttft_p99_ms=_pct(ttft, 0.99),
    )


async def _start_sessions(gateway: str, admin_key: str, n: int) -> list[str]:
    keys = []
    async with aiohttp.ClientSession() as session:
        for i in range(n):
            async with session.post(
                f"{gateway}/rl/start_session",
                json={"task_id": f"bench-{i}"},
                headers={"Authorization": f"Bearer {admin_key}"},
            ) as resp:
                resp.raise_for_status()
                keys.append((await resp.json())["api_key"])
    return keys


async def _run(stack: Stack, seconds: float) -> list[Result]:
    assert stack.mock_url is not None
    keys = await _start_sessions(stack.gateway_url, stack.config.admin_key, 16)
    results = []
    for stream in (False, True):
        for concurrency in (1, 16):
            direct = await _scenario(
                "direct",
                f"{stack.mock_url}/chat/completions",
                ["unused"],
                stream,
                concurrency,
                seconds,
            )
            before = _cpu_s(stack)
            gateway = await _scenario(
                "gateway",
                f"{stack.gateway_url}/v1/chat/completions",
                keys,
                stream,
                concurrency,
                seconds,
            )
            spent = {k: v - before[k] for k, v in _cpu_s(stack).items()}
            gateway = replace(
                gateway,
                cpu_ms_per_request={
                    kind: round(1000 * s / max(1, gateway.requests + 3), 3)
                    for kind, s in spent.items()
                },
            )
            results += [direct, gateway]
    return results


def _cpu_s(stack: Stack) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each kind of service process."""
    tick = os.sysconf("SC_CLK_TCK")
    used: dict[str, float] = {}
    for service in stack.services.values():
        if service.process is None:
            continue
        fields = Path(f"/proc/{service.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        kind = "mock" if service.kind == "http" else service.kind
        used[kind] = used.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return used


def _table(results: list[Result]) -> str:
    rows = [
        "| mode | conc | direct rps | gateway rps | ratio | direct p50 | gw p50 | added p50 | "
        "added p99 | direct ttft p50 | gw ttft p50 | added ttft p50 | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for direct, gw in zip(results[::2], results[1::2], strict=True):
        rows.append(
            f"| {'stream' if gw.stream else 'unary'} | {gw.concurrency} | {direct.rps:.0f} | "
            f"{gw.rps:.0f} | {gw.rps / direct.rps:.2f} | {direct.p50_ms:.2f} | {gw.p50_ms:.2f} | "
            f"{gw.p50_ms - direct.p50_ms:.2f} | {gw.p99_ms - direct.p99_ms:.2f} | "
            f"{direct.ttft_p50_ms:.2f} | {gw.ttft_p50_ms:.2f} | "
            f"{gw.ttft_p50_ms - direct.ttft_p50_ms:.2f} | {direct.errors + gw.errors} |"
        )
    rows += ["", "CPU ms per request through the gateway, by process kind:", ""]
    kinds = sorted({k for r in results[1::2] for k in r.cpu_ms_per_request})
    rows += ["| mode | conc | " + " | ".join(kinds) + " | total |", "|---" * (len(kinds) + 3) + "|"]
    for gw in results[1::2]:
        cpu = gw.cpu_ms_per_request
        rows.append(
            f"| {'stream' if gw.stream else 'unary'} | {gw.concurrency} | "
            + " | ".join(f"{cpu.get(k, 0):.2f}" for k in kinds)
            + f" | {sum(cpu.values()):.2f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Runs every scenario once and prints the comparison table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of each scenario")
    parser.add_argument(
        "--upstream-ms", type=float, default=20.0, help="mock latency to first token"
    )
    parser.add_argument("--token-interval-ms", type=float, default=0.0, help="mock delay per token")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rollgate-bench-") as tmp:
        config = StackConfig(
            admin_key="rg-admin-" + uuid.uuid4().hex,
            gateway_port=free_port(),
            workers=args.workers,
            mock_latency_ms=args.upstream_ms,
            mock_token_interval_ms=args.token_interval_ms,
            state_dir=Path(tmp),
            extra_env={"ROLLGATE_LOG_LEVEL": "warning"},
        )
        with Stack(config) as stack:
            results = asyncio.run(_run(stack, args.seconds))
    print(
        f"upstream latency {args.upstream_ms} ms, {args.seconds} s per scenario, "
        f"{args.workers} workers, 16 tokens per answer"
    )
    print(_table(results))
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps([asdict(r) for r in results], indent=2))
    print(f"raw results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
