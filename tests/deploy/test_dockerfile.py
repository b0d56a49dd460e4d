"""The Dockerfile builds in two stages and its runtime stage runs as a non-root user."""

from __future__ import annotations

import re
import tomllib

from tests.deploy.conftest import REPO


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = (REPO / "Dockerfile").read_text()
    logical = re.sub(r"\\\n", " ", text)
    parsed = []
    for line in logical.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            word, _, rest = stripped.partition(" ")
            parsed.append((word.upper(), rest.strip()))
    return parsed


def stages() -> list[list[tuple[str, str]]]:
    """The instructions of each build stage, in order."""
    result: list[list[tuple[str, str]]] = []
    for instruction in instructions():
        if instruction[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(instruction)
    return result


def test_the_image_is_built_in_a_builder_and_a_slim_runtime_stage() -> None:
    builder, runtime = stages()
    assert builder[0][1].endswith("AS builder")
    assert runtime[0][1].endswith("AS runtime")
    assert ("ARG", "PYTHON_IMAGE=python:3.11-slim") in instructions()
    assert any(word == "RUN" and "pip wheel" in args for word, args in builder)
    assert any(word == "RUN" and "from=builder" in args for word, args in runtime)


def test_the_runtime_stage_ends_as_a_non_root_user() -> None:
    runtime = stages()[-1]
    users = [i for i, (word, _) in enumerate(runtime) if word == "USER"]
    assert users, "the runtime stage sets no USER"
    last_user = runtime[users[-1]][1]
    assert last_user.split(":")[0] not in {"root", "0"}
    assert last_user == "10001:10001"
    # Nothing runs as root after the switch.
    assert all(word != "RUN" for word, _ in runtime[users[-1] :])


def test_the_command_picks_the_service() -> None:
    runtime = dict(stages()[-1])
    assert runtime["ENTRYPOINT"] == '["python", "-m"]'
    assert runtime["CMD"].startswith('["services.gateway"')


def test_the_compose_healthcheck_script_is_in_the_image_and_in_the_build_context() -> None:
    runtime = stages()[-1]
    copies = [args for word, args in runtime if word == "COPY"]
    assert any("deploy/docker/healthcheck.py /opt/rollgate/healthcheck.py" in c for c in copies)
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    assert "!deploy/docker/healthcheck.py" in ignore
    assert ".env" in ignore


def test_the_builder_copies_every_package_the_distribution_includes() -> None:
    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = [name.rstrip("*") for name in include["packages"]["find"]["include"]]
    builder = stages()[0]
    copies = [args for word, args in builder if word == "COPY"]
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    for package in packages:
        assert f"{package} ./{package}" in copies, package
        assert f"!{package}/" in ignore, package
