"""Where each service's CPU goes under one bench cell's load: py-spy on every process.

Starts the cell's environment as `bench/run.py` does (mock, floor, the real stack), warms
rollgate up, then drives rollgate alone for `--seconds` while `py-spy record` samples the
gateway, the dataproxy and one worker (all threads, native frames off). Prints, per process,
its CPU per request (from /proc), the share of samples by where the leaf frame lives (the
loop's native code, aiohttp, grpc, protobuf, rollgate's modules, …) and the functions with
the most self time; the raw samples go to bench/results/profile-<cell>-<process>.txt
(`py-spy`'s raw format, one stack per line, for flame graphs).
`--idle` measures instead what each process burns with no load at all (CPU ms per second);
`--perf` samples with `perf record -g` instead of py-spy: each process's CPU by shared object
(the interpreter, the kernel, uvloop, upb, orjson...), the native symbols with the most self
time, and the kernel's functions with what they call included (the write path, say);
`--strace` counts each service's system calls per request (`strace -c`; every worker);
`--lines` counts the Python lines each function of each service runs per request (a line
tracer, bench/linetrace/: exact where samples are not — a loop per chunk shows as dozens of
lines per request — and five to ten times slower, so read the counts, not the CPU).
With `--native`, each process's functions by *inclusive* share of its busy samples too (the
poll's waits and the loop's trunk left out): what each phase of a turn costs.
`--against DIR [--pairs N]` profiles nothing: it measures this checkout (`--rollgate-root`)
and DIR in turn, N pairs, and prints each service's CPU per request as a multiple of the
mock's in the same run (the VM's speed moves both alike), per pair and as mean (min-max) per
side with the change: a before/after that a VM's drift between two runs does not decide.

Usage: `.venv/bin/python bench/hotspots.py --cell unary-16 [--seconds 20] [--rate 250]`
(needs `pip install py-spy`; py-spy reads other processes' memory: root, or ptrace allowed).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import pstats
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run

RESULTS = run.RESULTS
# A sitecustomize that counts each function's lines (`--lines`).
LINETRACE = Path(__file__).resolve().parent / "linetrace"
PROFILED = ("gateway", "dataproxy", "worker")
# The checkout's top-level packages the services import (the shim checkout links each).
PACKAGES = ("services", "protos", "schema", "stackconfig", "chatml", "grpcpoller", "rollgate")

# (label, substring of a frame's file path); the first that matches the leaf frame names it.
AREAS = (
    ("rollgate: runtime/framed", "services/runtime/framed"),
    ("rollgate: gateway", "services/gateway/"),
    ("rollgate: dataproxy", "services/dataproxy/"),
    ("rollgate: worker", "services/worker/"),
    ("rollgate: runtime", "services/runtime/"),
    ("rollgate: schema/protos", "/schema/"),
    ("protobuf", "google/protobuf"),
    ("grpc", "grpc"),
    ("aiohttp", "aiohttp"),
    ("redis", "redis"),
    ("structlog/logging", "structlog"),
    ("structlog/logging", "logging/"),
    ("prometheus", "prometheus_client"),
    ("msgpack", "msgpack"),
    ("asyncio", "asyncio/"),
    ("uvloop", "uvloop"),
)


NATIVE = "native (no Python frame)"


def area_of(frame: str) -> str:
    """The area a py-spy frame (`function (path:line)`) belongs to."""
    if frame == NATIVE or "(" not in frame:
        return NATIVE
    for label, needle in AREAS:
        if needle in frame:
            return label
    return "other Python"


def stacks(raw: Path) -> Iterator[tuple[list[str], int]]:
    """The stacks of one raw py-spy file (`frame;frame;… count` per line), outermost first,
    and how many samples each had."""
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if stack:
            yield stack.split(";"), int(count_text)


def summarize(raw: Path, top: int) -> str:
    """Shares by area and the top self-time functions of one raw py-spy file."""
    areas: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    total = 0
    for frames, count in stacks(raw):
        # py-spy's first frame is the thread ("process 1:"; "thread (0x…)"), the last the leaf.
        leaf = frames[-1]
        if leaf.startswith(("process ", "thread ")):
            # An idle thread sampled outside Python: no Python frame at all.
            leaf = NATIVE
        areas[area_of(leaf)] += count
        leaves[leaf] += count
        total += count
    if not total:
        return "  (no samples: py-spy saw the process idle)"
    out = [f"  {total} samples; by where the leaf frame lives:"]
    out += [f"    {n / total:6.1%}  {label}" for label, n in areas.most_common()]
    out.append(f"  top {top} functions by self time:")
    out += [f"    {n / total:6.1%}  {leaf}" for leaf, n in leaves.most_common(top)]
    return "\n".join(out)


# A leaf in the loop's poll: the thread waits (py-spy --native tells it apart from work).
_WAITING = ("epoll_wait", "epoll_pwait")
# Frames in at least this share of the busy samples are the trunk (the loop, main): left out.
_TRUNK = 0.9


def _short(path: str) -> str:
    """A frame's file as the summaries name it: from site-packages or the checkout on."""
    for marker in ("site-packages/", "/services/", "/bench/", "/lib/python3"):
        at = path.find(marker)
        if at >= 0:
            return path[at + (len(marker) if marker == "site-packages/" else 1) :]
    return path


def _function(frame: str) -> str:
    """A frame without its line: `name (file)` for Python, the symbol for native code."""
    name, _, where = frame.partition(" (")
    path = where.rpartition(":")[0] if ":" in where else where.rstrip(")")
    return f"{name} ({_short(path)})" if path else name


def summarize_inclusive(raw: Path, top: int) -> str:
    """The functions with the most *inclusive* share of one raw `py-spy --native` file's busy
    samples (a function counted once per stack however often it recurs; samples whose leaf
    waits in the loop's poll left out; so are the trunk every busy stack runs through and the
    frames of C sources — the loop's, CPython's — while a library's, such as a system call in
    libc, is kept). What a turn's phases cost: the self-time view spreads them over hundreds
    of leaves."""
    counts: collections.Counter[str] = collections.Counter()
    busy = 0
    for thread_and_frames, count in stacks(raw):
        frames = thread_and_frames[1:]  # the first is the thread
        if not frames or frames[-1].startswith(_WAITING):
            continue
        busy += count
        for function in {_function(f) for f in frames if not f.startswith("0x")}:
            if not function.endswith((".c)", ".h)")):  # the loop's and CPython's own C
                counts[function] += count
    if not busy:
        return "  (no busy samples)"
    rows = [(f, n) for f, n in counts.most_common() if n < _TRUNK * busy][:top]
    out = [f"  {busy} busy samples; top {top} functions by inclusive share (trunk left out):"]
    out += [f"    {n / busy:6.1%}  {f}" for f, n in rows]
    return "\n".join(out)


def summarize_lines(directory: Path, requests: int, top: int) -> str:
    """The line tracer's counts (bench/linetrace/): per service kind (the workers summed), the
    Python lines run per request and the functions that run the most."""
    by_kind: dict[str, collections.Counter[str]] = {}
    for dump in sorted(directory.glob("*.tsv")):
        kind = dump.stem.rsplit("-", 1)[0]
        counts = by_kind.setdefault(kind, collections.Counter())
        for row in dump.read_text(encoding="utf-8").splitlines():
            count, where, function = row.split("\t")
            file, _, line = where.rpartition(":")
            counts[f"{function} ({_short(file)}:{line})"] += int(count)
    out = []
    per = max(requests, 1)
    for kind in sorted(by_kind):
        counts = by_kind[kind]
        total = sum(counts.values())
        out.append(f"\n## {kind}: {total / per:.0f} Python lines per request; by area:")
        areas: collections.Counter[str] = collections.Counter()
        for name, n in counts.items():
            areas[area_of(name)] += n
        out += [f"  {100 * n / total:8.1f}%  {area}" for area, n in areas.most_common()]
        out.append("  the functions that run the most (lines per request):")
        out += [f"  {n / per:9.1f}  {name}" for name, n in counts.most_common(top)]
    return "\n".join(out) if out else "  (the line tracer wrote nothing)"


def summarize_perf(data: Path, top: int) -> str:
    """Shares by shared object and the top native symbols of one `perf record -g` file, then
    the kernel's functions with what they call included (where the system time goes: the
    write path, the receiver's TCP work done in the writer's softirq, the scheduler)."""
    out = []
    for sort, limit in (("dso", 12), ("dso,sym", top)):
        report = subprocess.run(
            ["perf", "report", "-i", str(data), "--stdio", "--no-children", "--sort", sort,
             "-g", "none", "--percent-limit", "0.3"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        out.append(f"  by {sort}:")
        out += [f"    {row}" for row in perf_rows(report.stdout, limit)]
    report = subprocess.run(
        ["perf", "report", "-i", str(data), "--stdio", "--children", "--sort", "sym",
         "-g", "none", "--percent-limit", "1"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    out.append("  kernel functions, children included (children %, self %):")
    out += [f"    {row}" for row in kernel_rows(report.stdout, top)]
    return "\n".join(out)


def kernel_rows(report: str, limit: int) -> list[str]:
    """The kernel's rows (`[k]`) of a `perf report --children`, the first `limit`."""
    return [row for row in perf_rows(report, 1 << 30) if "[k]" in row][:limit]


def strace_calls(table: str, requests: int) -> list[tuple[str, float]]:
    """`strace -c`'s table as (system call, calls per request), most first."""
    rows = []
    for line in table.splitlines():
        fields = line.split()
        # % time, seconds, usecs/call, calls, [errors,] syscall
        if len(fields) in (5, 6) and fields[3].isdigit() and fields[-1] != "total":
            rows.append((fields[-1], int(fields[3]) / max(requests, 1)))
    return sorted(rows, key=lambda row: -row[1])


def perf_rows(report: str, limit: int) -> list[str]:
    """The first `limit` rows of a `perf report --stdio` (its comment lines dropped)."""
    rows = [ln.strip() for ln in report.splitlines() if ln.strip() and not ln.startswith("#")]
    return rows[:limit]


async def _load(env: run.Environment, cell: run.Cell, seconds: float) -> tuple[int, int]:
    url = run._urls(env)["rollgate"]
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector) as session:
        load = run.Load(session, body=run._request_body(cell), stream=cell.stream)
        lat, _, errors, _ = await load.run(url, env.keys, cell.clients, seconds)
    return len(lat), errors


def _cprofile_root(real: Path, tmp: Path, kind: str, stats: Path) -> str:
    """A checkout for run.environment whose `.venv/bin/python` starts `services.<kind>` under
    bench/cprofile_run.py (the other services as usual): its packages are links to `real`."""
    root = tmp / "cprofile-root"
    (root / ".venv" / "bin").mkdir(parents=True)
    for package in PACKAGES:
        (root / package).symlink_to(real / package)
    python = real / ".venv" / "bin" / "python"
    runner = Path(__file__).resolve().parent / "cprofile_run.py"
    shim = root / ".venv" / "bin" / "python"
    shim.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = -m ] && [ "$2" = services.{kind} ]; then\n'
        f'  shift 2; exec "{python}" "{runner}" "{stats}" services.{kind} "$@"\n'
        "fi\n"
        f'exec "{python}" "$@"\n'
    )
    shim.chmod(0o755)
    return str(root)


def _show_cprofile(stats: Path, top: int) -> None:
    if not stats.exists():
        print(f"\n(no cProfile stats at {stats}: did the service stop cleanly?)")
        return
    print(f"\n## cProfile, CPU clock ({stats}): by own time, then by cumulative time")
    for order in ("tottime", "cumulative"):
        pstats.Stats(str(stats)).strip_dirs().sort_stats(order).print_stats(top)


def _cpu_per_request(
    cell: run.Cell, root: str, args: argparse.Namespace, tmp: Path
) -> tuple[int, int, dict[str, float]]:
    """One measurement of `root`'s stack under the cell's load: requests, errors and each
    process's CPU ms per request."""
    run_args = argparse.Namespace(rollgate_root=root, workers=args.workers, env=args.env)
    with run.environment(cell, run_args, tmp) as env:
        asyncio.run(_load(env, cell, args.warmup_s))
        before = env.processes.cpu_split()
        requests, errors = asyncio.run(_load(env, cell, args.seconds))
        after = env.processes.cpu_split()
    per = {name: sum(split) for name, split in cpu_ms_per_request(before, after, requests).items()}
    return requests, errors, per


def cpu_ms_per_request(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]], requests: int
) -> dict[str, tuple[float, float]]:
    """Each process's CPU ms per request, (user, system), between two `cpu_split` readings."""
    out: dict[str, tuple[float, float]] = {}
    for name in after.keys() & before.keys():
        user, system = (
            1000 * (a - b) / max(requests, 1)
            for a, b in zip(after[name], before[name], strict=True)
        )
        out[name] = (user, system)
    return out


def mock_multiples(per: dict[str, float]) -> dict[str, float]:
    """Each service kind's CPU per request (its replicas summed) and the services' together,
    as multiples of the mock's in the same run."""
    kinds: dict[str, float] = {}
    for name, ms in per.items():
        kind = run.kind_of(name)
        if kind in run.SERVICE_KINDS:
            kinds[kind] = kinds.get(kind, 0.0) + ms
    mock = per["mock"]
    out = {kind: ms / mock for kind, ms in sorted(kinds.items())}
    out["services"] = sum(kinds.values()) / mock
    return out


def ab_report(
    sides: tuple[str, str], pairs: list[tuple[dict[str, float], dict[str, float]]]
) -> str:
    """Per pair and as mean (min-max) per side: each kind's CPU as a multiple of the mock's
    (`mock_multiples`), and the first side's change against the second's."""
    first, second = ([mock_multiples(p[i]) for p in pairs] for i in (0, 1))
    width = max(len(sides[0]), len(sides[1]), 8)
    lines = [f"CPU per request as a multiple of the mock's, {len(pairs)} alternating pairs:"]
    for kind in first[0]:
        lines.append(f"  {kind}")
        means = []
        for side, runs in zip(sides, (first, second), strict=True):
            values = [r[kind] for r in runs]
            means.append(sum(values) / len(values))
            each = " ".join(f"{v:.3f}" for v in values)
            lines.append(
                f"    {side:{width}s} {means[-1]:.3f} ({min(values):.3f}-{max(values):.3f})  "
                f"[{each}]"
            )
        a, b = means
        lines.append(f"    {'change':{width}s} {100 * (a - b) / b:+.1f} %")
    return "\n".join(lines)


def _against(cell: run.Cell, args: argparse.Namespace) -> int:
    roots = (args.rollgate_root, args.against)
    pairs: list[tuple[dict[str, float], dict[str, float]]] = []
    for number in range(args.pairs):
        measured = []
        for root in roots:
            with tempfile.TemporaryDirectory(prefix="rollgate-ab-") as tmp:
                requests, errors, per = _cpu_per_request(cell, root, args, Path(tmp))
            print(
                f"pair {number + 1}, {root}: {requests} requests, {errors} errors; services / "
                f"mock {mock_multiples(per)['services']:.3f}",
                flush=True,
            )
            measured.append(per)
        pairs.append((measured[0], measured[1]))
    print(f"\n{cell.title}")
    print(ab_report(roots, pairs))
    return 0


def _idle_report(
    at_start: dict[str, dict[str, float]], at_end: dict[str, dict[str, float]], seconds: float
) -> str:
    """CPU ms per second of each process over the idle period, and of its busy threads."""
    lines = [f"idle stack, CPU ms per second over {seconds:.0f} s (threads by name):"]
    for name in sorted(at_end):
        before = at_start.get(name, {})
        per_thread = {
            thread: 1000 * (cpu - before.get(thread, 0.0)) / seconds
            for thread, cpu in at_end[name].items()
        }
        busy = sorted(((ms, t) for t, ms in per_thread.items() if ms > 0), reverse=True)
        threads = ", ".join(f"{t} {ms:.2f}" for ms, t in busy)
        lines.append(f"  {name:12s} {sum(per_thread.values()):7.2f}  {threads}".rstrip())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Profiles the chosen cell (or the idle stack) and prints each process's summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--cell", default="unary-16", choices=[c.name for c in run.CELLS])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--idle", action="store_true", help="no load: CPU each process burns")
    parser.add_argument("--native", action="store_true", help="C frames too (py-spy --native)")
    parser.add_argument(
        "--strace",
        action="store_true",
        help="count each service's system calls per request with `strace -c` instead of "
        "sampling (strace slows the processes: the counts are the point, not the CPU)",
    )
    parser.add_argument(
        "--perf",
        action="store_true",
        help="sample with `perf record` instead of py-spy: CPU by shared object (interpreter, "
        "uvloop, kernel, protobuf, ...) and the native symbols with the most self time",
    )
    parser.add_argument(
        "--cprofile",
        choices=PROFILED,
        help="run this service under cProfile (CPU clock) instead of sampling it with py-spy",
    )
    parser.add_argument(
        "--lines",
        action="store_true",
        help="count the Python lines each service's functions run per request (a line tracer, "
        "bench/linetrace/) instead of sampling",
    )
    parser.add_argument("--rollgate-root", default=str(run.REPO))
    parser.add_argument(
        "--against",
        metavar="DIR",
        help="no profiling: measure --rollgate-root and DIR in turn, --pairs times, and compare "
        "each service's CPU as a multiple of the mock's",
    )
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--env", action="append", default=[], type=run._assignment)
    args = parser.parse_args(argv)
    if args.against:
        uvloop.install()
        return _against(next(c for c in run.CELLS if c.name == args.cell), args)
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not (args.idle or args.lines) and not Path(spy).exists():
        print("py-spy is missing: pip install py-spy", file=sys.stderr)
        return 2
    uvloop.install()
    cell = next(c for c in run.CELLS if c.name == args.cell)
    RESULTS.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rollgate-profile-") as tmp:
        root = args.rollgate_root
        stats = RESULTS / f"cprofile-{cell.name}-{args.cprofile}.prof"
        if args.cprofile:
            root = _cprofile_root(Path(args.rollgate_root), Path(tmp), args.cprofile, stats)
            args.rate = 0
        traced = Path(tmp) / "lines"
        if args.lines:
            traced.mkdir()
            paths = [str(LINETRACE), *filter(None, [os.environ.get("PYTHONPATH")])]
            args.env = [
                *args.env,
                ("PYTHONPATH", os.pathsep.join(paths)),
                ("ROLLGATE_LINE_TRACE_DIR", str(traced)),
            ]
            args.rate = 0
        run_args = argparse.Namespace(rollgate_root=root, workers=args.workers, env=args.env)
        with run.environment(cell, run_args, Path(tmp)) as env:
            pids = env.processes.pids
            if args.idle:
                at_start = env.processes.thread_cpu_s()
                time.sleep(args.seconds)  # the stack idles meanwhile: what is measured
                print(_idle_report(at_start, env.processes.thread_cpu_s(), args.seconds))
                return 0
            asyncio.run(_load(env, cell, args.warmup_s))
            names = [n for n in pids if run.kind_of(n) in PROFILED]
            # One worker is enough (they share the load); the first of each kind.
            chosen: dict[str, str] = {}
            for name in sorted(names):
                chosen.setdefault(run.kind_of(name), name)
            spies = {}
            if args.strace:
                args.rate = 0
                chosen = {n: n for n in names}  # every worker: calls per request add up
            for name in chosen.values() if args.strace else ():
                out = RESULTS / f"strace-{cell.name}-{name}.txt"
                spies[name] = (
                    out,
                    subprocess.Popen(
                        ["strace", "-c", "-f", "-p", str(pids[name]), "-o", str(out)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    ),
                )  # fmt: skip
            if args.strace:
                time.sleep(0.5)  # strace attaches to every thread before the load starts
            for kind, name in chosen.items() if args.rate and args.perf else ():
                out = RESULTS / f"perf-{cell.name}-{kind}.data"
                spies[name] = (
                    out,
                    subprocess.Popen(
                        ["perf", "record", "-g", "-F", str(args.rate), "-p", str(pids[name]),
                         "-o", str(out), "--", "sleep", str(args.seconds)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    ),
                )  # fmt: skip
            for kind, name in chosen.items() if args.rate and not args.perf else ():
                out = RESULTS / f"profile-{cell.name}-{kind}.txt"
                spies[name] = (
                    out,
                    subprocess.Popen(
                        [spy, "record", "--pid", str(pids[name]), "--rate", str(args.rate),
                         "--duration", str(int(args.seconds)), "--format", "raw",
                         "--threads", "--output", str(out),
                         *(["--native"] if args.native else ["--nonblocking"])],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    ),
                )  # fmt: skip
            traced_pids = [p for n, p in pids.items() if run.kind_of(n) in run.SERVICE_KINDS]
            for pid in traced_pids if args.lines else ():
                os.kill(pid, signal.SIGUSR2)  # the count starts again: after the warm-up
            before, switched = env.processes.cpu_split(), env.processes.switches()
            requests, errors = asyncio.run(_load(env, cell, args.seconds))
            after, switches = env.processes.cpu_split(), env.processes.switches()
            for _, process in spies.values():
                if args.strace:
                    process.send_signal(signal.SIGINT)  # strace -c writes its table then
                process.wait(timeout=60)
        # The services wrote their counts as they stopped.
        lines = summarize_lines(traced, requests, args.top) if args.lines else ""
    print(f"{cell.title}: {requests} requests, {errors} errors in {args.seconds:.0f} s")
    print("CPU ms per request (user + system); context switches per request (waited, preempted):")
    total = 0.0
    cpu = cpu_ms_per_request(before, after, requests)
    for name in sorted(cpu):
        user, system = cpu[name]
        if run.kind_of(name) in run.SERVICE_KINDS:
            total += user + system
        waited, taken = (
            (a - b) / max(requests, 1)
            for a, b in zip(switches.get(name, (0, 0)), switched.get(name, (0, 0)), strict=True)
        )
        print(
            f"  {name:12s} {user + system:6.3f}  ({user:.3f} + {system:.3f})"
            f"  switches {waited:5.2f}, {taken:5.2f}"
        )
    print(f"  {'services':12s} {total:6.3f}")
    if args.cprofile:
        _show_cprofile(stats, args.top)
    if args.lines:
        print(lines)
    for name, (out, _) in spies.items():
        print(f"\n## {name} ({out})")
        if not out.exists():
            print("  (the profiler wrote nothing)")
        elif args.strace:
            rows = [r for r in strace_calls(out.read_text(), requests) if r[1] >= 0.01]
            calls = ", ".join(f"{n} {c:.2f}" for n, c in rows[: args.top])
            print(f"  system calls per request: {calls}")
        elif args.perf:
            print(summarize_perf(out, args.top))
        else:
            print(summarize(out, args.top))
            if args.native:
                print(summarize_inclusive(out, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
