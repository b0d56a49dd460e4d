"""`rollgate check-upstream`: one real request to each configured upstream (and one through the
full stack), reporting what a user otherwise checks by hand with curl."""

from __future__ import annotations

import json
import os
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stackconfig import (
    ConfigError,
    RollgateConfig,
    UpstreamConfig,
    check_upstream_key,
    upstream_kind,
)

if TYPE_CHECKING:
    from rollgate.stack import Stack
    from rollgate.trajectory import Interaction

_PROMPT = [{"role": "user", "content": "Say OK."}]
_MAX_TOKENS = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class Check:
    """One line of the report."""

    name: str
    ok: bool
    detail: str


def _request(url: str, body: dict[str, Any] | None, headers: Mapping[str, str], timeout_s: float) -> tuple[int, Any]:  # fmt: skip
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json", **headers},
        method="POST" if body is not None else "GET",
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


def _post(url: str, body: dict[str, Any], headers: Mapping[str, str], timeout_s: float) -> tuple[int, Any]:  # fmt: skip
    return _request(url, body, headers, timeout_s)


def _message(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", ""))
    return str(body)[:300]


def _headers(upstream: UpstreamConfig, environ: Mapping[str, str]) -> dict[str, str]:
    key = environ.get(upstream.api_key_var, "") if upstream.api_key_var else ""
    return {"Authorization": f"Bearer {key}"} if key else {}


def upstream_model(
    upstream: UpstreamConfig, environ: Mapping[str, str], *, timeout_s: float = 30.0
) -> tuple[str, str]:
    """(model id, problem): the first configured model, else the first of GET <base>/models."""
    if upstream.models:
        return upstream.models[0], ""
    url = upstream.base_url + "/models"
    try:
        status, body = _request(url, None, _headers(upstream, environ), timeout_s)
    except (urllib.error.URLError, OSError) as err:
        return "", f"`models` is empty and GET {url} failed: {getattr(err, 'reason', err)}"
    data = body.get("data") if isinstance(body, dict) else None
    ids = [str(m["id"]) for m in data or () if isinstance(m, dict) and m.get("id")]
    if status != 200 or not ids:
        detail = f"HTTP {status} {_message(body)}" if status != 200 else "no model listed"
        return "", f"`models` is empty and GET {url} gave {detail}: set models: [<id>]"
    return ids[0], ""


def check_upstream(
    upstream: UpstreamConfig, environ: Mapping[str, str], *, timeout_s: float = 30.0
) -> list[Check]:
    """Reachable, key accepted, model served, logprobs returned, token ids exact: one request
    (two on SGLang's generate path, whose ids come from /generate)."""
    model, problem = upstream_model(upstream, environ, timeout_s=timeout_s)
    headers = _headers(upstream, environ)
    body: dict[str, Any] = {"model": model, "messages": _PROMPT, "max_tokens": _MAX_TOKENS}
    body["logprobs"] = True
    body.update(upstream_kind(upstream.kind).ids_request)
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
    if problem:
        return [*checks, Check(name="model served", ok=False, detail=problem)]
    if status == 404:
        detail = (
            f"{_message(answer)}: check the model id ({model!r}) against GET "
            f"{upstream.base_url}/models, and compare {url} with the provider's documented "
            "base URL"
        )
        return [*checks, Check(name="model served", ok=False, detail=detail)]
    if status != 200 or not isinstance(answer, dict):
        return [*checks, Check(name="model served", ok=False, detail=_message(answer))]
    served = str(answer.get("model", model))
    found = "" if upstream.models else " (from /models)"
    checks.append(Check(name="model served", ok=True, detail=served + found))
    choice = (answer.get("choices") or [{}])[0]
    content = (choice.get("logprobs") or {}).get("content") or []
    checks.append(
        Check(
            name="logprobs returned",
            ok=bool(content),
            detail=f"{len(content)} entries" if content else "none: the upstream ignores logprobs",
        )
    )
    if upstream.kind == "sglang" and upstream.sglang_path == "generate":
        checks.append(_generate_ids(upstream, headers, timeout_s))
        return checks
    ids = choice.get("token_ids")
    exact = isinstance(ids, list) and bool(ids)
    detail = f"{len(ids)} ids" if exact else f"no ids from a {upstream.kind} upstream"
    checks.append(Check(name="token ids exact", ok=exact, detail=detail))
    return checks


def _generate_ids(upstream: UpstreamConfig, headers: Mapping[str, str], timeout_s: float) -> Check:
    """POSTs the prompt's input_ids to SGLang's /generate and checks the ids it returns."""
    from chatml.template import render_chatml
    from chatml.tokenizer import LocalTokenizer

    name = "token ids exact"
    url = upstream.base_url.removesuffix("/v1") + "/generate"
    input_ids = LocalTokenizer(upstream.tokenizer).encode(render_chatml(_PROMPT))
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": _MAX_TOKENS, "temperature": 0},
        "return_logprob": True,
        "return_text_in_logprobs": True,
        "logprob_start_len": -1,
        "stream": False,
    }
    try:
        status, answer = _post(url, body, headers, timeout_s)
    except (urllib.error.URLError, OSError) as err:
        return Check(name=name, ok=False, detail=f"POST {url}: {getattr(err, 'reason', err)}")
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    if status != 200 or not isinstance(meta, dict):
        return Check(
            name=name,
            ok=False,
            detail=f"POST {url} → HTTP {status} {_message(answer)}: is this SGLang's server root?",
        )
    triples = meta.get("output_token_logprobs")
    ids = [t[1] for t in triples or () if isinstance(t, list) and len(t) >= 2]
    problems = []
    if not ids or not all(isinstance(i, int) for i in ids):
        problems.append("no integer ids in meta_info.output_token_logprobs")
    if isinstance(meta.get("completion_tokens"), int) and meta["completion_tokens"] != len(ids):
        problems.append(f"{len(ids)} ids but completion_tokens={meta['completion_tokens']}")
    if isinstance(meta.get("prompt_tokens"), int) and meta["prompt_tokens"] != len(input_ids):
        problems.append(
            f"prompt_tokens={meta['prompt_tokens']} but {len(input_ids)} input_ids were sent"
        )
    if problems:
        return Check(name=name, ok=False, detail=f"POST {url}: " + "; ".join(problems))
    detail = f"{len(ids)} output ids from {url}; the {len(input_ids)} prompt ids as sent"
    return Check(name=name, ok=True, detail=detail)


def check_stack(config: RollgateConfig, environ: Mapping[str, str] | None = None) -> list[Check]:
    """Starts the stack from the configuration, sends one chat per upstream through it, ends
    the session and reports what the published trajectory recorded."""
    from rollgate.redis_server import free_port
    from rollgate.stack import Stack, StackConfig, StackError, generate_admin_key

    environ = os.environ if environ is None else environ
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
            return _through(stack, admin_key, config, environ)
        finally:
            stack.stop()


def _through(
    stack: Stack, admin_key: str, config: RollgateConfig, environ: Mapping[str, str]
) -> list[Check]:
    gateway = stack.gateway_url
    checks = [Check(name="stack started", ok=True, detail=gateway)]
    status, session = _post(
        gateway + "/rl/start_session",
        {"task_id": "check-upstream"},
        {"Authorization": f"Bearer {admin_key}"},
        30.0,
    )
    if status != 200 or not isinstance(session, dict) or "api_key" not in session:
        return [*checks, Check(name="session", ok=False, detail=_message(session))]
    auth = {"Authorization": f"Bearer {session['api_key']}"}
    sent: list[tuple[UpstreamConfig, str]] = []
    for upstream in config.upstreams:
        model, problem = upstream_model(upstream, environ)
        name = f"through the stack ({upstream.name})"
        if problem:
            checks.append(Check(name=name, ok=False, detail=problem))
            continue
        status, answer = _post(
            gateway + "/v1/chat/completions",
            {"model": model, "messages": _PROMPT, "max_tokens": _MAX_TOKENS},
            auth,
            60.0,
        )
        ok = status == 200
        detail = f"{model}: HTTP {status}" + ("" if ok else f" {_message(answer)}")
        checks.append(Check(name=name, ok=ok, detail=detail))
        if ok:
            sent.append((upstream, model))
    if not sent:
        return checks
    return checks + _recorded(stack, gateway, auth, sent)


def _recorded(
    stack: Stack, gateway: str, auth: Mapping[str, str], sent: list[tuple[UpstreamConfig, str]]
) -> list[Check]:
    """Ends the session and reads its trajectory off the stack's Redis stream."""
    status, ended = _post(gateway + "/rl/end_session", {}, auth, 60.0)
    trajectory_id = ended.get("trajectory_id") if isinstance(ended, dict) else None
    if status != 200 or not trajectory_id:
        return [Check(name="trajectory published", ok=False, detail=_message(ended))]
    try:
        interactions = _published(stack, str(trajectory_id))
    except (OSError, ValueError) as err:
        return [Check(name="trajectory published", ok=False, detail=str(err))]
    checks = [
        Check(
            name="trajectory published",
            ok=len(interactions) == len(sent),
            detail=f"{trajectory_id}: {len(interactions)} interaction(s) for {len(sent)} call(s)",
        )
    ]
    for (upstream, model), interaction in zip(sent, interactions, strict=False):
        logprobs = interaction.output_logprobs
        ids = interaction.output_token_ids
        exact = interaction.exact_tokens and bool(ids)
        checks += [
            Check(
                name=f"logprobs recorded ({upstream.name})",
                ok=bool(logprobs),
                detail=f"{model}: {len(logprobs)} logprobs",
            ),
            Check(
                name=f"exact ids recorded ({upstream.name})",
                ok=exact,
                detail=(
                    f"{model}: {len(ids)} output ids, {len(interaction.prompt_token_ids)} prompt ids"
                    if exact
                    else f"{model}: exact_tokens=false ({upstream.kind} gives no sampled ids)"
                ),
            ),
        ]
    return checks


def _published(stack: Stack, trajectory_id: str, timeout_s: float = 10.0) -> list[Interaction]:
    """The interactions of one published trajectory, read off the stack's Redis stream."""
    import redis

    from rollgate.trajectory import decode_trajectory

    client = redis.Redis.from_url(stack.redis_url, socket_timeout=5.0)
    stream = f"{stack.config.redis_prefix}trajectories"
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            entries: list[tuple[bytes, dict[bytes, bytes]]] = client.xrevrange(stream, count=100)  # type: ignore[assignment]
            for _, fields in entries:
                if fields.get(b"trajectory_id", b"").decode() == trajectory_id:
                    codec = fields.get(b"codec", b"msgpack").decode()
                    trajectory = decode_trajectory(fields[b"data"], codec)
                    return sorted(trajectory.interactions, key=lambda i: i.index)
            if time.monotonic() > deadline:
                raise ValueError(f"trajectory {trajectory_id} not on {stream} in {timeout_s} s")
            time.sleep(0.1)
    finally:
        client.close()


def render(checks: list[Check], title: str) -> str:
    """The report as text lines."""
    lines = [title]
    lines += [f"  {'ok  ' if c.ok else 'FAIL'} {c.name:<28} {c.detail}" for c in checks]
    return "\n".join(lines)


def run(config: RollgateConfig, *, stack: bool, environ: Mapping[str, str] | None = None) -> int:
    """Prints the report; 0 when every check passed, 2 when a key variable is not set."""
    environ = os.environ if environ is None else environ
    try:
        for upstream in config.upstreams:
            check_upstream_key(config, upstream, environ)
    except ConfigError as err:
        print(f"rollgate: {err}")
        return 2
    failed = False
    for upstream in config.upstreams:
        checks = check_upstream(upstream, environ)
        failed |= not all(c.ok for c in checks)
        print(render(checks, f"upstream {upstream.name} ({upstream.kind}, {upstream.base_url})"))
    if stack and config.upstreams:
        checks = check_stack(config, environ)
        failed |= not all(c.ok for c in checks)
        print(render(checks, "full stack"))
    return 1 if failed else 0
