"""The style the project holds itself to: ruff lint and format, mypy --strict (STYLE.md rule 11)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# Our top-level packages, and what each may import of the others (STYLE.md, dependency
# direction; docs/internals.md, Layout). `services` is refined per service below.
PACKAGES = ("rollgate", "services", "protos", "schema", "stackconfig", "chatml", "grpcpoller")
# The shared packages both sides may import: pure, importing nothing of ours.
SHARED = ("protos", "schema", "stackconfig", "chatml", "grpcpoller")


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)


def test_ruff_finds_nothing() -> None:
    result = _run(str(BIN / "ruff"), "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_code_is_ruff_formatted() -> None:
    result = _run(str(BIN / "ruff"), "format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_passes_on_every_package() -> None:
    # protos is generated: its stubs are checked where they are used.
    packages = [p for p in PACKAGES if p != "protos"]
    result = _run(sys.executable, "-m", "mypy", *packages)
    assert result.returncode == 0, result.stdout + result.stderr


def test_tests_wait_only_through_the_shared_poll_helper() -> None:
    """Deadline loops are written once (tests/harness/poll.py): `eventually` / `eventually_sync`."""
    pattern = re.compile(
        r"deadline = (time\.monotonic|asyncio\.get_running_loop\(\)\.time|loop\.time)\(\)"
    )
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("*.py")
        if path != ROOT / "tests" / "harness" / "poll.py" and pattern.search(path.read_text())
    ]
    assert offenders == [], f"hand-written deadline loops (use tests.harness.poll): {offenders}"


def _imports(path: Path) -> set[str]:
    """The top-level-qualified modules a file imports (at any depth: lazy imports count)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def _offenders(package: str, allowed: Callable[[Path, str], bool]) -> list[str]:
    return sorted(
        f"{path.relative_to(ROOT)} imports {module}"
        for path in (ROOT / package).rglob("*.py")
        for module in _imports(path)
        if module.split(".")[0] in PACKAGES and not allowed(path, module)
    )


def test_services_import_only_their_own_modules_the_runtime_and_the_shared_packages() -> None:
    """STYLE.md: services/* -> services/runtime, protos, schema (and the shared stackconfig,
    chatml); services meet through protos, never through each other's modules."""

    def allowed(path: Path, module: str) -> bool:
        parts = path.relative_to(ROOT / "services").parts
        own = f"services.{parts[0]}" if len(parts) > 1 else "services"
        return module.split(".")[0] in SHARED or module.startswith((own, "services.runtime"))

    assert _offenders("services", allowed) == []


def test_rollgate_never_imports_services() -> None:
    """The CLI starts services as processes; what both need lives in a shared package."""

    def allowed(path: Path, module: str) -> bool:
        return module.split(".")[0] in ("rollgate", *SHARED)

    assert _offenders("rollgate", allowed) == []


def test_shared_packages_import_nothing_of_ours_but_themselves() -> None:
    """schema, stackconfig and chatml sit below both sides: they import no other package of
    ours (protos is generated, and imports only itself)."""
    for package in SHARED:
        assert (
            _offenders(package, lambda path, module, p=package: module.split(".")[0] == p) == []
        ), package


def test_the_dependency_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The checks above read real import statements, lazy ones included."""
    module = tmp_path / "lazy.py"
    module.write_text("def f():\n    from services.worker.turns import TurnRunner\n")
    assert "services.worker.turns" in _imports(module)


def test_schema_imports_nothing_of_ours_and_nothing_but_msgpack_besides_the_stdlib() -> None:
    outside = sorted(
        f"{path.relative_to(ROOT)} imports {module}"
        for path in (ROOT / "schema").rglob("*.py")
        for module in _imports(path)
        if module.split(".")[0] not in ("schema", "msgpack", "__future__")
        and module.split(".")[0] not in sys.stdlib_module_names
    )
    assert outside == []
