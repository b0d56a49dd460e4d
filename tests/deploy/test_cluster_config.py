"""The cluster's configuration file: the rendered rollgate-config ConfigMap is a file the real
loader accepts, every rollgate container reads it with --config, and each service's settings
come out of file + environment as the Deployment means them."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from services.dataproxy.settings import DataProxySettings
from services.gateway.settings import GatewaySettings
from services.router.settings import RouterSettings
from services.worker.settings import WorkerSettings
from stackconfig import load_config, sources_for
from tests.deploy.conftest import Manifest
from tests.deploy.test_kubernetes import (
    FRAMED_PORTS,
    component,
    env_config,
    of_kind,
    rollgate_deployments,
)

CONFIG_DIR = "/etc/rollgate"
CONFIG_FILE = "rollgate.yaml"
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)")
SETTINGS: dict[str, Callable[..., Any]] = {
    "gateway": GatewaySettings.load,
    "router": RouterSettings.load,
    "dataproxy": DataProxySettings.load,
    "worker": WorkerSettings.load,
}


def config_text(objects: list[Manifest]) -> str:
    """The rollgate.yaml of the generated rollgate-config ConfigMap."""
    (config,) = [
        c
        for c in of_kind(objects, "ConfigMap")
        if c["metadata"]["name"].startswith("rollgate-config")
    ]
    assert set(config["data"]) == {CONFIG_FILE}
    text: str = config["data"][CONFIG_FILE]
    return text


def placeholders(text: str) -> dict[str, str]:
    """A placeholder value for every ${VAR} the file names."""
    return {name: f"placeholder-{name.lower()}" for name in _VAR.findall(text)}


def container_environ(objects: list[Manifest], deployment: Manifest) -> dict[str, str]:
    """What the container's environment holds: rollgate-env, then its env (Secret and field
    references as placeholders)."""
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    environ = dict(env_config(objects))
    for entry in container.get("env", []):
        environ[entry["name"]] = entry.get("value", f"placeholder-{entry['name'].lower()}")
    if "ROLLGATE_REDIS_URL" in environ:
        environ["ROLLGATE_REDIS_URL"] = "redis://placeholder:6379/0"
    return environ


def test_the_rendered_config_file_loads_with_the_real_loader(overlay: list[Manifest]) -> None:
    text = config_text(overlay)
    config = load_config(environ=placeholders(text), text=text)
    assert config.style == "rollgate"
    assert config.redis_prefix == "rg:"
    services = {s["metadata"]["name"]: component(s) for s in of_kind(overlay, "Service")}
    for address, name in (
        (config.router.address, "router"),
        (config.dataproxy.address, "dataproxy"),
    ):
        host, port = address.rsplit(":", 1)
        assert services[host] == name
        (service,) = [s for s in of_kind(overlay, "Service") if s["metadata"]["name"] == host]
        assert int(port) in {p["port"] for p in service["spec"]["ports"]}
    # One upstream: a worker started with --config needs no --upstream.
    assert len(config.upstreams) == 1


def test_the_config_file_holds_no_key(overlay: list[Manifest]) -> None:
    config = load_config(environ={}, text=config_text(overlay))
    assert config.admin_key_var == "" and config.dataproxy.trainer_key_var == ""
    assert all(u.api_key_var == "" for u in config.upstreams)


def test_every_rollgate_container_reads_the_mounted_config_file(overlay: list[Manifest]) -> None:
    for deployment in rollgate_deployments(overlay):
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        args = container["args"]
        assert args[args.index("--config") + 1] == f"{CONFIG_DIR}/{CONFIG_FILE}"
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes[mounts[CONFIG_DIR]]["configMap"]["name"].startswith("rollgate-config")


def _settings(objects: list[Manifest], deployment: Manifest, tmp_path: Path) -> Any:
    """The service's settings as its `__main__` builds them from args, file and environment."""
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    path = tmp_path / CONFIG_FILE
    path.write_text(config_text(objects))
    environ = container_environ(objects, deployment)
    service = component(deployment)
    src = sources_for(service, environ=environ, config_path=str(path))
    return SETTINGS[service](src, host=args[args.index("--host") + 1], port=None)


@pytest.mark.parametrize("service", ["gateway", "router", "dataproxy", "worker"])
def test_each_service_gets_its_settings_from_the_file_and_the_environment(
    overlay: list[Manifest], tmp_path: Path, service: str
) -> None:
    deployments = [d for d in rollgate_deployments(overlay) if component(d) == service]
    assert deployments
    for deployment in deployments:
        settings = _settings(overlay, deployment, tmp_path)
        assert settings.log_level == "info"
        if service in ("router", "dataproxy"):
            assert settings.redis_prefix == "rg:"
        if service in ("gateway", "worker"):
            assert settings.router_addr == "rollgate-router:50051"
        if service == "gateway":
            assert settings.dataproxy_addr == "rollgate-dataproxy:50052"
            assert settings.framed_streams is True
        if service in FRAMED_PORTS:
            # The value the real loader reads, not only the string in the manifest.
            assert settings.framed_port == FRAMED_PORTS[service]
        if service == "dataproxy":
            assert settings.refresh_timeout_s == 120.0
            assert settings.session_idle_timeout_s == 3600.0
        if service == "worker":
            # The Deployment's env wins over the file's default upstream.
            (container,) = deployment["spec"]["template"]["spec"]["containers"]
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert settings.upstream_base_url == env["ROLLGATE_UPSTREAM_BASE_URL"]
            assert settings.upstream_kind == env["ROLLGATE_UPSTREAM_KIND"]
