"""The whole stack as local processes: what `rollgate up`, the end-to-end tests and the bench run."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollgate.redis_server import RedisServer, free_port
from rollgate.supervisor import RestartPolicy, Supervised, Supervisor
from stackconfig import DEFAULT_KIND, SERVICES, RollgateConfig

GRPC_SERVICES = {
    "router": "rollgate.v1.Router",
    "dataproxy": "rollgate.v1.DataProxy",
    "worker": "rollgate.v1.Worker",
}


# Settings the stack wires itself (its own Redis, addresses and admin key): a dotted override
# of one of them is for `rollgate up`, not passed on to the services.
_WIRED = frozenset(
    {"redis.url", "redis.prefix", "router.address", "dataproxy.address", "admin_key"}
)
# The variables that name a worker's upstream when there is no configuration file.
_UPSTREAM_VARS = ("ROLLGATE_UPSTREAM_", "ROLLGATE_SGLANG_PATH")
# Where the worker and the dataproxy serve their stream framed (services/runtime/framed.py).
_FRAMED_PORT_VARS = {
    "worker": "ROLLGATE_WORKER_FRAMED_PORT",
    "dataproxy": "ROLLGATE_DATAPROXY_FRAMED_PORT",
}


class StackError(RuntimeError):
    """A process of the stack failed to start or died; the message is one line saying what
    failed and what to fix (the process's log path in it)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StackConfig:
    """What to run; everything left out gets a working local default."""

    admin_key: str
    host: str = "127.0.0.1"
    gateway_port: int = 8080
    workers: int = 2
    # Extra replicas of the other services ({"gateway": 2, "router": 2, "dataproxy": 2}):
    # they share one Redis; gateways and workers reach routers and dataproxies round-robin.
    replicas: Mapping[str, int] = field(default_factory=dict)
    # None: an embedded redis-server (persistent under `state_dir` when one is given).
    redis_url: str | None = None
    redis_prefix: str = "rg:"
    # None: the built-in mock LLM.
    upstream_base_url: str | None = None
    upstream_api_key: str | None = None
    upstream_kind: str | None = None
    upstream_models: str | None = None
    mock_latency_ms: float = 0.0
    mock_token_interval_ms: float = 0.0
    # Where process logs (and the embedded Redis data) go.
    state_dir: Path | None = None
    python: str = sys.executable
    extra_env: Mapping[str, str] = field(default_factory=dict)
    start_timeout_s: float = 60.0
    # A loaded rollgate YAML: one group of workers per upstream, and each service's settings.
    file: RollgateConfig | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerGroup:
    """The workers of one upstream: the environment the stack gives them, and the
    configured upstream they serve (None: the one the environment names)."""

    env: Mapping[str, str]
    upstream: str | None = None


@dataclass(slots=True)
class ServiceProcess:
    """One running service process and how to reach it."""

    name: str
    argv: list[str]
    env: dict[str, str]
    address: str
    log_path: Path
    kind: str
    # host:port of its GET /metrics ("" for processes without one: the mock LLM).
    metrics_address: str = ""
    process: subprocess.Popen[bytes] | None = None
    # Where this run's output starts in the log (earlier runs' lines come before it).
    log_offset: int = 0

    def start(self) -> None:
        """Starts (or restarts) the process, appending to its log."""
        with self.log_path.open("ab") as log:
            self.log_offset = log.tell()
            self.process = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    @property
    def alive(self) -> bool:
        """True while the process runs."""
        return self.process is not None and self.process.poll() is None

    @property
    def exit_code(self) -> int | None:
        """The last run's exit code (negative: killed by that signal); None while it runs."""
        return None if self.process is None else self.process.poll()

    def healthy(self) -> bool:
        """One health check: gRPC health SERVING, the gateway's /ready, the mock's /v1/models."""
        return _healthy(self)

    def signal(self, sig: signal.Signals) -> None:
        """Sends `sig` if the process runs."""
        if self.alive:
            assert self.process is not None
            self.process.send_signal(sig)

    def wait(self, timeout_s: float) -> int | None:
        """The exit code, or None if it is still running after `timeout_s`."""
        if self.process is None:
            return None
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, limit: int = 3000) -> str:
        """The end of the process's log, for error messages."""
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return "(no log)"

    def failure_reason(self) -> str:
        """What this run said about why it could not start, in one line ("" if nothing)."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(self.log_offset)
                text = log.read()[-_REASON_WINDOW:].decode(errors="replace")
        except OSError:
            return ""
        return failure_reason(text)


@dataclass(slots=True)
class EmbeddedRedis:
    """The stack's own redis-server as the supervisor sees it: restarted on its port and
    data directory, so every service's URL stays valid and the AOF brings the data back."""

    server: RedisServer
    name: str = "redis"

    @property
    def alive(self) -> bool:
        """True while redis-server runs."""
        return self.server.exit_code is None and self.server.process is not None

    @property
    def exit_code(self) -> int | None:
        """The exit code of the server that stopped."""
        return self.server.exit_code

    def start(self) -> None:
        """Restarts redis-server; a failure shows as another exit."""
        with contextlib.suppress(RuntimeError):
            self.server.restart()

    def healthy(self) -> bool:
        """Answers PING (restart waits for that already)."""
        return self.alive

    def log_tail(self) -> str:
        """The end of redis.log."""
        return self.server.log_tail()


class Stack:
    """Redis, mock LLM, router, dataproxy, workers and gateway; `with Stack(cfg) as s:`."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.state_dir = config.state_dir or Path.home() / ".rollgate"
        self.log_dir = self.state_dir / "logs"
        self.redis: RedisServer | None = None
        self.redis_url = config.redis_url or ""
        self.services: dict[str, ServiceProcess] = {}
        self.mock_url: str | None = None
        self._ports_taken = {config.gateway_port}

    @property
    def gateway_url(self) -> str:
        """Base URL of the gateway (without /v1)."""
        return f"http://{self.services['gateway'].address}"

    @property
    def trainer_address(self) -> str:
        """host:port of the Trainer gRPC service (served by the dataproxy)."""
        return self.services["dataproxy"].address

    def _env(self, *, worker_of_file: bool = False, **extra: str) -> dict[str, str]:
        """A service's environment: the user's, under what the stack wires itself (addresses,
        Redis, keys, ids). The configuration file is not in it: services read it themselves
        (`--config`, see `_config_args`)."""
        hidden = self._upstream_key_vars()
        env = self._file_key_vars()
        env.update((k, v) for k, v in os.environ.items() if k not in hidden)
        if worker_of_file:
            # The file names each worker's upstream: a ROLLGATE_UPSTREAM_* left in the shell
            # (the no-file way of naming one) must not redirect every upstream's workers.
            env = {k: v for k, v in env.items() if not k.startswith(_UPSTREAM_VARS)}
        env.update(self.config.extra_env)
        env.update(
            ROLLGATE_REDIS_URL=self.redis_url,
            ROLLGATE_REDIS_PREFIX=self.config.redis_prefix,
            ROLLGATE_ADMIN_KEY=self.config.admin_key,
            ROLLGATE_LOG_JSON="1",
            PYTHONUNBUFFERED="1",
        )
        env.update(extra)
        return env

    def _file_key_vars(self) -> dict[str, str]:
        """The file's `admin_key: ${VAR}` / `trainer_key: ${VAR}` as they were resolved when
        it was read: each service reads the file again and resolves them too."""
        file = self.config.file
        if file is None:
            return {}
        pairs = ((file.admin_key_var, file.admin_key),
                 (file.dataproxy.trainer_key_var, file.dataproxy.trainer_key))  # fmt: skip
        return {var: value for var, value in pairs if var and value}

    def _upstream_key_vars(self) -> set[str]:
        """Variables holding upstream keys: only the worker bound to that upstream gets one."""
        names = {"ROLLGATE_UPSTREAM_API_KEY"}
        if self.config.file is not None:
            names.update(u.api_key_var for u in self.config.file.upstreams if u.api_key_var)
        return names

    def _config_args(self, kind: str, upstream: str | None = None) -> list[str]:
        """`--config FILE [overrides]` (and a worker's `--upstream NAME`): the same file and
        overrides `rollgate up` read, minus the overrides of what the stack wires itself.
        Nothing for the mock LLM, nor for workers of an upstream the file does not list (the
        mock's, or one named by ROLLGATE_UPSTREAM_*)."""
        file = self.config.file
        if file is None or kind not in SERVICES or (kind == "worker" and upstream is None):
            return []
        path = file.path
        if not path:
            # Loaded from text (tests, check-upstream): the same text, for the services.
            written = self.state_dir / "rollgate.yaml"
            written.parent.mkdir(parents=True, exist_ok=True)
            written.write_text(file.text)
            path = str(written)
        kept = [o for o in file.overrides if o.partition("=")[0].strip() not in _WIRED]
        args = ["--config", path, *kept]
        return [*args, "--upstream", upstream] if upstream is not None else args

    def _worker_groups(self, router_addr: str) -> dict[str, WorkerGroup]:
        """Worker name → what it serves: one group per configured upstream, else the default."""
        cfg = self.config
        if cfg.file is not None and cfg.file.upstreams:
            groups: dict[str, WorkerGroup] = {}
            for configured in cfg.file.upstreams:
                env = {"ROLLGATE_ROUTER_ADDR": router_addr}
                # Only this upstream's key variable reaches its workers (see _upstream_key_vars).
                var = configured.api_key_var
                if var and var in os.environ:
                    env[var] = os.environ[var]
                for i in range(configured.workers):
                    groups[f"worker-{configured.name}-{i + 1}"] = WorkerGroup(
                        env=env, upstream=configured.name
                    )
            return groups
        upstream = {
            "ROLLGATE_ROUTER_ADDR": router_addr,
            "ROLLGATE_UPSTREAM_BASE_URL": cfg.upstream_base_url or self.mock_url or "",
            "ROLLGATE_UPSTREAM_KIND": cfg.upstream_kind
            or ("vllm" if self.mock_url else DEFAULT_KIND),
        }
        if cfg.upstream_api_key:
            upstream["ROLLGATE_UPSTREAM_API_KEY"] = cfg.upstream_api_key
        if cfg.upstream_models:
            upstream["ROLLGATE_UPSTREAM_MODELS"] = cfg.upstream_models
        return {f"worker-{i + 1}": WorkerGroup(env=upstream) for i in range(cfg.workers)}

    def _add(
        self, name: str, kind: str, module: list[str], port: int, *,
        upstream: str | None = None, **env: str,
    ) -> None:  # fmt: skip
        address = f"{self.config.host}:{port}"
        framed = _FRAMED_PORT_VARS.get(kind)
        if framed and not any(framed in e for e in (env, self.config.extra_env, os.environ)):
            # A port of the stack's choosing, as every other one is: a framed listener bound
            # to port 0 could take a port chosen for a service that has not started yet.
            env[framed] = str(self._free_port())
        metrics_address = ""
        if kind in SERVICES:
            metrics_address = f"{self.config.host}:{self._free_port()}"
            env["ROLLGATE_METRICS_PORT"] = metrics_address.rpartition(":")[2]
        self.services[name] = ServiceProcess(
            name=name,
            argv=[
                self.config.python,
                "-m",
                *module,
                "--host",
                self.config.host,
                "--port",
                str(port),
                *self._config_args(kind, upstream),
            ],
            env=self._env(worker_of_file=upstream is not None, **env),
            address=address,
            log_path=self.log_dir / f"{name}.log",
            kind=kind,
            metrics_address=metrics_address,
        )

    def start(self) -> Stack:
        """Starts every process in dependency order and waits until each is healthy; writes
        stack.json only then (a stale one from an earlier run is removed first)."""
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._state_file.unlink(missing_ok=True)
        except OSError as err:
            raise StackError(
                f"cannot use {self.state_dir} for logs and data ({err.strerror or err}): "
                "choose a writable directory (--state-dir DIR or ROLLGATE_STATE_DIR)"
            ) from None
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        cfg = self.config
        if not self.redis_url:
            try:
                server = RedisServer(appendonly=True, data_dir=str(self._redis_dir()))
                self.redis = server.start()
            except RuntimeError as err:
                hint = "" if "REDIS_URL" in str(err) else " (or set REDIS_URL to a running Redis)"
                raise StackError(f"the embedded Redis could not start: {err}{hint}") from None
            self.redis_url = self.redis.url
        configured = cfg.file is not None and bool(cfg.file.upstreams)
        if cfg.upstream_base_url is None and not configured:
            port = self._free_port()
            self._add(
                "mock-llm", "http", ["rollgate.mock_llm"], port,
            )  # fmt: skip
            self.services["mock-llm"].argv += [
                "--latency-ms", str(cfg.mock_latency_ms),
                "--token-interval-ms", str(cfg.mock_token_interval_ms),
            ]  # fmt: skip
            self.mock_url = f"http://{cfg.host}:{port}/v1"
            self._launch("mock-llm")
        routers = self._add_replicas("router", ["services.router"])
        dataproxies = self._add_replicas("dataproxy", ["services.dataproxy"])
        self._launch(*routers, *dataproxies)
        router_target = self._target(routers)
        groups = self._worker_groups(router_target)
        workers = list(groups)
        for name, group in groups.items():
            port = self._free_port()
            self._add(
                name, "worker", ["services.worker"], port, upstream=group.upstream,
                ROLLGATE_WORKER_ID=name, ROLLGATE_WORKER_ADVERTISE=f"{cfg.host}:{port}", **group.env,
            )  # fmt: skip
        self._launch(*workers)
        gateways = self._add_replicas(
            "gateway", ["services.gateway"], first_port=cfg.gateway_port,
            ROLLGATE_ROUTER_ADDR=router_target,
            ROLLGATE_DATAPROXY_ADDR=self._target(dataproxies),
        )  # fmt: skip
        self._launch(*gateways)
        self._write_state_file()

    def _add_replicas(
        self, kind: str, module: list[str], *, first_port: int | None = None, **env: str
    ) -> list[str]:
        """Adds `kind`, `kind-2`, … (as many as configured) and returns their names."""
        names = []
        for i in range(max(1, self.config.replicas.get(kind, 1))):
            name = kind if i == 0 else f"{kind}-{i + 1}"
            port = first_port if (i == 0 and first_port is not None) else self._free_port()
            self._add(name, kind, module, port, **env)
            names.append(name)
        return names

    def _target(self, names: list[str]) -> str:
        """The gRPC target for a service: one address, or all replicas for round-robin."""
        addresses = [self.services[name].address for name in names]
        return addresses[0] if len(addresses) == 1 else "ipv4:" + ",".join(addresses)

    def _free_port(self) -> int:
        # The OS may hand out a port twice before anything binds it: never reuse one here.
        while (port := free_port()) in self._ports_taken:
            pass
        self._ports_taken.add(port)
        return port

    def _redis_dir(self) -> Path:
        path = self.state_dir / "redis"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _launch(self, *names: str) -> None:
        for name in names:
            self.services[name].start()
        deadline = time.monotonic() + self.config.start_timeout_s
        for name in names:
            self.wait_healthy(name, deadline=deadline)

    def wait_healthy(self, name: str, *, deadline: float) -> None:
        """Polls the service's health check until it answers, or raises StackError."""
        service = self.services[name]
        started = time.monotonic()
        while time.monotonic() < deadline:
            if not service.alive:
                reason = service.failure_reason() or _describe_exit(service.exit_code)
                raise StackError(f"{name} could not start: {reason} (its log: {service.log_path})")
            if _healthy(service):
                return
            time.sleep(0.05)
        raise StackError(
            f"{name} was not healthy within {time.monotonic() - started:.0f} s"
            f"{_last_words(service)} (its log: {service.log_path})"
        )

    @property
    def _state_file(self) -> Path:
        return self.state_dir / "stack.json"

    def _write_state_file(self) -> None:
        """Written after every gateway's /ready answered 200, atomically (rename): a reader
        never sees a half-written file, nor this run's file before the stack is ready."""
        state = {
            "gateway_url": self.gateway_url,
            "redis_url": self.redis_url,
            "redis_prefix": self.config.redis_prefix,
            "trainer_address": self.trainer_address,
            "metrics": self.metrics_urls(),
            "pid": os.getpid(),
        }
        partial = self._state_file.with_suffix(".json.tmp")
        with contextlib.suppress(OSError):
            partial.write_text(json.dumps(state, indent=2))
            partial.replace(self._state_file)

    def supervisor(self, policy: RestartPolicy | None = None, **options: Any) -> Supervisor:
        """A supervisor over every process of the running stack (the embedded Redis too);
        it logs to `logs/rollgate-up.log`."""
        processes: list[Supervised] = list(self.services.values())
        if self.redis is not None:
            processes.insert(0, EmbeddedRedis(self.redis))
        return Supervisor(
            processes, policy=policy, log_path=self.log_dir / "rollgate-up.log", **options
        )

    def metrics_urls(self) -> dict[str, str]:
        """Service name → URL of its Prometheus metrics."""
        return {
            name: f"http://{svc.metrics_address}/metrics"
            for name, svc in self.services.items()
            if svc.metrics_address
        }

    def dead_services(self) -> list[str]:
        """Names of services that have exited."""
        return [name for name, svc in self.services.items() if not svc.alive]

    def stop_service(self, name: str, *, kill: bool = False, timeout_s: float = 15.0) -> int | None:
        """Stops one service (SIGTERM, or SIGKILL with `kill`) and returns its exit code."""
        service = self.services[name]
        service.signal(signal.SIGKILL if kill else signal.SIGTERM)
        code = service.wait(timeout_s)
        if code is None:
            service.signal(signal.SIGKILL)
            code = service.wait(5.0)
        return code

    def restart_service(self, name: str) -> None:
        """Starts a stopped service again and waits until it is healthy."""
        self.services[name].start()
        self.wait_healthy(name, deadline=time.monotonic() + self.config.start_timeout_s)

    def stop(self) -> None:
        """Stops everything, gateway first and Redis last, each gracefully when it can."""
        rank = {"gateway": 0, "worker": 1, "dataproxy": 2, "router": 3, "http": 4}
        order = sorted(self.services, key=lambda name: rank[self.services[name].kind])
        for name in order:
            if name in self.services:
                self.services[name].signal(signal.SIGTERM)
        for name in order:
            if name in self.services and self.services[name].wait(15.0) is None:
                self.services[name].signal(signal.SIGKILL)
                self.services[name].wait(5.0)
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        self._remove_state_file()

    def _remove_state_file(self) -> None:
        """A stopped stack leaves no stack.json behind (a script must not find its URLs);
        one another run wrote meanwhile is left alone."""
        with contextlib.suppress(OSError, ValueError):
            if json.loads(self._state_file.read_text()).get("pid") == os.getpid():
                self._state_file.unlink()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


# How much of a failed run's log is searched for its reason.
_REASON_WINDOW = 64 * 1024


def failure_reason(output: str) -> str:
    """The one line a run's output gives as the reason it stopped: its `startup_failed` event
    (services log JSON), else its last line that is not a log event (a configuration error, the
    last line of a traceback); "" when there is none."""
    last_text = ""
    for raw in reversed(output.splitlines()):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            if isinstance(event, dict):
                if event.get("event") == "startup_failed" and event.get("error"):
                    return " ".join(str(event["error"]).split())
                continue
        if not last_text and not line.startswith("^"):
            last_text = line
    return " ".join(last_text.split())


def _last_words(service: ServiceProcess) -> str:
    """Why a running service is not healthy yet: what the gateway's /ready says is missing,
    else the last thing its log said that was not a log event."""
    reason = _not_ready_detail(service) if service.kind == "gateway" else ""
    reason = reason or service.failure_reason()
    return f": {reason}" if reason else ""


def _not_ready_detail(service: ServiceProcess) -> str:
    try:
        with urllib.request.urlopen(f"http://{service.address}/ready", timeout=1.0):
            return ""
    except urllib.error.HTTPError as err:
        try:
            detail = json.loads(err.read()).get("detail") or {}
        except (OSError, ValueError, AttributeError):
            return ""
        return "; ".join(f"{part}: {problem}" for part, problem in dict(detail).items())
    except (urllib.error.URLError, OSError):
        return ""


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "it stopped"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"it exited with code {code} and said nothing"


def _healthy(service: ServiceProcess) -> bool:
    if service.kind == "http":
        return _http_ok(f"http://{service.address}/v1/models")
    if service.kind == "gateway":
        return _http_ok(f"http://{service.address}/ready")
    return _grpc_serving(service.address, GRPC_SERVICES[service.kind])


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _grpc_serving(address: str, service: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def generate_admin_key() -> str:
    """A fresh admin key for a stack started without one."""
    return "rg-admin-" + secrets.token_urlsafe(24)
