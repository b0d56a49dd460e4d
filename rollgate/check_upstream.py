"""`rollgate check-upstream`: one real request to each configured upstream (and one through the
full stack), reporting what a user otherwise checks by hand with curl."""

from __future__ import annotations

import json
import os
import tempfile
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.runtime.config import RollgateConfig, UpstreamConfig

_PROMPT = [{"role": "user", "content": "Say OK."}]


@dataclass(frozen=True, slots=True, kw_only=True)
class Check:
    """One line of the report."""

    name: str
    ok: bool
    detail: str


def _post(url: str, body: dict[str, Any], headers: Mapping[str, str], timeout_s: float) -> tuple[int, Any]:  # fmt: skip
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return int(resp.status), json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        raw = err.read()
        try:
            return err.code, json.loads(raw)
        except ValueError:
            return err.code, raw.decode(errors="replace")[:300]


def _message(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", ""))
    return str(body)[:300]


def check_upstream(
    upstream: UpstreamConfig, environ: Mapping[str, str], *, timeout_s: float = 30.0
) -> list[Check]:
    """Reachable, key accepted, model served, logprobs returned, token ids exact: one request."""
    key = environ.get(upstream.api_key_var, "") if upstream.api_key_var else ""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    model = upstream.models[0] if upstream.models else ""
    body: dict[str, Any] = {"model": model, "messages": _PROMPT, "max_tokens": 8}
    body["logprobs"] = True
    if upstream.kind == "vllm":
        body["return_token_ids"] = True
    url = upstream.base_url + "/chat/completions"
    try:
        status, answer = _post(url, body, headers, timeout_s)
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        return [Check(name="reachable", ok=False, detail=f"POST {url}: {reason}")]
    checks = [Check(name="reachable", ok=True, detail=f"POST {url} → HTTP {status}")]
    var = upstream.api_key_var or "(no key configured)"
    if status in (401, 403):
        return [*checks, Check(name="key accepted", ok=False, detail=f"check {var}")]
    checks.append(Check(name="key accepted", ok=True, detail=var))
    if status == 404:
        detail = f"{_message(answer)}: check the model id ({model!r}) and that base_url ends in /v1"
        return [*checks, Check(name="model served", ok=False, detail=detail)]
    if status != 200 or not isinstance(answer, dict):
        return [*checks, Check(name="model served", ok=False, detail=_message(answer))]
    checks.append(Check(name="model served", ok=True, detail=str(answer.get("model", model))))
    choice = (answer.get("choices") or [{}])[0]
    content = (choice.get("logprobs") or {}).get("content") or []
    checks.append(
        Check(
            name="logprobs returned",
            ok=bool(content),
            detail=f"{len(content)} entries" if content else "none: the upstream ignores logprobs",
        )
    )
    ids = choice.get("token_ids")
    exact = isinstance(ids, list) and bool(ids)
    if upstream.kind == "sglang" and upstream.sglang_path == "generate":
        detail = "exact via /generate with input_ids (chat answer checked here)"
        exact = True
    else:
        detail = f"{len(ids)} ids" if exact else f"no ids from a {upstream.kind} upstream"
    checks.append(Check(name="token ids exact", ok=exact, detail=detail))
    return checks


def check_stack(config: RollgateConfig) -> list[Check]:
    """Starts the stack from the configuration, opens a session and sends one chat through it."""
    from rollgate.redis_server import free_port
    from rollgate.stack import Stack, StackConfig, StackError, generate_admin_key

    admin_key = config.admin_key or generate_admin_key()
    with tempfile.TemporaryDirectory(prefix="rollgate-check-") as state:
        stack = Stack(
            StackConfig(
                admin_key=admin_key,
                gateway_port=free_port(),
                workers=1,
                state_dir=Path(state),
                file=config,
            )
        )
        try:
            stack.start()
        except StackError as err:
            return [Check(name="stack started", ok=False, detail=str(err)[:500])]
        try:
            return _one_chat(stack.gateway_url, admin_key, config)
        finally:
            stack.stop()


def _one_chat(gateway: str, admin_key: str, config: RollgateConfig) -> list[Check]:
    checks = [Check(name="stack started", ok=True, detail=gateway)]
    status, session = _post(
        gateway + "/rl/start_session",
        {"task_id": "check-upstream"},
        {"Authorization": f"Bearer {admin_key}"},
        30.0,
    )
    if status != 200 or not isinstance(session, dict) or "api_key" not in session:
        return [*checks, Check(name="session", ok=False, detail=_message(session))]
    for upstream in config.upstreams or ():
        model = (upstream.models or ("rollgate-mock",))[0]
        status, answer = _post(
            gateway + "/v1/chat/completions",
            {"model": model, "messages": _PROMPT, "max_tokens": 8},
            {"Authorization": f"Bearer {session['api_key']}"},
            60.0,
        )
        ok = status == 200
        detail = f"{model}: HTTP {status}" + ("" if ok else f" {_message(answer)}")
        checks.append(Check(name=f"through the stack ({upstream.name})", ok=ok, detail=detail))
    return checks


def render(checks: list[Check], title: str) -> str:
    """The report as text lines."""
    lines = [title]
    lines += [f"  {'ok  ' if c.ok else 'FAIL'} {c.name:<22} {c.detail}" for c in checks]
    return "\n".join(lines)


def run(config: RollgateConfig, *, stack: bool) -> int:
    """Prints the report; 0 when every check passed."""
    failed = False
    for upstream in config.upstreams:
        checks = check_upstream(upstream, os.environ)
        failed |= not all(c.ok for c in checks)
        print(render(checks, f"upstream {upstream.name} ({upstream.kind}, {upstream.base_url})"))
    if stack and config.upstreams:
        checks = check_stack(config)
        failed |= not all(c.ok for c in checks)
        print(render(checks, "full stack"))
    return 1 if failed else 0
