"""bench/hotspots.py: py-spy's raw samples summarised by where the leaf frame lives, and the
shim checkout that starts one service under cProfile and every other one as usual."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str) -> ModuleType:
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up by name
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def _raw(tmp_path: Path, *stacks: str) -> Path:
    """A raw py-spy file of these `frame;frame;… count` lines."""
    raw = tmp_path / "raw.txt"
    raw.write_text("".join(stack + "\n" for stack in stacks))
    return raw


def test_samples_are_summed_by_area_and_by_leaf(tmp_path: Path) -> None:
    raw = _raw(
        tmp_path,
        "thread (1);run (asyncio/runners.py:118) 50",
        "thread (1);run (asyncio/runners.py:118);send (services/runtime/framed.py:183) 30",
        "thread (1);run (asyncio/runners.py:118);x (services/gateway/relay.py:9) 15",
        "thread (2) 5",
    )
    text = _load("hotspots").summarize(raw, top=2)
    assert "100 samples" in text
    assert " 50.0%  asyncio" in text
    assert " 30.0%  rollgate: runtime/framed" in text
    assert " 15.0%  rollgate: gateway" in text
    assert "   5.0%  native (no Python frame)" in text
    # The top functions by self time, most first.
    tops = text.split("top 2 functions by self time:")[1].splitlines()
    assert "run (asyncio/runners.py:118)" in tops[1]
    assert "send (services/runtime/framed.py:183)" in tops[2]


def test_the_shim_profiles_only_the_chosen_service(tmp_path: Path) -> None:
    hotspots = _load("hotspots")
    real = tmp_path / "real"
    (real / ".venv" / "bin").mkdir(parents=True)
    (real / ".venv" / "bin" / "python").symlink_to(sys.executable)
    for package in hotspots.PACKAGES:
        (real / package).mkdir()
    stats = tmp_path / "out.prof"
    root = Path(hotspots._cprofile_root(real, tmp_path, "dataproxy", stats))
    shim = root / ".venv" / "bin" / "python"
    # Another module runs as it would (no profile written)...
    done = subprocess.run(
        [str(shim), "-c", "print('plain')"], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "plain" and not stats.exists()
    # ...and the chosen service's command line goes through cprofile_run.py.
    text = shim.read_text()
    assert "services.dataproxy" in text and "cprofile_run.py" in text and str(stats) in text
    assert (root / "services").resolve() == (real / "services").resolve()


def test_another_checkout_runs_with_its_venv_else_this_interpreter(tmp_path: Path) -> None:
    run = _load("run")
    bare = tmp_path / "bare"
    bare.mkdir()
    assert run._python_of(bare) == Path(sys.executable)
    own = bare / ".venv" / "bin" / "python"
    own.parent.mkdir(parents=True)
    own.write_text("")
    assert run._python_of(bare) == own


def test_the_shim_links_every_package_of_the_checkout() -> None:
    """A package the services import but the shim does not link would come from elsewhere."""
    from tests.test_style import PACKAGES

    assert sorted(_load("hotspots").PACKAGES) == sorted(PACKAGES)


def test_a_perf_report_is_cut_to_its_rows_and_the_kernel_rows_kept() -> None:
    hotspots = _load("hotspots")
    report = (
        "# To display the perf.data header info, please use --header/--header-only options.\n"
        "#\n"
        "# Overhead  Shared Object\n"
        "# ........  .............\n"
        "#\n"
        "    64.36%  libpython3.11.so.1.0\n"
        "    14.76%  [kernel.kallsyms]\n"
        "\n"
        "     6.11%  _message.abi3.so\n"
    )
    assert hotspots.perf_rows(report, 2) == [
        "64.36%  libpython3.11.so.1.0",
        "14.76%  [kernel.kallsyms]",
    ]
    assert len(hotspots.perf_rows(report, 10)) == 3
    # A `--children` report: only the kernel's rows are kept for its section.
    children = (
        "# Children      Self  Symbol\n"
        "#\n"
        "    30.48%     0.00%  [.] 0x00007f4f2fa56240\n"
        "    14.94%     0.38%  [k] do_syscall_64\n"
        "     9.67%     0.08%  [.] __GI___libc_write\n"
        "     7.77%     0.04%  [k] sock_write_iter\n"
        "     4.77%     0.08%  [k] net_rx_action\n"
    )
    kernel = hotspots.kernel_rows(children, 10)
    assert kernel[:2] == [
        "14.94%     0.38%  [k] do_syscall_64",
        "7.77%     0.04%  [k] sock_write_iter",
    ]
    assert len(kernel) == 3 and len(hotspots.kernel_rows(children, 1)) == 1


def test_an_strace_table_is_read_as_calls_per_request() -> None:
    hotspots = _load("hotspots")
    table = (
        "% time     seconds  usecs/call     calls    errors syscall\n"
        "------ ----------- ----------- --------- --------- ----------------\n"
        " 40.00    0.004000           2      2000           write\n"
        " 30.00    0.003000           1      3000       120 read\n"
        "  0.10    0.000010          10         1           brk\n"
        "------ ----------- ----------- --------- --------- ----------------\n"
        "100.00    0.007010           1      5001       120 total\n"
    )
    assert hotspots.strace_calls(table, 1000) == [("read", 3.0), ("write", 2.0), ("brk", 0.001)]


def test_the_idle_report_names_each_process_s_busy_threads() -> None:
    hotspots = _load("hotspots")
    start = {"router": {"python3": 1.0, "event_engine": 0.5}, "floor": {"python3": 2.0}}
    end = {
        "router": {"python3": 1.06, "event_engine": 0.53, "grpc_global_tim": 0.0},
        "floor": {"python3": 2.0},
    }
    lines = hotspots._idle_report(start, end, 30.0).splitlines()
    assert lines[0].startswith("idle stack, CPU ms per second over 30 s")
    floor, router = lines[1].split(), lines[2].split()
    assert floor == ["floor", "0.00"]  # nothing busy: no threads listed
    # 60 ms and 30 ms over 30 s; the thread that used nothing is left out.
    assert router == ["router", "3.00", "python3", "2.00,", "event_engine", "1.00"]


def test_threads_are_read_from_proc_by_name() -> None:
    run = _load("run")
    processes = run.Processes()
    processes.pids = {"me": os.getpid()}
    threads = processes.thread_cpu_s()["me"]
    # Named by the kernel: the main thread after the program, others as their creator set.
    assert threads and all(cpu >= 0 for cpu in threads.values())
    assert sum(threads.values()) <= processes.cpu_s()["me"] + 0.05


def test_cprofile_run_profiles_the_checkout_it_runs_in(tmp_path: Path) -> None:
    # `--rollgate-root` runs another checkout's services: its `services` package, found from
    # the working directory as `python -m` finds it, not this one's (an editable install).
    package = tmp_path / "services"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "probe.py").write_text("print(__file__)\n")
    stats = tmp_path / "out.prof"
    runner = Path(__file__).resolve().parents[2] / "bench" / "cprofile_run.py"

    done = subprocess.run(
        [sys.executable, str(runner), str(stats), "services.probe"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )

    assert Path(done.stdout.strip()) == package / "probe.py"
    assert stats.exists()


def test_an_ab_comparison_reads_each_service_against_the_mock_of_its_own_run() -> None:
    hotspots = _load("hotspots")
    # Two runs of one side: the VM twice as slow in the second, the services' share the same.
    fast = {"gateway": 0.4, "dataproxy": 0.2, "worker-1": 0.1, "worker-2": 0.1, "mock": 0.4}
    slow = {name: 2 * ms for name, ms in fast.items()}
    slow["redis"] = 0.3  # neither a service nor the mock: left out
    assert (
        hotspots.mock_multiples(fast)
        == hotspots.mock_multiples({**slow, "redis": 0.0})
        == {
            "dataproxy": 0.5,
            "gateway": 1.0,
            "worker": 0.5,
            "services": 2.0,
        }
    )
    # The other side spends 10 % more in the gateway, in both of its runs.
    more = {**fast, "gateway": 0.44}

    text = hotspots.ab_report(("after", "before"), [(more, fast), (more, slow)])

    lines = text.splitlines()
    assert lines[0] == "CPU per request as a multiple of the mock's, 2 alternating pairs:"
    gateway = lines[lines.index("  gateway") + 1 : lines.index("  gateway") + 4]
    assert gateway[0].split()[:3] == ["after", "1.100", "(1.100-1.100)"]
    assert gateway[1].split()[:3] == ["before", "1.000", "(1.000-1.000)"]
    assert gateway[2].split() == ["change", "+10.0", "%"]
    services = lines[lines.index("  services") + 3]
    assert services.split() == ["change", "+5.0", "%"]


def test_inclusive_shares_count_a_function_once_per_busy_stack(tmp_path: Path) -> None:
    raw = _raw(
        tmp_path,
        # Waiting in the loop's poll: not busy.
        "thread (1);run (asyncio/runners.py:118);uv_run;epoll_pwait 60",
        # Busy: `handle` twice in one stack (recursion) counts once; 0x… frames are skipped.
        "thread (1);run (asyncio/runners.py:118);handle (services/gateway/edge.py:3);"
        "handle (services/gateway/edge.py:9);0x7f00;dump_json (services/gateway/json_body.py:70)"
        " 30",
        "thread (1);run (asyncio/runners.py:118);uv__write (stream.c);write (libc.so.6) 10",
    )
    text = _load("hotspots").summarize_inclusive(raw, top=5)
    assert "40 busy samples" in text
    rows = text.splitlines()[1:]
    # `run` is in every busy stack: the trunk, left out.
    assert not any("run (asyncio/runners.py)" in r for r in rows)
    assert sorted(r.split() for r in rows) == [
        ["25.0%", "write", "(libc.so.6)"],
        ["75.0%", "dump_json", "(services/gateway/json_body.py)"],
        ["75.0%", "handle", "(services/gateway/edge.py)"],
    ]
    assert not any("0x7f00" in r or "stream.c" in r for r in rows)


def test_the_line_tracer_counts_each_function_s_lines_from_its_restart(tmp_path: Path) -> None:
    # A package run with `-m`, as the services are: its dump is named after the package.
    package = tmp_path / "svc"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(
        "import os, signal\n"
        "def three():\n"
        "    a = 1\n"
        "    b = 2\n"
        "    return a + b\n"
        "for _ in range(5):\n"
        "    three()\n"
        "os.kill(os.getpid(), signal.SIGUSR2)  # the count starts again\n"
        "for _ in range(4):\n"
        "    three()\n"
    )
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(BENCH / "linetrace"), str(tmp_path)]),
        "ROLLGATE_LINE_TRACE_DIR": str(dumps),
    }
    subprocess.run([sys.executable, "-m", "svc"], env=env, check=True, timeout=60)
    (dump,) = dumps.glob("*.tsv")
    assert dump.name.startswith("svc-")
    rows = {row.split("\t")[2]: row.split("\t") for row in dump.read_text().splitlines()}
    assert rows["three"][0] == "12"  # 3 lines, 4 calls after the restart (5 before it)
    assert rows["three"][1] == f"{package / '__main__.py'}:2"


def test_the_line_counts_are_summed_per_service_kind_and_request(tmp_path: Path) -> None:
    (tmp_path / "worker-11.tsv").write_text(
        "300\t/x/.venv/lib/python3.11/site-packages/prometheus_client/metrics.py:667\tobserve\n"
        "100\t/x/services/worker/http1.py:402\tHttp1Response._dechunk\n"
    )
    (tmp_path / "worker-12.tsv").write_text("100\t/x/services/worker/http1.py:402\t_dechunk\n")
    (tmp_path / "gateway-13.tsv").write_text("50\t/x/services/gateway/chat.py:103\tchat\n")
    text = _load("hotspots").summarize_lines(tmp_path, requests=10, top=5)
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines[0] == "## gateway: 5 Python lines per request; by area:"
    assert lines[1].split() == ["100.0%", "rollgate:", "gateway"]
    assert lines[3].split() == ["5.0", "chat", "(services/gateway/chat.py:103)"]
    assert lines[4] == "## worker: 50 Python lines per request; by area:"
    assert [line.split() for line in lines[5:7]] == [
        ["60.0%", "prometheus"],
        ["40.0%", "rollgate:", "worker"],
    ]
    # Both workers' counts of a function add up; files are named from the package on.
    assert lines[8].split() == ["30.0", "observe", "(prometheus_client/metrics.py:667)"]
    assert sorted(lines[9:]) == sorted(
        [
            "       10.0  Http1Response._dechunk (services/worker/http1.py:402)",
            "       10.0  _dechunk (services/worker/http1.py:402)",
        ]
    )
