"""bench/run.py's summary of a cell's rounds: the ratios, the CPU per request by process kind,
and the table's columns."""

from __future__ import annotations

from tests.bench.test_hotspots import _load


def test_a_cell_s_cpu_is_read_per_request_and_against_the_floor_and_the_mock() -> None:
    run = _load("run")
    cell = next(c for c in run.CELLS if c.name == "unary-16")

    def measured(target: str, rps: float, cpu_s: dict[str, float]) -> object:
        return run.Round(
            target=target,
            round=0,
            requests=1000,
            errors=0,
            seconds=10.0,
            rps=rps,
            p50_ms=20.0 if target == "direct" else 23.0,
            p99_ms=30.0,
            ttft_p50_ms=0.0,
            cpu_s=cpu_s,
        )

    rounds = [
        measured("direct", 100.0, {"mock": 0.2}),
        measured("floor", 95.0, {"mock": 0.2, "floor": 0.3}),
        # 1000 requests: 0.4 s of gateway CPU is 0.4 ms a request; two workers add up.
        measured(
            "rollgate",
            80.0,
            {
                "mock": 0.25,
                "gateway": 0.4,
                "router": 0.01,
                "dataproxy": 0.29,
                "worker-1": 0.15,
                "worker-2": 0.15,
                "redis": 0.1,
            },
        ),
    ]
    summary = run.summarize(cell, rounds)
    assert summary["services_cpu_ms"] == 1.0  # redis and the mock are not the services'
    assert round(summary["cpu_to_floor"], 6) == round(1.0 / 0.3, 6)
    assert summary["services_to_mock"] == 4.0
    assert summary["to_floor"].median == 80.0 / 95.0
    assert summary["goals"]["CPU <= 3x floor"] is False
    header, rule, row = run.table([summary]).splitlines()
    assert header.count("|") == rule.count("|") == row.count("|")
    assert header.rstrip(" |").endswith("services / mock")
    assert row.endswith("| 3.3x | 4.00 |")
    assert "services / mock 4.00" in run._show_cell(summary)


def test_a_run_says_how_fast_the_machine_was_and_on_which_interpreter() -> None:
    import sys

    run = _load("run")
    speed = run.machine_speed_us()
    # sum(range(1000)) is a thousand additions: microseconds on any machine this runs on.
    assert 0.5 < speed < 1000.0
    line = run.machine_line("at the start", 12.34)
    assert line.startswith("machine at the start: sum(range(1000)) 12.3 µs (Python 3.")
    assert line.endswith(f", {sys.executable})")
