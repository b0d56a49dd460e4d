"""The agent configuration snippets and the README walkthrough agree with the scripts."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from types import ModuleType

import pytest

from tests.examples.conftest import EXAMPLES_DIR

GATEWAY_V1 = "http://127.0.0.1:8080/v1"


def test_openclaw_settings_define_an_openai_compatible_provider_for_the_gateway() -> None:
    settings = json.loads((EXAMPLES_DIR / "openclaw.settings.json").read_text(encoding="utf-8"))
    providers = settings["models"]["providers"]
    provider = providers["rollgate"]
    assert provider["baseUrl"] == GATEWAY_V1
    assert provider["api"] == "openai-completions"
    assert provider["apiKey"] == "${SESSION_API_KEY}"
    primary = settings["agents"]["defaults"]["model"]["primary"]
    name, model_id = primary.split("/", 1)
    assert name in providers
    assert model_id in [m["id"] for m in providers[name]["models"]]


_COMMAND = re.compile(r"python3 examples/openclaw/(\w+)\.py([^\n|]*)")


def _readme_commands() -> list[tuple[str, list[str]]]:
    text = (EXAMPLES_DIR / "README.md").read_text(encoding="utf-8")
    found = []
    for module, rest in _COMMAND.findall(text):
        args = [a for a in shlex.split(rest.replace('"$SESSION_API_KEY"', "sk-sess-x")) if a]
        args = [a for a in args if not a.startswith(("2>", ">"))]
        found.append((module, args))
    return found


def test_readme_covers_the_walkthrough() -> None:
    text = (EXAMPLES_DIR / "README.md").read_text(encoding="utf-8")
    for needle in ("make run", "curl -N", "rollgate trajectories tail --json", "--api-key"):
        assert needle in text
    modules = {module for module, _ in _readme_commands()}
    assert modules == {"start_session", "set_reward", "end_session", "demo_lifecycle"}


@pytest.mark.parametrize("command", _readme_commands(), ids=lambda c: " ".join([c[0], *c[1]]))
def test_every_readme_command_line_is_accepted_by_its_script(
    load_example: Callable[[str], ModuleType], command: tuple[str, list[str]]
) -> None:
    module, args = command
    options = load_example(module).parse_options(args, {})
    assert options.gateway_url == "http://127.0.0.1:8080"
