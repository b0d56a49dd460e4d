"""Every key the tests issue, and every log the real processes write: no key in any line.

Stacks register their log directory and their keys (admin, trainer, upstream) here when they
are configured (`tests.harness.processes.stack_config`); session keys need no registering:
any key rollgate issues (`sk-sess-`, `sk-admin-`, `sk-trainer-`), by a test or not, is a leak
wherever it appears. The session-wide
fixture in tests/conftest.py scans at the end of the run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

# Keys rollgate issues (session keys, and admin and trainer keys from POST /rl/keys).
ISSUED_KEY_SHAPE = re.compile(r"sk-(?:sess|admin|trainer)-[A-Za-z0-9_\-]{43}")
# Variables whose values are secrets, when a test sets them for a stack.
_SECRET_VARIABLES = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD)", re.IGNORECASE)


@dataclass(slots=True)
class IssuedSecrets:
    """The keys handed to real processes, and where those processes log."""

    values: set[str] = field(default_factory=set)
    log_dirs: set[Path] = field(default_factory=set)

    def add(self, *values: str | None) -> None:
        """Registers secret values (empty ones are ignored)."""
        self.values.update(v for v in values if v)

    def add_env(self, env: dict[str, str] | None) -> None:
        """Registers the values of secret-named variables of an environment."""
        for name, value in (env or {}).items():
            if _SECRET_VARIABLES.search(name) and not name.endswith("_VAR"):
                # A key setting may hold several keys (`new,old`): each is a secret.
                self.add(value, *(part.strip() for part in value.split(",")))

    def watch(self, log_dir: Path) -> None:
        """Scans every file under `log_dir` at the end of the run."""
        self.log_dirs.add(log_dir)


ISSUED = IssuedSecrets()


@dataclass(frozen=True, slots=True, kw_only=True)
class Leak:
    """One log line that carries a secret."""

    path: Path
    line_number: int
    what: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Scan:
    """What the scan read and found."""

    lines: int
    leaks: list[Leak]
    # Watched directories with no log line at all: a scan of them proves nothing (the logs
    # went elsewhere, or were never written), so the run fails on them too.
    silent: list[Path]


def scan(issued: IssuedSecrets) -> Scan:
    """Every line of every file of every watched directory, checked for every secret."""
    lines = 0
    leaks: list[Leak] = []
    silent: list[Path] = []
    for log_dir in sorted(issued.log_dirs):
        before = lines
        for path in sorted(p for p in log_dir.rglob("*") if p.is_file()):
            text = path.read_text(errors="replace")
            for number, line in enumerate(text.splitlines(), start=1):
                lines += 1
                leaks.extend(_leaks_in(line, issued, path, number))
        if lines == before:
            silent.append(log_dir)
    return Scan(lines=lines, leaks=leaks, silent=silent)


def _leaks_in(line: str, issued: IssuedSecrets, path: Path, number: int) -> list[Leak]:
    found = [
        Leak(path=path, line_number=number, what=f"a registered key ({value[:10]}…)")
        for value in issued.values
        if value in line
    ]
    if ISSUED_KEY_SHAPE.search(line):
        found.append(Leak(path=path, line_number=number, what="an issued key"))
    return found
