"""The supervisor behind `rollgate up`, over real processes: backoff, reset, giving up."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest

from rollgate.stack import ServiceProcess
from rollgate.supervisor import GaveUp, RestartPolicy, Supervisor
from tests.harness.poll import eventually_sync

CRASHES = "import sys; print('boom: ROLLGATE_SOMETHING is not set', flush=True); sys.exit(3)"
SLEEPS = "import time; time.sleep(120)"  # a child that keeps running until it is stopped


def _process(tmp_path: Path, name: str, code: str) -> ServiceProcess:
    process = ServiceProcess(
        name=name,
        argv=[sys.executable, "-c", code],
        env={},
        address="127.0.0.1:1",
        log_path=tmp_path / f"{name}.log",
        kind="worker",
    )
    process.start()
    return process


def _check_until(supervisor: Supervisor, done: object, timeout_s: float = 60.0) -> None:

    def checked() -> bool:
        supervisor.check()
        return callable(done) and bool(done())

    eventually_sync(checked, timeout_s=timeout_s, interval_s=0.01, what="the supervisor got there")


def test_a_service_that_keeps_crashing_fast_is_restarted_with_doubling_backoff_then_given_up(
    tmp_path: Path,
) -> None:
    process = _process(tmp_path, "worker-1", CRASHES)
    said: list[str] = []
    log_path = tmp_path / "rollgate-up.log"
    policy = RestartPolicy(backoff_s=0.01, max_backoff_s=0.04, max_fast_crashes=5)
    supervisor = Supervisor([process], policy=policy, log_path=log_path, say=said.append)
    with pytest.raises(GaveUp) as raised:
        _check_until(supervisor, lambda: False)
    assert supervisor.restarts("worker-1") == 4
    assert supervisor.delays("worker-1") == [0.01, 0.02, 0.04, 0.04]
    assert raised.value.name == "worker-1"
    assert "boom: ROLLGATE_SOMETHING is not set" in raised.value.log_tail
    message = str(raised.value)
    assert "worker-1 exited with code 3 5 times in a row" in message
    assert "giving up" in message
    assert said[0] == "rollgate: worker-1 exited with code 3 after " + said[0].split("after ")[1]
    assert said[-1] == f"rollgate: {message}"
    events = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert [e["event"] for e in events].count("service_exited") == 4
    assert [e["event"] for e in events].count("service_restarted") == 4
    assert events[-1]["event"] == "service_gave_up"
    assert {e["service"] for e in events} == {"worker-1"}


def test_a_crash_after_a_long_run_starts_the_count_again(tmp_path: Path) -> None:
    process = _process(tmp_path, "worker-2", CRASHES)
    # Every run counts as long: the backoff never grows and the supervisor never gives up.
    policy = RestartPolicy(backoff_s=0.01, fast_crash_s=0.0, max_fast_crashes=2)
    supervisor = Supervisor([process], policy=policy, say=lambda _: None)
    _check_until(supervisor, lambda: supervisor.restarts("worker-2") >= 6)
    assert set(supervisor.delays("worker-2")) == {0.01}


def test_a_killed_service_is_restarted_and_runs_again(tmp_path: Path) -> None:
    process = _process(tmp_path, "router", SLEEPS)
    said: list[str] = []
    supervisor = Supervisor([process], policy=RestartPolicy(backoff_s=0.01), say=said.append)
    first = process.process
    assert first is not None
    try:
        supervisor.check()
        assert said == [], "a running service is left alone"
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        _check_until(supervisor, lambda: supervisor.restarts("router") == 1 and process.alive)
        assert process.process is not first
        assert said[0].startswith("rollgate: router was killed by SIGKILL after ")
        assert said[0].endswith("; restarting in 0.01 s")
        assert said[1] == "rollgate: router restarted (restart 1)"
    finally:
        process.signal(signal.SIGKILL)
        process.wait(10)
