"""The `rollgate` command: run the stack, the mock LLM, and look at trajectories."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from rollgate.keys import current_key
from rollgate.stack import Stack, StackConfig, StackError, generate_admin_key
from rollgate.supervisor import GaveUp
from stackconfig import ConfigError, RollgateConfig, load_config

# How often `up` looks for crashed services.
SUPERVISE_INTERVAL_S = 0.25

_USAGE = """rollgate <command> [options]

commands:
  up                    run the whole stack as local processes (Ctrl-C stops it)
  mock-llm              run the built-in mock LLM (vLLM / SGLang / OpenAI wire formats)
  check-upstream        one real request to each configured upstream and through the stack
  trajectories tail     show published trajectories as they arrive (never consumes them)
  trajectories export   write published trajectories to JSON Lines (never consumes them)
  status                the console's live summary in the terminal (--watch to follow it)

`rollgate <command> --help` for a command's options.
"""


def _up_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollgate up", description="Run the whole stack.")
    parser.add_argument("--host", default="127.0.0.1", help="interface for every service")
    parser.add_argument("--port", type=int, default=8080, help="gateway port (default 8080)")
    parser.add_argument(
        "--admin-key",
        default=os.environ.get("ROLLGATE_ADMIN_KEY", ""),
        help="admin key (default: $ROLLGATE_ADMIN_KEY, else a generated one, printed)",
    )
    parser.add_argument(
        "--workers", type=_at_least_one, default=2, help="worker processes (default 2)"
    )
    parser.add_argument(
        "--replicas",
        type=_replicas,
        default={},
        metavar="gateway=2,router=2,dataproxy=2",
        help="replicas of the gateway, router and dataproxy on one Redis (default 1 each)",
    )
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("ROLLGATE_REDIS_URL") or os.environ.get("REDIS_URL") or None,
        help="use this Redis (default: $REDIS_URL, else an embedded redis-server)",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=Path(os.environ.get("ROLLGATE_STATE_DIR", Path.home() / ".rollgate")),
        help="logs and embedded Redis data (default ~/.rollgate)",
    )
    parser.add_argument(
        "--mock-token-interval-ms",
        type=float,
        default=20.0,
        help="the mock LLM's delay between streamed tokens (default 20)",
    )
    return parser


def _at_least_one(text: str) -> int:
    """A count of processes: an integer >= 1 (the gateway is not ready without a worker)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1")
    return int(text)


def _replicas(text: str) -> dict[str, int]:
    """Parses `--replicas gateway=2,router=2,dataproxy=2`."""
    counts: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, count = item.partition("=")
        if name not in ("gateway", "router", "dataproxy") or not count.isdigit() or int(count) < 1:
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected gateway=N, router=N or dataproxy=N with N >= 1"
            )
        counts[name] = int(count)
    return counts


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", type=Path, default=None, help="rollgate YAML (see rollgate.example.yaml)"
    )
    parser.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. worker.upstreams.0.base_url=http://…"
    )


def _load_file(args: argparse.Namespace) -> RollgateConfig | None:
    """The configuration file, with its ignored AReaL fields reported once."""
    if args.config is None:
        if args.overrides:
            raise ConfigError("dotted overrides need --config FILE")
        return None
    config = load_config(args.config, environ=os.environ, overrides=args.overrides)
    if config.ignored:
        print(
            f"rollgate: {args.config} is an AReaL-style file; fields rollgate does not use "
            f"(ignored): {', '.join(config.ignored)}",
            file=sys.stderr,
        )
    return config


def check_upstream_main(argv: Sequence[str]) -> int:
    """`rollgate check-upstream`: reachable, key accepted, model served, logprobs, exact ids."""
    parser = argparse.ArgumentParser(prog="rollgate check-upstream", description=__doc__)
    _add_config_arguments(parser)
    parser.add_argument(
        "--no-stack", action="store_true", help="only call the upstreams, not the full stack"
    )
    args = parser.parse_args(argv)
    if args.config is None and Path("rollgate.yaml").is_file():
        args.config = Path("rollgate.yaml")
    try:
        config = _load_file(args)
    except ConfigError as err:
        print(f"rollgate: {err}", file=sys.stderr)
        return 2
    if config is None or not config.upstreams:
        print("rollgate: no upstream configured (--config FILE with worker.upstreams)")
        return 2
    from rollgate.check_upstream import run

    return run(config, stack=not args.no_stack)


def up_main(argv: Sequence[str]) -> int:
    """`rollgate up`: starts everything, prints how to use it, stops everything on Ctrl-C."""
    parser = _up_parser()
    _add_config_arguments(parser)
    args = parser.parse_args(argv)
    try:
        file = _load_file(args)
    except ConfigError as err:
        print(f"rollgate: {err}", file=sys.stderr)
        return 2
    if file is not None and file.admin_key and not args.admin_key:
        args.admin_key = file.admin_key
    admin_key = args.admin_key or generate_admin_key()
    upstream = os.environ.get("ROLLGATE_UPSTREAM_BASE_URL") or None
    config = StackConfig(
        admin_key=admin_key,
        host=args.host,
        gateway_port=args.port,
        workers=args.workers,
        replicas=args.replicas,
        redis_url=args.redis_url or (file.redis_url if file else None) or None,
        redis_prefix=os.environ.get("ROLLGATE_REDIS_PREFIX")
        or (file.redis_prefix if file else None)
        or "rg:",
        upstream_base_url=upstream,
        upstream_api_key=os.environ.get("ROLLGATE_UPSTREAM_API_KEY") or None,
        upstream_kind=os.environ.get("ROLLGATE_UPSTREAM_KIND") or None,
        upstream_models=os.environ.get("ROLLGATE_UPSTREAM_MODELS") or None,
        mock_token_interval_ms=args.mock_token_interval_ms,
        state_dir=args.state_dir,
        file=file,
    )
    stack = Stack(config)
    _stop_on_signals()
    print("rollgate: starting redis, router, dataproxy, workers and gateway …", flush=True)
    try:
        stack.start()
    except (StackError, OSError) as err:
        # One line: which process, why, what to change (its log path for the rest).
        print(f"rollgate: failed to start: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    try:
        _print_banner(stack, current_key(admin_key), generated=not args.admin_key)
        supervisor = stack.supervisor(say=lambda text: print(text, flush=True))
        while True:
            supervisor.check()
            time.sleep(SUPERVISE_INTERVAL_S)
    except GaveUp as err:
        print(
            f"rollgate: the end of {err.name}'s log:\n{err.log_tail}\nrollgate: stopping.",
            file=sys.stderr,
            flush=True,
        )
        return 1
    except KeyboardInterrupt:
        print("\nrollgate: stopping …", flush=True)
        return 0
    finally:
        stack.stop()


def _stop_on_signals() -> None:
    """SIGTERM and SIGINT both stop the stack, even when SIGINT arrived ignored (a shell
    starts background jobs that way): "Ctrl-C stops everything" holds however `up` runs.
    Only the first signal counts: `make run` forwards Ctrl-C to `up` a second time, and a
    second KeyboardInterrupt in the middle of the stop would orphan the services."""

    def handler(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _first_model(gateway_url: str, admin_key: str) -> str:
    """The first model the gateway lists (what the banner's curl should ask for)."""
    request = urllib.request.Request(
        f"{gateway_url}/v1/models", headers={"Authorization": f"Bearer {admin_key}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            models = json.loads(resp.read())["data"]
    except (OSError, ValueError, KeyError):
        return "<model>"
    # `default` is an alias: the banner names the model it stands for.
    names = [str(m["id"]) for m in models if m.get("id") != "default"] or ["default"]
    return names[0] if models else "<model>"


def _print_banner(stack: Stack, admin_key: str, *, generated: bool) -> None:
    gw = stack.gateway_url
    examples = "examples/openclaw"
    lines = [
        "",
        f"rollgate is up: gateway {gw}  (OpenAI base_url {gw}/v1)",
        f"  admin key : {admin_key}"
        + ("   (generated; pass --admin-key to fix it)" if generated else ""),
        f"  trainer   : {stack.trainer_address}  (gRPC Trainer service; needs the admin key)",
        f"  redis     : {stack.redis_url}" + ("  (embedded)" if stack.redis else ""),
        f"  logs      : {stack.log_dir}",
        f"  console   : {gw}/console  (live page and trajectory viewer; log in with the admin key)",
        "  metrics   : Prometheus text on each service's metrics port (never the gateway's):",
    ]
    lines += [f"    {name:<11} {url}" for name, url in stack.metrics_urls().items()]
    if stack.mock_url:
        lines += [
            "",
            "  !!! UPSTREAM IS THE BUILT-IN MOCK LLM (model 'rollgate-mock'): answers are fake. !!!",
            "  !!! Set ROLLGATE_UPSTREAM_BASE_URL (and ROLLGATE_UPSTREAM_API_KEY) for a real model. !!!",
        ]
    lines += [
        "",
        "next:",
        f"  export ROLLGATE_ADMIN_KEY={admin_key}",
        f"  python3 {examples}/start_session.py {gw}",
        f"  curl -N {gw}/v1/chat/completions -H 'Authorization: Bearer <sk-sess-… key>' \\",
        "       -H 'Content-Type: application/json' \\",
        f'       -d \'{{"model": "{_first_model(gw, admin_key)}", "messages": [{{"role": "user", "content": "hi"}}],'
        ' "stream": true}\'',
        f"  python3 {examples}/set_reward.py {gw} --api-key <sk-sess-… key> --reward 1.0",
        f"  python3 {examples}/start_session.py {gw} --api-key <sk-sess-… key>   # refresh: publishes",
        "  .venv/bin/rollgate trajectories tail --json",
        "  .venv/bin/rollgate status --watch      # the console's summary in the terminal",
        "",
        "Ctrl-C stops everything.",
    ]
    print("\n".join(lines), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `rollgate` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(_USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "up":
        return up_main(rest)
    if command == "check-upstream":
        return check_upstream_main(rest)
    if command == "status":
        from rollgate.status import status_main

        return status_main(rest)
    if command == "mock-llm":
        from rollgate.mock_llm.cli import main as mock_main

        return mock_main(rest)
    if command == "trajectories":
        if not rest or rest[0] not in {"tail", "export"}:
            print("usage: rollgate trajectories {tail,export} [--help]")
            return 2
        from rollgate.trajectories_cli import export_main, tail_main

        return (tail_main if rest[0] == "tail" else export_main)(rest[1:])
    print(f"rollgate: unknown command {command!r}\n\n{_USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
