"""`rollgate up` itself, as a user runs it: banner, generated admin key, Ctrl-C stops everything."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from rollgate.redis_server import free_port

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
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            continue
        seen.append(line)
        if marker in line:
            return seen
    raise AssertionError(f"{marker!r} not printed in {timeout_s}s:\n{''.join(seen)}")


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
