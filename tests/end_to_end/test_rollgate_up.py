"""`rollgate up` itself, as a user runs it: banner, generated admin key, Ctrl-C stops everything."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from rollgate.redis_server import free_port
from tests.harness.poll import eventually_sync
from tests.harness.secret_scan import ISSUED

ROLLGATE = str(Path(sys.executable).parent / "rollgate")


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    out: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return out


def _read_until(lines: queue.Queue[str], marker: str, timeout_s: float) -> list[str]:
    seen: list[str] = []

    def printed() -> bool:
        try:
            seen.append(lines.get(timeout=0.2))
        except queue.Empty:
            return False
        return marker in seen[-1]

    try:
        eventually_sync(printed, timeout_s=timeout_s, interval_s=0)
    except AssertionError:
        raise AssertionError(f"{marker!r} not printed in {timeout_s}s:\n{''.join(seen)}") from None
    return seen


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def test_rollgate_up_prints_how_to_use_it_and_ctrl_c_stops_every_process(
    redis_url: str, tmp_path: Path
) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "ROLLGATE_ADMIN_KEY"}
    env["REDIS_URL"] = redis_url
    env["ROLLGATE_REDIS_PREFIX"] = f"rgup:{port}:"
    proc = subprocess.Popen(
        [ROLLGATE, "up", "--port", str(port), "--state-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        # Ctrl-C goes to the whole foreground group in a terminal; here we signal `up` alone.
        start_new_session=True,
        # As a shell starts a background job: SIGINT arrives ignored, and must still work.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        lines = _lines(proc)
        banner = "".join(_read_until(lines, "Ctrl-C stops everything", 90))
        assert f"gateway http://127.0.0.1:{port}" in banner
        assert "MOCK LLM" in banner
        assert '"model": "rollgate-mock"' in banner, "the curl names a model that is served"
        admin_key = next(
            line.split(":", 1)[1].split()[0] for line in banner.splitlines() if "admin key" in line
        )
        assert admin_key.startswith("rg-admin-")
        # Printed on the terminal by design; never in a log file (scanned at the end).
        ISSUED.add(admin_key)
        ISSUED.watch(tmp_path / "logs")
        state = json.loads((tmp_path / "stack.json").read_text())
        assert state["gateway_url"] == f"http://127.0.0.1:{port}"
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/rl/start_session",
            data=b"{}",
            headers={"Authorization": f"Bearer {admin_key}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as resp:
            assert json.loads(resp.read())["api_key"].startswith("sk-sess-")
        trainer_port = int(state["trainer_address"].rsplit(":", 1)[1])
        # Where the metrics are: printed, in stack.json, and each one answers.
        assert set(state["metrics"]) == {"router", "dataproxy", "worker-1", "worker-2", "gateway"}
        assert f"{port}/metrics" not in banner
        for name, url in state["metrics"].items():
            assert url in banner, name
            with urllib.request.urlopen(url, timeout=10) as resp:
                text = resp.read().decode()
            assert f'rollgate_build_info{{service="{name.split("-")[0]}"' in text, name
            assert admin_key not in text
        assert f"console   : http://127.0.0.1:{port}/console" in banner
    finally:
        # Ctrl-C under `make run` reaches `up` twice (make forwards it); the second one lands
        # while the services are being stopped, and must not cut that short.
        proc.send_signal(signal.SIGINT)
        _read_until(lines, "rollgate: stopping", 30)
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.terminate()
            code = proc.wait(timeout=60)
    assert code == 0
    assert not (tmp_path / "stack.json").exists(), "a stopped stack left its stack.json"
    assert not _port_open(port), "the gateway still listens after Ctrl-C"
    assert not _port_open(trainer_port), "the dataproxy still listens after Ctrl-C"
    left = _processes_with_env("ROLLGATE_REDIS_PREFIX", env["ROLLGATE_REDIS_PREFIX"])
    assert not left, f"services still running after Ctrl-C: {left}"


def _processes_with_env(name: str, value: str) -> list[str]:
    """Command lines of the processes whose environment has name=value (the stack's own)."""
    wanted = f"{name}={value}".encode()
    found = []
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit():
            continue
        try:
            if wanted in (proc_dir / "environ").read_bytes().split(b"\0"):
                found.append((proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return found


def _post(url: str, key: str, body: dict[str, object]) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def _chat_until_ok(gateway: str, key: str, timeout_s: float = 60.0) -> dict[str, object]:
    """A chat turn, retried while the stack recovers (503s), until it answers 200."""
    body = {"model": "rollgate-mock", "messages": [{"role": "user", "content": "hi"}]}

    def answered() -> dict[str, object] | None:
        status, answer = _post(f"{gateway}/v1/chat/completions", key, body)
        assert status in (200, 502, 503), answer
        return answer if status == 200 else None

    return eventually_sync(answered, timeout_s=timeout_s, interval_s=0.2, what="a chat answered")


def _pid_of(predicate: object, timeout_s: float = 10.0) -> int:

    def found() -> int | None:
        for proc_dir in Path("/proc").iterdir():
            if not proc_dir.name.isdigit():
                continue
            try:
                cmdline = (proc_dir / "cmdline").read_bytes().split(b"\0")
                environ = (proc_dir / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if callable(predicate) and predicate(cmdline, environ):
                return int(proc_dir.name)
        return None

    return eventually_sync(found, timeout_s=timeout_s, what="the process")


def _files_contain(directory: Path, needle: bytes, timeout_s: float = 10.0) -> None:
    eventually_sync(
        lambda: any(p.is_file() and needle in p.read_bytes() for p in directory.rglob("*")),
        timeout_s=timeout_s,
        what=f"{needle!r} in the files under {directory}",
    )


def test_rollgate_up_restarts_a_killed_worker_and_a_killed_embedded_redis(
    tmp_path: Path,
) -> None:
    port = free_port()
    prefix = f"rgsup:{port}:"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"ROLLGATE_ADMIN_KEY", "REDIS_URL", "ROLLGATE_REDIS_URL"}
    }
    env["ROLLGATE_REDIS_PREFIX"] = prefix
    admin_key = "rg-admin-supervised-" + os.urandom(8).hex()
    ISSUED.add(admin_key)
    ISSUED.watch(tmp_path / "logs")
    stale = {"gateway_url": "http://stale.invalid", "pid": 1}
    (tmp_path / "stack.json").write_text(json.dumps(stale))
    proc = subprocess.Popen(
        [ROLLGATE, "up", "--port", str(port), "--state-dir", str(tmp_path),
         "--admin-key", admin_key, "--workers", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )  # fmt: skip
    lines = _lines(proc)
    try:
        # stack.json: never this run's before /ready answers 200, never the stale one after.

        def ours() -> dict[str, Any] | None:
            try:
                state: dict[str, Any] = json.loads((tmp_path / "stack.json").read_text())
            except (OSError, ValueError):
                state = {}
            assert proc.poll() is None, "rollgate up exited during start-up"
            if state.get("pid") != proc.pid:
                return None
            with urllib.request.urlopen(f"{state['gateway_url']}/ready", timeout=5) as resp:
                assert resp.status == 200, "stack.json was written before /ready answered"
            return state

        state = eventually_sync(ours, timeout_s=90, interval_s=0.02, what="this run's stack.json")
        _read_until(lines, "Ctrl-C stops everything", 30)
        gateway = f"http://127.0.0.1:{port}"
        status, started = _post(f"{gateway}/rl/start_session", admin_key, {})
        assert status == 200, started
        key = str(started["api_key"])
        _chat_until_ok(gateway, key)

        worker = _pid_of(lambda cmd, environ: b"ROLLGATE_WORKER_ID=worker-1" in environ
                         and f"ROLLGATE_REDIS_PREFIX={prefix}".encode() in environ)  # fmt: skip
        os.kill(worker, signal.SIGKILL)
        _read_until(lines, "rollgate: worker-1 was killed by SIGKILL", 30)
        _read_until(lines, "rollgate: worker-1 restarted (restart 1)", 30)
        _read_until(lines, "rollgate: worker-1 is healthy again", 60)
        _chat_until_ok(gateway, key)

        redis_dir = tmp_path / "redis"
        digest = hashlib.sha256(key.encode()).hexdigest()
        # The session is on disk (the AOF) before Redis dies: what a restart must bring back.
        _files_contain(redis_dir, digest.encode())
        # redis-server rewrites its command line (and environment) to `redis-server HOST:PORT`.
        redis_port = state["redis_url"].rsplit(":", 1)[1].split("/")[0]
        redis_pid = _pid_of(lambda cmd, environ: b"redis-server" in cmd[0]
                            and cmd[0].split()[1:2] == [f"127.0.0.1:{redis_port}".encode()])  # fmt: skip
        os.kill(redis_pid, signal.SIGKILL)
        _read_until(lines, "rollgate: redis was killed by SIGKILL", 30)
        _read_until(lines, "rollgate: redis restarted (restart 1)", 30)
        answer = _chat_until_ok(gateway, key)
        status, rewarded = _post(f"{gateway}/rl/set_reward", key, {"reward": 1.0})
        assert status == 200, rewarded
        assert rewarded["interaction_id"] == answer["id"], "the session survived the restart"
        events = [
            json.loads(line)
            for line in (tmp_path / "logs" / "rollgate-up.log").read_text().splitlines()
        ]
        happened = {(e["event"], e["service"]) for e in events}
        assert {
            ("service_exited", "worker-1"),
            ("service_restarted", "worker-1"),
            ("service_recovered", "worker-1"),
            ("service_exited", "redis"),
            ("service_restarted", "redis"),
        } <= happened
        assert proc.poll() is None, "rollgate up kept running through both crashes"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait(timeout=60)
    assert code == 0
    assert not _processes_with_env("ROLLGATE_REDIS_PREFIX", prefix)


def test_rollgate_up_gives_up_only_after_five_fast_crashes_in_a_row_and_stops_everything(
    redis_url: str, tmp_path: Path
) -> None:
    port = free_port()
    prefix = f"rggiveup:{port}:"
    env = {k: v for k, v in os.environ.items() if k != "ROLLGATE_ADMIN_KEY"}
    env.update(REDIS_URL=redis_url, ROLLGATE_REDIS_PREFIX=prefix)
    proc = subprocess.Popen(
        [ROLLGATE, "up", "--port", str(port), "--state-dir", str(tmp_path), "--workers", "1",
         "--admin-key", "rg-admin-giveup-" + os.urandom(8).hex()],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    lines = _lines(proc)
    try:
        _read_until(lines, "Ctrl-C stops everything", 90)
        for crash in range(1, 6):
            worker = _pid_of(lambda cmd, environ: b"ROLLGATE_WORKER_ID=worker-1" in environ
                             and f"ROLLGATE_REDIS_PREFIX={prefix}".encode() in environ)  # fmt: skip
            os.kill(worker, signal.SIGKILL)
            if crash < 5:
                # Four fast crashes: restarted each time, the backoff doubling.
                said = "".join(_read_until(lines, f"worker-1 restarted (restart {crash})", 60))
                assert f"restarting in {0.5 * 2 ** (crash - 1):g} s" in said, said
                assert proc.poll() is None, "up gave up before five fast crashes"
        said = "".join(_read_until(lines, "rollgate: stopping.", 60))
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    assert code == 1
    assert (
        "rollgate: worker-1 was killed by SIGKILL 5 times in a row, each within 30 s of "
        "starting; giving up"
    ) in said, said
    assert "the end of worker-1's log:" in said
    events = [
        json.loads(line)
        for line in (tmp_path / "logs" / "rollgate-up.log").read_text().splitlines()
    ]
    assert events[-1]["event"] == "service_gave_up" and events[-1]["service"] == "worker-1"
    assert not (tmp_path / "stack.json").exists()
    assert not _processes_with_env("ROLLGATE_REDIS_PREFIX", prefix), "services left running"
