"""rollgate against the mock upstream called directly and against the floor, cell by cell.

Each cell sets the mock (delay before the first token, tokens per answer, delay between
tokens) and a load (streaming or not, clients, the request body), starts the mock, the floor
(bench/floor.py: one Python hop that relays bytes and records nothing) and the real stack as
separate processes, warms all three up, then runs direct, floor and rollgate in alternating
rounds (the order rotates each round, so contention on a shared machine hits all three).
Printed per cell: medians over the rounds with the min-max spread, rollgate's ratio to direct
and to the floor, added p50 / p99 / time to first token, CPU per request of every process
(from /proc, over the measured rounds) and, at the end, the Redis memory an open
OpenClaw-like episode gains per turn. Raw results go to bench/results/.

Usage: `make bench` or `.venv/bin/python bench/run.py [--rounds 5] [--seconds 3] [--cells …]`.
`--rollgate-root DIR` runs the services of another checkout (with its .venv, else this bench's
interpreter: the services run as `python -m services.…` from DIR, so DIR's code is what runs)
with this bench, the mock and the floor of this one: before/after numbers from one bench.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import redis
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
import openclaw

from rollgate.redis_server import free_port
from rollgate.stack import Stack, StackConfig

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
MODEL = "rollgate-mock"
TARGETS = ("direct", "floor", "rollgate")
# Processes whose CPU is rollgate's (the services); Redis and the mock are reported apart.
SERVICE_KINDS = ("gateway", "router", "dataproxy", "worker")
START_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Cell:
    """One workload: the mock's timing and size, the clients and the body."""

    name: str
    title: str
    stream: bool
    clients: int
    first_token_ms: float
    tokens: int
    token_interval_ms: float
    openclaw: bool = False


CELLS = (
    Cell(name="unary-1", title="unary, 1 client (20 ms, 16, 0)", stream=False, clients=1,
         first_token_ms=20, tokens=16, token_interval_ms=0),
    Cell(name="unary-16", title="unary, 16 clients (20 ms, 16, 0)", stream=False, clients=16,
         first_token_ms=20, tokens=16, token_interval_ms=0),
    Cell(name="stream-16", title="stream, 16 clients (20 ms, 16, 0)", stream=True, clients=16,
         first_token_ms=20, tokens=16, token_interval_ms=0),
    Cell(name="long-stream-32", title="long stream, 32 clients (20 ms, 256, 4 ms)", stream=True,
         clients=32, first_token_ms=20, tokens=256, token_interval_ms=4),
    Cell(name="openclaw-16", title="OpenClaw-sized (60 KB), streamed, 16 clients (50 ms, 64, 0)",
         stream=True, clients=16, first_token_ms=50, tokens=64, token_interval_ms=0,
         openclaw=True),
)  # fmt: skip
GROWTH_CELL = "redis-growth"


@dataclass(frozen=True, slots=True, kw_only=True)
class Round:
    """One target's measurements in one round."""

    target: str
    round: int
    requests: int
    errors: int
    seconds: float
    rps: float
    p50_ms: float
    p99_ms: float
    ttft_p50_ms: float
    # CPU seconds each process (by name) spent during the round.
    cpu_s: dict[str, float] = field(default_factory=dict)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _request_body(cell: Cell) -> bytes:
    if cell.openclaw:
        return orjson.dumps(openclaw.body(MODEL))
    return orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "benchmark request, please answer briefly"}],
            "stream": cell.stream,
        }
    )


class Load:
    """Clients that send the same request in a loop and time each answer."""

    def __init__(self, session: aiohttp.ClientSession, *, body: bytes, stream: bool) -> None:
        self._session = session
        self._body = body
        self._stream = stream

    async def one(self, url: str, key: str, lat: list[float], ttft: list[float]) -> bool:
        """One request; False when it failed (status, or a stream without [DONE])."""
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
        started = time.perf_counter()
        async with self._session.post(url, data=self._body, headers=headers) as resp:
            if resp.status != 200:
                await resp.read()
                return False
            if self._stream:
                first: float | None = None
                tail = b""
                async for data in resp.content.iter_any():
                    if first is None:
                        first = time.perf_counter()
                    tail = (tail + data)[-64:]
                if b"data: [DONE]" not in tail:
                    return False
                ttft.append(((first or time.perf_counter()) - started) * 1000)
            else:
                await resp.read()
        lat.append((time.perf_counter() - started) * 1000)
        return True

    async def run(
        self, url: str, keys: list[str], clients: int, seconds: float
    ) -> tuple[list[float], list[float], int, float]:
        """Latencies, times to first byte, errors and the elapsed time of `seconds` of load."""
        lat: list[float] = []
        ttft: list[float] = []
        errors = 0
        deadline = time.perf_counter() + seconds

        async def client(i: int) -> None:
            nonlocal errors
            while time.perf_counter() < deadline:
                try:
                    ok = await self.one(url, keys[i % len(keys)], lat, ttft)
                except aiohttp.ClientError:
                    ok = False
                if not ok:
                    errors += 1

        started = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(clients)))
        return lat, ttft, errors, time.perf_counter() - started


class Processes:
    """CPU seconds (user + system, all threads) of named processes, from /proc."""

    def __init__(self) -> None:
        self.pids: dict[str, int] = {}
        self._tick = os.sysconf("SC_CLK_TCK")

    def cpu_s(self) -> dict[str, float]:
        """CPU used so far by each process."""
        return {name: sum(split) for name, split in self.cpu_split().items()}

    def cpu_split(self) -> dict[str, tuple[float, float]]:
        """CPU seconds (user, system) used so far by each process (gone ones left out)."""
        used = {}
        for name, pid in self.pids.items():
            try:
                used[name] = self._split(Path(f"/proc/{pid}/stat").read_text())
            except OSError:
                continue
        return used

    def thread_cpu_s(self) -> dict[str, dict[str, float]]:
        """CPU seconds used so far by each process's threads, by thread name (threads of one
        name summed: `python` is the main thread, `event_engine` grpc's pollers)."""
        used: dict[str, dict[str, float]] = {}
        for name, pid in self.pids.items():
            threads: dict[str, float] = {}
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    text = (task / "stat").read_text()
                except OSError:
                    continue
                comm = text[text.index("(") + 1 : text.rindex(")")]
                threads[comm] = threads.get(comm, 0.0) + sum(self._split(text))
            used[name] = threads
        return used

    def switches(self) -> dict[str, tuple[int, int]]:
        """Context switches so far of each process, all threads summed: (voluntary — it
        waited, for a read, a reply, a timer —, involuntary — a core was taken from it)."""
        counted: dict[str, tuple[int, int]] = {}
        for name, pid in self.pids.items():
            waited = taken = 0
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    status = (task / "status").read_text()
                except OSError:
                    continue
                for line in status.splitlines():
                    if line.startswith("voluntary_ctxt_switches:"):
                        waited += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches:"):
                        taken += int(line.split()[1])
            counted[name] = (waited, taken)
        return counted

    def _split(self, stat: str) -> tuple[float, float]:
        """CPU seconds (user, system) from a `/proc/…/stat` line (the name, in parentheses,
        may hold spaces: the fields are counted after it)."""
        fields = stat.rsplit(")", 1)[1].split()
        return int(fields[11]) / self._tick, int(fields[12]) / self._tick


def kind_of(name: str) -> str:
    """gateway-2 → gateway, worker-1 → worker, skeleton-worker → skeleton; redis, mock and
    floor as they are."""
    if name.startswith("skeleton-"):
        return "skeleton"
    for kind in SERVICE_KINDS:
        if name == kind or name.startswith(kind + "-"):
            return kind
    return name


@dataclass(slots=True)
class Environment:
    """The processes of one cell: mock, floor, the stack, and their URLs."""

    mock_url: str
    floor_url: str
    stack: Stack
    processes: Processes
    keys: list[str]
    # bench/skeleton.py's gateway, when it runs (`--skeleton`).
    skeleton_url: str = ""


def _spawn(argv: list[str], log: Path, cwd: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd
        )


def _python_of(root: Path) -> Path:
    """The interpreter the services of checkout `root` run with: its .venv's, else this one
    (a bare `git worktree` of an older commit has no .venv; the code comes from `root`)."""
    own = root / ".venv" / "bin" / "python"
    return own if own.exists() else Path(sys.executable)


def _serve_http(argv: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Starts an HTTP process on a free port (`{port}` in argv); retries when the port was
    taken meanwhile. Returns the process and its base URL."""
    for _ in range(5):
        port = free_port()
        process = _spawn([a.replace("{port}", str(port)) for a in argv], log, REPO)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and process.poll() is None:
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=1) as resp:
                    if resp.status == 200:
                        return process, url
            except (urllib.error.URLError, http.client.HTTPException, OSError):
                time.sleep(0.05)
        process.kill()
        process.wait()
    raise RuntimeError(f"{argv[:3]} did not start:\n{log.read_text()[-2000:]}")


def _assignment(raw: str) -> tuple[str, str]:
    name, sep, value = raw.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{raw!r} is not NAME=VALUE")
    return name, value


@contextlib.contextmanager
def environment(cell: Cell, args: argparse.Namespace, tmp: Path) -> Iterator[Environment]:
    """Starts the mock, the floor and the stack for `cell`; stops them afterwards."""
    logs = tmp / cell.name
    logs.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    mock, mock_url = _serve_http(
        [
            python, "-m", "rollgate.mock_llm", "--port", "{port}",
            "--latency-ms", str(cell.first_token_ms),
            "--token-interval-ms", str(cell.token_interval_ms),
            "--answer-tokens", str(cell.tokens), "--model", MODEL,
        ],
        logs / "mock.log",
    )  # fmt: skip
    floor = None
    extra: list[subprocess.Popen[bytes]] = []
    try:
        floor, floor_url = _serve_http(
            [python, str(HERE / "floor.py"), "--port", "{port}", "--upstream", mock_url],
            logs / "floor.log",
        )
        root = Path(args.rollgate_root).resolve()
        config = StackConfig(
            admin_key="rg-admin-" + uuid.uuid4().hex,
            gateway_port=free_port(),
            workers=args.workers,
            upstream_base_url=mock_url + "/v1",
            upstream_kind="vllm",
            python=str(_python_of(root)),
            state_dir=logs,
            extra_env={"ROLLGATE_LOG_LEVEL": "warning", **dict(args.env)},
        )
        # The services are `python -m services.…` from `root` (their checkout, their venv).
        here = Path.cwd()
        os.chdir(root)
        try:
            stack = Stack(config).start()
        finally:
            os.chdir(here)
        try:
            processes = Processes()
            processes.pids = {"mock": mock.pid, "floor": floor.pid}
            for name, service in stack.services.items():
                if service.process is not None:
                    processes.pids[name] = service.process.pid
            info: Any = redis.Redis.from_url(stack.redis_url).info("server")
            processes.pids["redis"] = int(info["process_id"])
            keys = asyncio.run(_start_sessions(stack, max(cell.clients, 1)))
            skeleton_url = ""
            if getattr(args, "skeleton", None):
                skeleton, skeleton_url = _skeleton(
                    mock_url, stack.redis_url, logs, recording=args.skeleton == "recording"
                )
                extra.extend(skeleton.values())
                processes.pids.update({f"skeleton-{r}": p.pid for r, p in skeleton.items()})
            yield Environment(
                mock_url=mock_url,
                floor_url=floor_url,
                stack=stack,
                processes=processes,
                keys=keys,
                skeleton_url=skeleton_url,
            )
        finally:
            stack.stop()
    finally:
        for process in (*extra, floor, mock):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(timeout=15)


def _listening(port: int, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.05)
    raise RuntimeError(f"a skeleton process did not start:\n{log.read_text()[-2000:]}")


def _skeleton(
    mock_url: str, redis_url: str, logs: Path, *, recording: bool
) -> tuple[dict[str, subprocess.Popen[bytes]], str]:
    """bench/skeleton.py's three processes (on the stack's Redis); its gateway's URL."""
    script = str(HERE / "skeleton.py")
    mode = ["--record"] if recording else []
    redis_port = str(redis.Redis.from_url(redis_url).connection_pool.connection_kwargs["port"])
    started: dict[str, subprocess.Popen[bytes]] = {}
    ports = {"dataproxy": free_port(), "worker": free_port()}
    argv = {
        "dataproxy": ["--redis-port", redis_port],
        "worker": ["--upstream", mock_url + "/v1/chat/completions"],
    }
    try:
        for role in ("dataproxy", "worker"):
            log = logs / f"skeleton-{role}.log"
            started[role] = _spawn(
                [sys.executable, script, role, "--port", str(ports[role]), *argv[role], *mode],
                log,
                REPO,
            )
            _listening(ports[role], started[role], log)
        started["gateway"], url = _serve_http(
            [
                sys.executable, script, "gateway", "--port", "{port}",
                "--dataproxy-port", str(ports["dataproxy"]), "--worker-port", str(ports["worker"]),
                *mode,
            ],
            logs / "skeleton-gateway.log",
        )  # fmt: skip
    except BaseException:
        for process in started.values():  # none is left running when one did not start
            process.kill()
            process.wait()
        raise
    return started, url


async def _start_sessions(stack: Stack, n: int) -> list[str]:
    keys = []
    async with aiohttp.ClientSession() as session:
        for i in range(n):
            async with session.post(
                f"{stack.gateway_url}/rl/start_session",
                json={"task_id": f"bench-{i}"},
                headers={"Authorization": f"Bearer {stack.config.admin_key}"},
            ) as resp:
                resp.raise_for_status()
                keys.append((await resp.json())["api_key"])
    return keys


def _urls(env: Environment) -> dict[str, str]:
    urls = {
        "direct": f"{env.mock_url}/v1/chat/completions",
        "floor": f"{env.floor_url}/v1/chat/completions",
        "rollgate": f"{env.stack.gateway_url}/v1/chat/completions",
    }
    if env.skeleton_url:
        urls["skeleton"] = f"{env.skeleton_url}/v1/chat/completions"
    return urls


async def _measure(cell: Cell, env: Environment, args: argparse.Namespace) -> list[Round]:
    urls = _urls(env)
    targets = tuple(urls)
    keys = {"direct": ["unused"], "floor": ["unused"], "rollgate": env.keys, "skeleton": ["-"]}
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=120)
    rounds: list[Round] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        load = Load(session, body=_request_body(cell), stream=cell.stream)
        for target in targets:  # warm-up: connections, routes, caches, the JIT-less paths
            await load.run(urls[target], keys[target], cell.clients, args.warmup_s)
        for number in range(args.rounds):
            turn = number % len(targets)
            order = targets[turn:] + targets[:turn]
            for target in order:
                before = env.processes.cpu_s()
                lat, ttft, errors, elapsed = await load.run(
                    urls[target], keys[target], cell.clients, args.seconds
                )
                after = env.processes.cpu_s()
                rounds.append(
                    Round(
                        target=target,
                        round=number,
                        requests=len(lat),
                        errors=errors,
                        seconds=elapsed,
                        rps=len(lat) / elapsed,
                        p50_ms=statistics.median(lat) if lat else float("nan"),
                        p99_ms=_pct(lat, 0.99),
                        ttft_p50_ms=statistics.median(ttft) if ttft else float("nan"),
                        cpu_s={k: after[k] - before.get(k, after[k]) for k in after},
                    )
                )
    return rounds


@dataclass(frozen=True, slots=True, kw_only=True)
class Spread:
    """A median over rounds and its min-max."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        """The spread of `values`."""
        if not values:
            return cls(median=float("nan"), low=float("nan"), high=float("nan"))
        return cls(median=statistics.median(values), low=min(values), high=max(values))

    def show(self, digits: int = 2) -> str:
        """`median (low-high)`."""
        return f"{self.median:.{digits}f} ({self.low:.{digits}f}-{self.high:.{digits}f})"


def _cpu_ms_per_request(rounds: list[Round], target: str) -> dict[str, float]:
    """CPU ms per answered request by process kind, over every round of `target`."""
    mine = [r for r in rounds if r.target == target]
    requests = sum(r.requests for r in mine) or 1
    by_kind: dict[str, float] = {}
    for r in mine:
        for name, seconds in r.cpu_s.items():
            by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0.0) + seconds
    return {kind: 1000 * s / requests for kind, s in by_kind.items()}


def _targets(rounds: list[Round]) -> list[str]:
    return list(dict.fromkeys(r.target for r in rounds))


def summarize(cell: Cell, rounds: list[Round], *, skeleton_mode: str = "bare") -> dict[str, Any]:
    """The cell's medians, spreads, ratios, added latencies, CPU and goal checks."""
    by = {t: [r for r in rounds if r.target == t] for t in TARGETS}
    paired = list(zip(by["direct"], by["floor"], by["rollgate"], strict=True))
    cpu = {t: _cpu_ms_per_request(rounds, t) for t in TARGETS}
    services = sum(cpu["rollgate"].get(k, 0.0) for k in SERVICE_KINDS)
    floor_cpu = cpu["floor"].get("floor", float("nan"))
    mock_cpu = cpu["rollgate"].get("mock", 0.0)
    summary: dict[str, Any] = {
        "cell": cell.name,
        "title": cell.title,
        "rps": {t: Spread.of([r.rps for r in by[t]]) for t in TARGETS},
        "floor_to_direct": Spread.of([f.rps / d.rps for d, f, _ in paired]),
        "to_direct": Spread.of([g.rps / d.rps for d, _, g in paired]),
        "to_floor": Spread.of([g.rps / f.rps for _, f, g in paired]),
        "added_p50_ms": Spread.of([g.p50_ms - d.p50_ms for d, _, g in paired]),
        "added_p99_ms": Spread.of([g.p99_ms - d.p99_ms for d, _, g in paired]),
        "floor_added_p50_ms": Spread.of([f.p50_ms - d.p50_ms for d, f, _ in paired]),
        "added_ttft_ms": Spread.of([g.ttft_p50_ms - d.ttft_p50_ms for d, _, g in paired])
        if cell.stream
        else None,
        "errors": {t: sum(r.errors for r in rounds if r.target == t) for t in _targets(rounds)},
        "requests": {t: sum(r.requests for r in rounds if r.target == t) for t in _targets(rounds)},
        "cpu_ms": cpu,
        "services_cpu_ms": services,
        "floor_cpu_ms": floor_cpu,
        "cpu_to_floor": services / floor_cpu if floor_cpu else float("nan"),
        # The steadier measure across runs: the VM's speed moves every process's CPU alike,
        # and the mock answering rollgate is in the same run.
        "services_to_mock": services / mock_cpu if mock_cpu else float("nan"),
    }
    skeleton = [r for r in rounds if r.target == "skeleton"]
    if skeleton:
        paired_skeleton = list(zip(by["floor"], skeleton, strict=True))
        skeleton_cpu = _cpu_ms_per_request(rounds, "skeleton").get("skeleton", float("nan"))
        answered = sum(r.requests for r in skeleton) or 1
        roles: dict[str, float] = {}
        for r in skeleton:
            for name, seconds in r.cpu_s.items():
                if name.startswith("skeleton-"):
                    role = name.removeprefix("skeleton-")
                    roles[role] = roles.get(role, 0.0) + 1000 * seconds / answered
        with_direct = list(zip(by["direct"], skeleton, strict=True))
        summary["skeleton"] = {
            "mode": skeleton_mode,
            "to_floor": Spread.of([k.rps / f.rps for f, k in paired_skeleton]),
            "added_p50_ms": Spread.of([k.p50_ms - d.p50_ms for d, k in with_direct]),
            "added_ttft_ms": Spread.of([k.ttft_p50_ms - d.ttft_p50_ms for d, k in with_direct])
            if cell.stream
            else None,
            "cpu_ms": skeleton_cpu,
            "cpu_ms_by_role": roles,
            "cpu_to_floor": skeleton_cpu / floor_cpu if floor_cpu else float("nan"),
        }
    goals = {
        "rollgate/floor >= 0.90": summary["to_floor"].median >= 0.90,
        "CPU <= 3x floor": summary["cpu_to_floor"] <= 3.0,
    }
    if cell.name == "unary-1":
        goals["added p50 <= 2.0 ms"] = summary["added_p50_ms"].median <= 2.0
    if cell.name == "stream-16":
        goals["added ttft <= 5 ms"] = summary["added_ttft_ms"].median <= 5.0
    summary["goals"] = goals
    return summary


def _show_cell(s: dict[str, Any]) -> str:
    rps = s["rps"]
    lines = [
        f"### {s['title']}",
        "",
        f"rps: direct {rps['direct'].show(0)}, floor {rps['floor'].show(0)}, "
        f"rollgate {rps['rollgate'].show(0)}",
        f"floor / direct {s['floor_to_direct'].show()} (floor adds "
        f"{s['floor_added_p50_ms'].show()} ms p50)",
        f"rollgate / direct {s['to_direct'].show()}, rollgate / floor {s['to_floor'].show()}",
        f"added p50 {s['added_p50_ms'].show()} ms, added p99 {s['added_p99_ms'].show()} ms"
        + (f", added ttft {s['added_ttft_ms'].show()} ms" if s["added_ttft_ms"] else ""),
    ]
    cpu = s["cpu_ms"]["rollgate"]
    per_kind = ", ".join(f"{k} {cpu.get(k, 0.0):.2f}" for k in SERVICE_KINDS)
    lines.append(
        f"CPU ms/request: rollgate {s['services_cpu_ms']:.2f} ({per_kind}; redis "
        f"{cpu.get('redis', 0.0):.2f}, mock {cpu.get('mock', 0.0):.2f}); floor "
        f"{s['floor_cpu_ms']:.2f} (mock {s['cpu_ms']['floor'].get('mock', 0.0):.2f}); direct mock "
        f"{s['cpu_ms']['direct'].get('mock', 0.0):.2f}; rollgate / floor {s['cpu_to_floor']:.1f}x; "
        f"services / mock {s['services_to_mock']:.2f}"
    )
    if "skeleton" in s:
        k = s["skeleton"]
        what = (
            "the same hops and the work no recording gateway can skip"
            if k["mode"] == "recording"
            else "the same hops, nothing else"
        )
        roles = ", ".join(f"{role} {ms:.2f}" for role, ms in sorted(k["cpu_ms_by_role"].items()))
        ttft = f", added ttft {k['added_ttft_ms'].show()} ms" if k["added_ttft_ms"] else ""
        lines.append(
            f"skeleton (bench/skeleton.py {k['mode']}: {what}): / floor "
            f"{k['to_floor'].show()}, added p50 {k['added_p50_ms'].show()} ms{ttft}, CPU "
            f"{k['cpu_ms']:.2f} ms/request ({roles}) = {k['cpu_to_floor']:.1f}x the floor's"
        )
    lines.append(f"errors: {s['errors']}, requests: {s['requests']}")
    lines.append(
        "goals: " + ", ".join(f"{g} {'met' if ok else 'NOT met'}" for g, ok in s["goals"].items())
    )
    return "\n".join(lines)


def machine_speed_us() -> float:
    """How long `sum(range(1000))` takes this interpreter now, best of seven (µs): a shared
    VM's speed moves by tens of per cent between hours, and every run says where it was."""
    return min(timeit.repeat("sum(range(1000))", number=20_000, repeat=7)) / 20_000 * 1e6


def machine_line(when: str, speed_us: float) -> str:
    """The machine's speed as a run prints it, with the interpreter it was measured on."""
    version = ".".join(map(str, sys.version_info[:3]))
    return (
        f"machine {when}: sum(range(1000)) {speed_us:.1f} µs (Python {version}, {sys.executable})"
    )


def table(summaries: list[dict[str, Any]]) -> str:
    """The README's table: one row per cell, medians (min-max over rounds)."""
    rows = [
        "| cell | floor / direct | rollgate / direct | rollgate / floor | added p50 ms | "
        "added p99 ms | added ttft ms | CPU ms/req rollgate (gw, rt, dp, wk) | floor CPU | "
        "CPU / floor | services / mock |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        cpu = s["cpu_ms"]["rollgate"]
        kinds = ", ".join(f"{cpu.get(k, 0.0):.2f}" for k in SERVICE_KINDS)
        ttft = s["added_ttft_ms"].show(1) if s["added_ttft_ms"] else "-"
        rows.append(
            f"| {s['title']} | {s['floor_to_direct'].show()} | {s['to_direct'].show()} | "
            f"{s['to_floor'].show()} | {s['added_p50_ms'].show(1)} | "
            f"{s['added_p99_ms'].show(1)} | {ttft} | {s['services_cpu_ms']:.2f} ({kinds}) | "
            f"{s['floor_cpu_ms']:.2f} | {s['cpu_to_floor']:.1f}x | {s['services_to_mock']:.2f} |"
        )
    return "\n".join(rows)


# -- Redis growth of an open episode --------------------------------------------------------


def _answer_text(raw: bytes) -> str:
    parts = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {"):
            chunk = orjson.loads(line[6:])
            for choice in chunk.get("choices") or ():
                parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


async def _growth(env: Environment, turns: int) -> dict[str, Any]:
    """used_memory after each turn of one open episode whose prompt repeats every turn."""
    client = redis.Redis.from_url(env.stack.redis_url)
    key = env.keys[0]
    url = f"{env.stack.gateway_url}/v1/chat/completions"
    history: list[dict[str, Any]] = [openclaw.user_message(2, size=500)]
    used: list[int] = []
    added: list[int] = []
    async with aiohttp.ClientSession() as session:
        for turn in range(turns):
            body = orjson.dumps(openclaw.body(MODEL, history))
            async with session.post(
                url, data=body, headers={"Authorization": f"Bearer {key}"}
            ) as resp:
                raw = await resp.read()
                if resp.status != 200 or b"data: [DONE]" not in raw:
                    raise RuntimeError(f"growth turn failed: {resp.status} {raw[-300:]!r}")
            info: Any = client.info("memory")
            used.append(int(info["used_memory"]))
            answer = {"role": "assistant", "content": _answer_text(raw)}
            user = openclaw.user_message(turn + 3, size=500)
            history += [answer, user]
            added.append(len(orjson.dumps(answer)) + len(orjson.dumps(user)))
    # used[i] - used[i-1] is what turn i stored; turn i sent what turn i-1 added. The median
    # of those deltas is the growth: now and then an allocation of ~32 KB appears and goes
    # again between two turns (Redis-internal, not the turns), which a mean over a dozen
    # turns would count as a few KB per turn.
    steady = range(2, turns)
    per_turn = [used[i] - used[i - 1] for i in steady]
    mean = (used[-1] - used[1]) / max(1, turns - 2)
    added_mean = statistics.mean(added[i - 1] for i in steady)
    limit = 4096 + 2 * added_mean
    median = statistics.median(per_turn)
    return {
        "turns": turns,
        "first_turn_bytes": used[0],
        "per_turn_bytes": per_turn,
        "median_per_turn_bytes": median,
        "mean_per_turn_bytes": mean,
        "added_per_turn_bytes": added_mean,
        "limit_bytes": limit,
        "met": median <= limit,
    }


def _show_growth(g: dict[str, Any]) -> str:
    return (
        f"### Redis growth of an open OpenClaw-like episode ({g['turns']} turns)\n\n"
        f"used_memory per turn (turns 3..{g['turns']}): median {g['median_per_turn_bytes']:.0f} B "
        f"(mean {g['mean_per_turn_bytes']:.0f} B), per turn {g['per_turn_bytes']}; each turn "
        f"added {g['added_per_turn_bytes']:.0f} B of "
        f"messages; goal <= 4 KB + 2 x added = {g['limit_bytes']:.0f} B: "
        f"{'met' if g['met'] else 'NOT met'}"
    )


# -- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Runs the chosen cells and prints each one's numbers, the table and the Redis growth."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    names = [c.name for c in CELLS] + [GROWTH_CELL]
    parser.add_argument("--cells", nargs="*", default=names, choices=names)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0, help="length of one round")
    parser.add_argument("--warmup-s", type=float, default=2.0, help="warm-up per target")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--growth-turns", type=int, default=16)
    parser.add_argument(
        "--skeleton",
        nargs="?",
        const="bare",
        choices=["bare", "recording"],
        help="also run bench/skeleton.py in every round: the design's hops and nothing else "
        "(bare, the default), or with the work no recording gateway can skip (recording)",
    )
    parser.add_argument(
        "--rollgate-root",
        default=str(REPO),
        help="checkout whose services run (with its .venv if it has one)",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        type=_assignment,
        metavar="NAME=VALUE",
        help="set for every service (repeatable), e.g. ROLLGATE_FRAMED_STREAMS=false",
    )
    args = parser.parse_args(argv)
    uvloop.install()
    summaries: list[dict[str, Any]] = []
    raw: dict[str, Any] = {"args": vars(args), "cells": {}}
    raw["machine_speed_us"] = {"start": machine_speed_us()}
    print(machine_line("at the start", raw["machine_speed_us"]["start"]), flush=True)
    growth: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="rollgate-bench-") as tmp:
        for cell in CELLS:
            if cell.name not in args.cells:
                continue
            with environment(cell, args, Path(tmp)) as env:
                rounds = asyncio.run(_measure(cell, env, args))
            summary = summarize(cell, rounds, skeleton_mode=args.skeleton or "bare")
            summaries.append(summary)
            raw["cells"][cell.name] = {"rounds": [asdict(r) for r in rounds]}
            print(_show_cell(summary), "\n", flush=True)
        if GROWTH_CELL in args.cells:
            cell = next(c for c in CELLS if c.openclaw)
            single = Cell(**{**asdict(cell), "name": GROWTH_CELL, "clients": 1})
            with environment(single, args, Path(tmp)) as env:
                growth = asyncio.run(_growth(env, args.growth_turns))
            raw["growth"] = growth
            print(_show_growth(growth), "\n", flush=True)
    if summaries:
        print(table(summaries))
    raw["machine_speed_us"]["end"] = machine_speed_us()
    print(machine_line("at the end", raw["machine_speed_us"]["end"]))
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    raw["summaries"] = summaries
    out.write_text(json.dumps(raw, indent=2, default=lambda o: asdict(o)))
    print(f"\nraw results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
