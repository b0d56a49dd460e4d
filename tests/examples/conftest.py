"""Load the example scripts as modules, the way `python3 examples/openclaw/x.py` finds them."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples" / "openclaw"
SCRIPT_MODULES = ("_fmt", "start_session", "set_reward", "end_session", "demo_lifecycle")


@pytest.fixture
def load_example(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], ModuleType]]:
    """Import an example script by name, with its folder first on sys.path (as when run)."""
    monkeypatch.syspath_prepend(str(EXAMPLES_DIR))
    monkeypatch.delenv("NO_COLOR", raising=False)

    def load(name: str) -> ModuleType:
        return importlib.import_module(name)

    yield load
    for name in SCRIPT_MODULES:
        sys.modules.pop(name, None)
