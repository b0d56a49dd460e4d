"""One real vLLM per test session (the tiny model built here) and a rollgate stack in front of it.

`make test-engine` installs vLLM in its own venv (`.venv-engine`) and names its Python in
ROLLGATE_ENGINE_PYTHON; this suite runs with the project's venv and starts vLLM as a process.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from rollgate.redis_server import free_port
from rollgate.stack import Stack
from stackconfig import load_config
from tests.engine.tiny_model import build
from tests.harness.poll import eventually_sync
from tests.harness.processes import log_level_env, stack_config

MODEL = "tiny-qwen2"
# A second name vLLM serves the same model under: the `kind: openai` upstream's model.
OPENAI_MODEL = "tiny-qwen2-openai"
# Cold start on the 2-core machine is ≈ 30 s with precompiled bytecode, ≈ 65 s without.
READY_DEADLINE_S = 600.0
_TIMINGS: dict[str, float] = {}


@dataclass(frozen=True, slots=True, kw_only=True)
class Vllm:
    """The running server."""

    base_url: str
    model_dir: Path
    tokenizer: Tokenizer
    log_path: Path

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        """POSTs JSON straight to vLLM (no rollgate in between)."""
        return http_call(self.base_url + path, body)


def http_call(
    url: str, body: dict[str, Any] | None = None, key: str = "", timeout_s: float = 120.0
) -> tuple[int, bytes]:
    """One HTTP call; the status and the raw body (errors included)."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode() if body is not None else None,
        headers=headers,
        method="POST" if body is not None else "GET",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _engine_python() -> str:
    python = os.environ.get("ROLLGATE_ENGINE_PYTHON", "")
    if not python or not Path(python).is_file():
        pytest.fail(
            f"ROLLGATE_ENGINE_PYTHON={python!r} is not the engine venv's python: run `make "
            "test-engine`, which installs vLLM into .venv-engine and sets it"
        )
    return python


def _wait_ready(process: subprocess.Popen[bytes], url: str, log_path: Path) -> None:
    def ready() -> bool:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-4000:]
            pytest.fail(f"vLLM exited with {process.returncode} before it was ready:\n{tail}")
        try:
            return http_call(url + "/health", timeout_s=5.0)[0] == 200
        except OSError:
            return False

    try:
        eventually_sync(ready, timeout_s=READY_DEADLINE_S, interval_s=0.25)
    except AssertionError:
        tail = log_path.read_text(errors="replace")[-4000:]
        pytest.fail(f"vLLM was not ready after {READY_DEADLINE_S:.0f} s:\n{tail}")


def vllm_argv(python: str, model_dir: Path, port: int) -> list[str]:
    """The server's command line (flags and why: ../shared/reference/vllm_wire/README.md)."""
    return [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", MODEL, OPENAI_MODEL,
        "--host", "127.0.0.1", "--port", str(port),
        # Eager mode and one in-process executor: ready in ≈ 30 s instead of ≈ 2 min.
        "--enforce-eager", "--distributed-executor-backend", "uni",
        "--dtype", "float32", "--max-model-len", "2048",
        "--kv-cache-memory-bytes", str(256 * 1024 * 1024),
        "--seed", "0",
        # Without these, any request with `tools` is a 400.
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        # A named tool_choice becomes a JSON-schema constraint; random weights would otherwise
        # fill the allowed whitespace until max_tokens.
        "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}',
    ]  # fmt: skip


def vllm_env() -> dict[str, str]:
    """No network, no usage reports, one process; named tool_choice as a JSON schema."""
    return {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # vLLM 0.32's structural-tag tool calling lets the arguments be any JSON for a
        # non-strict tool; the older path constrains them to the function's parameters.
        "VLLM_ENFORCE_STRICT_TOOL_CALLING": "0",
    }


@pytest.fixture(scope="session")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vllm]:
    """vLLM serving the tiny model on a free port, ready (polled with a deadline)."""
    python = _engine_python()
    started = time.monotonic()
    model_dir = build(tmp_path_factory.mktemp("tiny-qwen2"))
    _TIMINGS["model build (s)"] = time.monotonic() - started
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm-log") / "vllm.log"
    with log_path.open("wb") as log:
        started = time.monotonic()
        process = subprocess.Popen(
            vllm_argv(python, model_dir, port),
            env=vllm_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(process, base_url, log_path)
        _TIMINGS["vLLM ready (s)"] = time.monotonic() - started
        yield Vllm(
            base_url=base_url,
            model_dir=model_dir,
            tokenizer=Tokenizer.from_file(str(model_dir / "tokenizer.json")),
            log_path=log_path,
        )
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


@pytest.fixture(scope="session")
def stack(vllm: Vllm, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """rollgate in front of vLLM, as `rollgate up --config` runs it: one `kind: vllm` upstream
    and one `kind: openai` upstream on the same server (under its second model name)."""
    state = tmp_path_factory.mktemp("engine-stack")
    path = state / "rollgate.yaml"
    path.write_text(
        f"""
admin_key: ${{ENGINE_ADMIN_KEY}}
worker:
  default_model: {MODEL}
  upstreams:
    - name: vllm
      kind: vllm
      base_url: {vllm.base_url}/v1
      models: [{MODEL}]
      workers: 1
    - name: vllm-as-openai
      kind: openai
      base_url: {vllm.base_url}/v1
      models: [{OPENAI_MODEL}]
      workers: 1
"""
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("ENGINE_ADMIN_KEY", "rg-admin-" + uuid.uuid4().hex)
        file = load_config(path, environ=os.environ)
        config = stack_config(
            redis_url,
            state,
            prefix="rgengine",
            admin_key=file.admin_key,
            file=file,
            extra_env=log_level_env(),
        )
        with Stack(config) as running:
            yield running


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Prints how long the model build and the server start took."""
    for name, seconds in _TIMINGS.items():
        terminalreporter.write_line(f"engine suite: {name} {seconds:.1f}")
