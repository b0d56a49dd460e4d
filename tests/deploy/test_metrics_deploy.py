"""Where the metrics ports are in the deployments: every container declares its metrics port
(and is told it), Prometheus finds every pod (annotations, headless Services, the optional
ServiceMonitor), only Prometheus reaches them in prod, compose publishes them on the host, and
the public gateway Service never carries them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.conftest import OVERLAYS, REPO, Manifest, render
from tests.deploy.network_policy import Peer, ingress_allowed
from tests.deploy.test_kubernetes import (
    ROLLGATE_COMPONENTS,
    component,
    of_kind,
    pod_labels,
    rollgate_deployments,
    service_ports,
)

METRICS_PORTS = {"gateway": 9080, "router": 9051, "dataproxy": 9052, "worker": 9061}
PROMETHEUS = Peer(labels={"app.kubernetes.io/name": "prometheus"}, same_namespace=False)


def _container(deployment: Manifest) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(container)


def test_every_service_is_told_its_metrics_port_and_declares_it(overlay: list[Manifest]) -> None:
    for deployment in rollgate_deployments(overlay):
        name = component(deployment)
        container = _container(deployment)
        args = container["args"]
        port = int(args[args.index("--metrics-port") + 1])
        assert port == METRICS_PORTS[name]
        declared = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert declared["metrics"] == port
        assert port not in service_ports(name)
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(port)
        assert annotations["prometheus.io/path"] == "/metrics"


def test_each_component_has_a_headless_metrics_service_and_the_public_ones_do_not(
    overlay: list[Manifest],
) -> None:
    services = {s["metadata"]["name"]: s for s in of_kind(overlay, "Service")}
    for name in ROLLGATE_COMPONENTS:
        metrics = services[f"rollgate-{name}-metrics"]
        assert metrics["spec"]["clusterIP"] == "None"
        assert metrics["metadata"]["labels"]["rollgate.dev/metrics"] == "true"
        assert metrics["spec"]["selector"] == {
            "app.kubernetes.io/name": "rollgate",
            "app.kubernetes.io/component": name,
        }
        assert [(p["name"], p["port"]) for p in metrics["spec"]["ports"]] == [
            ("metrics", METRICS_PORTS[name])
        ]
        main = services[f"rollgate-{name}"]
        assert "metrics" not in {p["name"] for p in main["spec"]["ports"]}
        assert METRICS_PORTS[name] not in {p["port"] for p in main["spec"]["ports"]}


def test_prod_lets_prometheus_and_only_prometheus_reach_the_metrics_ports(
    prod: list[Manifest],
) -> None:
    policies = of_kind(prod, "NetworkPolicy")
    strangers = [
        Peer(labels={"app": "openclaw"}, same_namespace=False),
        Peer(labels={"app": "debug"}),
        Peer(labels={"rollgate.dev/role": "trainer"}, same_namespace=False),
    ]
    for name in ROLLGATE_COMPONENTS:
        target = pod_labels(prod, name)
        assert ingress_allowed(policies, target, PROMETHEUS, METRICS_PORTS[name]), name
        for stranger in strangers:
            assert not ingress_allowed(policies, target, stranger, METRICS_PORTS[name]), name
        # Prometheus gets the metrics port only: never a service's own ports (framed included).
        if name != "gateway":
            for port in service_ports(name):
                assert not ingress_allowed(policies, target, PROMETHEUS, port), (name, port)
    # The other services' pods still cannot reach each other's metrics ports.
    gateway = Peer(labels=pod_labels(prod, "gateway"))
    assert not ingress_allowed(policies, pod_labels(prod, "dataproxy"), gateway, 9052)


def test_the_servicemonitor_component_scrapes_every_metrics_service(tmp_path: Path) -> None:
    overlay = tmp_path / "monitored"
    overlay.mkdir()
    prod = os.path.relpath(OVERLAYS / "prod", overlay)
    monitor = os.path.relpath(REPO / "deploy/k8s/components/servicemonitor", overlay)
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                # As in the prod overlay, which a user extends with the component.
                "namespace": "rollgate",
                "resources": [prod],
                "components": [monitor],
            }
        )
    )
    objects = render(overlay)
    (monitor_obj,) = of_kind(objects, "ServiceMonitor")
    assert monitor_obj["metadata"]["namespace"] == "rollgate"
    selector = monitor_obj["spec"]["selector"]["matchLabels"]
    selected = [
        s
        for s in of_kind(objects, "Service")
        if selector.items() <= s["metadata"]["labels"].items()
    ]
    assert {s["metadata"]["name"] for s in selected} == {
        f"rollgate-{name}-metrics" for name in ROLLGATE_COMPONENTS
    }
    (endpoint,) = monitor_obj["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert all({p["name"] for p in s["spec"]["ports"]} == {endpoint["port"]} for s in selected)


def test_compose_publishes_each_metrics_port_on_the_host(tmp_path: Path) -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    published = {}
    for name, service in compose["services"].items():
        command = service.get("command", [])
        if not command or not str(command[0]).startswith("services."):
            continue
        port = int(command[command.index("--metrics-port") + 1])
        targets = [p.rsplit(":", 1)[1] for p in service.get("ports", [])]
        assert str(port) in targets, name
        host = next(p for p in service["ports"] if p.rsplit(":", 1)[1] == str(port))
        published[name] = host.split(":")[-2]
        assert host.startswith("${ROLLGATE_BIND:-127.0.0.1}:"), name
    assert set(published) == {"router", "dataproxy", "gateway", "worker-1", "worker-2"}
    assert len(set(published.values())) == len(published), "host ports collide"
    scrape = yaml.safe_load((REPO / "deploy/prometheus/compose.yml").read_text())
    targets = {
        t for job in scrape["scrape_configs"] for c in job["static_configs"] for t in c["targets"]
    }
    for name, service in compose["services"].items():
        if name in published:
            command = service["command"]
            assert f"{name}:{command[command.index('--metrics-port') + 1]}" in targets, name
