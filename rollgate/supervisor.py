"""What keeps `rollgate up` running: restarts a crashed service with backoff, gives up on a
service that keeps crashing right after it starts."""

from __future__ import annotations

import json
import signal
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


class Supervised(Protocol):
    """One process the supervisor watches: a stack service or the embedded Redis."""

    name: str

    @property
    def alive(self) -> bool:
        """True while the process runs."""

    @property
    def exit_code(self) -> int | None:
        """The exit code of the last run (negative: killed by that signal); None while running."""

    def start(self) -> None:
        """Starts the process again (the same command, port and data directory)."""

    def healthy(self) -> bool:
        """One quick health check (a false answer while it starts is normal)."""

    def log_tail(self) -> str:
        """The end of its log, for the give-up message."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartPolicy:
    """When to restart and when to give up (defaults: docs/deploy.md, *rollgate up*)."""

    # The first restart waits this long; each further fast crash doubles it, up to max.
    backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    # A run shorter than this is a fast crash; a longer one resets the count.
    fast_crash_s: float = 30.0
    # This many fast crashes in a row: give up and stop the stack.
    max_fast_crashes: int = 5


class GaveUp(RuntimeError):
    """A service kept crashing right after it started; the message says which and why."""

    def __init__(self, message: str, *, name: str, log_tail: str) -> None:
        super().__init__(message)
        self.name = name
        self.log_tail = log_tail


@dataclass(slots=True)
class _Watch:
    """What the supervisor knows about one process."""

    started_at: float
    fast_crashes: int = 0
    restart_at: float | None = None
    restarts: int = 0
    awaiting_health: bool = False
    delays: deque[float] = field(default_factory=lambda: deque(maxlen=32))


class Supervisor:
    """Polled by `rollgate up` (`check()`); prints and logs every crash and restart."""

    def __init__(
        self,
        processes: Iterable[Supervised],
        *,
        policy: RestartPolicy | None = None,
        log_path: Path | None = None,
        say: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy or RestartPolicy()
        self._clock = clock
        self._say = say
        self._log_path = log_path
        now = clock()
        self._processes = {p.name: p for p in processes}
        self._watches = {name: _Watch(started_at=now) for name in self._processes}

    def restarts(self, name: str) -> int:
        """How often `name` was restarted."""
        return self._watches[name].restarts

    def delays(self, name: str) -> list[float]:
        """The backoff chosen before each restart of `name`, in order."""
        return list(self._watches[name].delays)

    def check(self) -> None:
        """One round: notices exits, restarts what is due, reports recoveries; GaveUp when a
        process crashed fast `max_fast_crashes` times in a row."""
        now = self._clock()
        for name, process in self._processes.items():
            watch = self._watches[name]
            if process.alive:
                if watch.awaiting_health and process.healthy():
                    watch.awaiting_health = False
                    self._event("service_recovered", name, f"{name} is healthy again")
                continue
            if watch.restart_at is None:
                self._crashed(name, process, watch, now)
            elif now >= watch.restart_at:
                watch.restart_at = None
                watch.restarts += 1
                watch.started_at = now
                watch.awaiting_health = True
                process.start()
                self._event(
                    "service_restarted",
                    name,
                    f"{name} restarted (restart {watch.restarts})",
                    restart=watch.restarts,
                )

    def _crashed(self, name: str, process: Supervised, watch: _Watch, now: float) -> None:
        ran_s = now - watch.started_at
        watch.awaiting_health = False
        policy = self.policy
        watch.fast_crashes = watch.fast_crashes + 1 if ran_s < policy.fast_crash_s else 1
        how = _describe_exit(process.exit_code)
        if watch.fast_crashes >= policy.max_fast_crashes:
            message = (
                f"{name} {how} {watch.fast_crashes} times in a row, each within "
                f"{policy.fast_crash_s:.0f} s of starting; giving up (it will not start as "
                f"configured: read its log below and fix the cause, then run `rollgate up` again)"
            )
            self._event("service_gave_up", name, message, exit_code=process.exit_code)
            raise GaveUp(message, name=name, log_tail=process.log_tail())
        delay = min(policy.backoff_s * 2 ** (watch.fast_crashes - 1), policy.max_backoff_s)
        watch.delays.append(delay)
        watch.restart_at = now + delay
        self._event(
            "service_exited",
            name,
            f"{name} {how} after {ran_s:.1f} s; restarting in {delay:g} s",
            exit_code=process.exit_code,
            ran_s=round(ran_s, 3),
            delay_s=delay,
        )

    def _event(self, event: str, name: str, text: str, **fields: object) -> None:
        self._say(f"rollgate: {text}")
        if self._log_path is None:
            return
        line = {"event": event, "service": name, "message": text, "ts": time.time(), **fields}
        try:
            with self._log_path.open("a") as log:
                log.write(json.dumps(line) + "\n")
        except OSError:
            pass


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "stopped"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
