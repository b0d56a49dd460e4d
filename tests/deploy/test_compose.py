"""docker-compose.yml validates against the vendored Compose Specification schema and keeps its
promises: Redis AOF on a volume, two workers, health-ordered start, keys only from .env, the
framed streams on fixed internal ports."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml

from services.runtime.grpc_server import STOP_NOTICE_S
from tests.deploy.conftest import REPO
from tests.deploy.test_kubernetes import FRAMED_PORT_VARIABLES, FRAMED_PORTS

SCHEMA = Path(__file__).with_name("compose-spec.json")
INTERPOLATION = re.compile(r"\$\{([A-Z0-9_]+)(?::?[-?+][^}]*)?\}")
SECRET_VARIABLES = ("ROLLGATE_ADMIN_KEY", "ROLLGATE_UPSTREAM_API_KEY")
HEALTHCHECK_SCRIPT = "/opt/rollgate/healthcheck.py"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """docker-compose.yml, parsed (YAML anchors and merge keys resolved)."""
    loaded: dict[str, Any] = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    return loaded


def rollgate_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The services that run the rollgate image (everything but Redis)."""
    return {n: s for n, s in compose["services"].items() if "rollgate" in s.get("image", "")}


def container_ports(service: dict[str, Any]) -> set[str]:
    """The container side of each port a service publishes on the host."""
    return {str(p).rsplit(":", 1)[1] for p in service.get("ports", [])}


def seconds(duration: str) -> float:
    """A compose duration such as `30s` or `1m30s`, in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def test_the_vendored_schema_is_the_compose_specification() -> None:
    schema = json.loads(SCHEMA.read_text())
    assert schema["title"] == "Compose Specification"
    jsonschema.Draft202012Validator.check_schema(schema)


def test_compose_file_validates_against_the_compose_specification(
    compose: dict[str, Any],
) -> None:
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    errors = [f"{e.json_path}: {e.message}" for e in validator.iter_errors(compose)]
    assert errors == []


def test_the_schema_rejects_a_misspelled_key(compose: dict[str, Any]) -> None:
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    broken = json.loads(json.dumps(compose))
    broken["services"]["router"]["helthcheck"] = broken["services"]["router"].pop("healthcheck")
    assert not validator.is_valid(broken)


def test_redis_persists_with_aof_on_a_named_volume(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "everysec"
    volume, target = redis["volumes"][0].split(":")[:2]
    assert target == "/data"
    assert volume in compose["volumes"]


def test_runs_router_dataproxy_gateway_mock_llm_and_two_workers(compose: dict[str, Any]) -> None:
    modules = [s["command"][0] for s in rollgate_services(compose).values()]
    assert sorted(modules) == sorted(
        [
            "services.router",
            "services.dataproxy",
            "services.gateway",
            "rollgate.mock_llm",
            "services.worker",
            "services.worker",
        ]
    )


def test_each_worker_advertises_its_own_service_name(compose: dict[str, Any]) -> None:
    workers = {
        name: s
        for name, s in rollgate_services(compose).items()
        if s["command"][0] == "services.worker"
    }
    ids = set()
    for name, worker in workers.items():
        env = worker["environment"]
        port = worker["command"][worker["command"].index("--port") + 1]
        assert env["ROLLGATE_WORKER_ADVERTISE"] == f"{name}:{port}"
        assert env["ROLLGATE_ROUTER_ADDR"] == "router:50051"
        ids.add(env["ROLLGATE_WORKER_ID"])
    assert len(ids) == len(workers) == 2


def test_dataproxy_and_workers_serve_framed_on_fixed_ports_never_published(
    compose: dict[str, Any],
) -> None:
    services = rollgate_services(compose)
    modules = {"services.dataproxy": "dataproxy", "services.worker": "worker"}
    seen = []
    for name, service in services.items():
        kind = modules.get(service["command"][0])
        if kind is None:
            continue
        command = service["command"]
        port = service["environment"][FRAMED_PORT_VARIABLES[kind]]
        # The same fixed port as the Kubernetes manifests: explicit, easy to find in a capture.
        assert port == str(FRAMED_PORTS[kind]), name
        own = {command[command.index(flag) + 1] for flag in ("--port", "--metrics-port")}
        assert port not in own, name
        # Internal, like the workers' gRPC port: only the gateway connects, over the network.
        assert port not in container_ports(service), name
        seen.append(kind)
    assert sorted(seen) == ["dataproxy", "worker", "worker"]
    gateway = services["gateway"]["environment"]
    assert gateway.get("ROLLGATE_FRAMED_STREAMS", "true") == "true"
    # The gateway connects to the host it reaches each peer's gRPC at: service names here.
    assert gateway["ROLLGATE_DATAPROXY_ADDR"].rsplit(":", 1)[0] in services


def test_the_mock_llm_is_the_default_upstream(compose: dict[str, Any]) -> None:
    for service in rollgate_services(compose).values():
        url = service.get("environment", {}).get("ROLLGATE_UPSTREAM_BASE_URL")
        if url is not None:
            assert url == "${ROLLGATE_UPSTREAM_BASE_URL:-http://mock-llm:8000/v1}"


def test_workers_default_to_the_vllm_kind_the_mock_speaks(compose: dict[str, Any]) -> None:
    workers = [
        s for s in rollgate_services(compose).values() if s["command"][0] == "services.worker"
    ]
    assert workers
    for worker in workers:
        assert worker["environment"]["ROLLGATE_UPSTREAM_KIND"] == "${ROLLGATE_UPSTREAM_KIND:-vllm}"


def test_every_service_has_a_healthcheck_and_waits_for_healthy_dependencies(
    compose: dict[str, Any],
) -> None:
    for name, service in compose["services"].items():
        assert service["healthcheck"]["test"][0] == "CMD", name
        for dependency, condition in service.get("depends_on", {}).items():
            assert dependency in compose["services"]
            assert condition == {"condition": "service_healthy"}, (name, dependency)
    gateway_deps = set(compose["services"]["gateway"]["depends_on"])
    assert gateway_deps >= {"router", "dataproxy", "worker-1", "worker-2"}


def test_grpc_healthchecks_ask_for_the_service_they_run(compose: dict[str, Any]) -> None:
    names = {
        "services.router": "rollgate.v1.Router",
        "services.dataproxy": "rollgate.v1.DataProxy",
        "services.worker": "rollgate.v1.Worker",
    }
    for service in rollgate_services(compose).values():
        test = service["healthcheck"]["test"]
        assert test[1:3] == ["python", HEALTHCHECK_SCRIPT]
        module = service["command"][0]
        port = service["command"][service["command"].index("--port") + 1]
        if module in names:
            assert test[3:] == ["grpc", f"127.0.0.1:{port}", names[module]]
        else:
            assert test[3] == "http" and test[4].startswith(f"http://127.0.0.1:{port}/")


def test_keys_come_only_from_the_env_file(compose: dict[str, Any]) -> None:
    text = (REPO / "docker-compose.yml").read_text()
    assert "env_file" not in text
    seen = set()
    for service in compose["services"].values():
        env = service.get("environment", {})
        for variable in SECRET_VARIABLES:
            if variable in env:
                match = INTERPOLATION.fullmatch(env[variable])
                assert match is not None and match.group(1) == variable, env[variable]
                seen.add(variable)
    assert seen == set(SECRET_VARIABLES)
    # The admin key is required: compose refuses to start without it.
    assert (
        "${ROLLGATE_ADMIN_KEY:?"
        in compose["services"]["gateway"]["environment"]["ROLLGATE_ADMIN_KEY"]
    )


def test_every_variable_compose_reads_is_documented_in_env_example() -> None:
    example = (REPO / ".env.example").read_text()
    documented = set(re.findall(r"^#?\s*([A-Z][A-Z0-9_]+)=", example, flags=re.MULTILINE))
    used = set(INTERPOLATION.findall((REPO / "docker-compose.yml").read_text()))
    assert used <= documented
    # No value filled in for a key in the committed example.
    assert re.search(r"^ROLLGATE_ADMIN_KEY=\s*$", example, flags=re.MULTILINE)


def git(*args: str) -> subprocess.CompletedProcess[str]:
    """Runs git in the repository."""
    return subprocess.run(
        ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30, check=False
    )


def test_env_is_ignored_and_only_the_example_is_committed() -> None:
    assert git("check-ignore", "-q", ".env").returncode == 0
    assert git("check-ignore", "-q", ".env.example").returncode == 1
    assert git("ls-files", "--error-unmatch", ".env.example").returncode == 0
    assert git("ls-files", ".env").stdout == ""


def test_rollgate_containers_are_read_only_non_root_and_outlast_the_drain(
    compose: dict[str, Any],
) -> None:
    for name, service in rollgate_services(compose).items():
        assert service["read_only"] is True, name
        assert service["user"].split(":")[0] not in {"0", "root"}, name
        assert "/tmp" in service["tmpfs"], name
        assert service["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in service["security_opt"], name
        env = service.get("environment", {})
        drain_s = float(env.get("ROLLGATE_GRACE_S", "10"))
        drain_s += float(env.get("ROLLGATE_STOP_NOTICE_S", STOP_NOTICE_S))
        assert seconds(service["stop_grace_period"]) > drain_s, name


def test_redis_is_not_published_on_the_host(compose: dict[str, Any]) -> None:
    assert "ports" not in compose["services"]["redis"]
