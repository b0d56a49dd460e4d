"""The kustomize overlays render, validate against the Kubernetes 1.37 schemas, and keep the
invariants docs/deploy.md promises (probes, limits, non-root, labels, selectors, grace, policy)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from services.runtime.grpc_server import STOP_NOTICE_S
from tests.deploy.conftest import OVERLAYS, Manifest, render
from tests.deploy.network_policy import Peer, ingress_allowed

K8S_VERSION = "1.37.0"
WORKLOAD_KINDS = {"Deployment", "StatefulSet"}
ROLLGATE_COMPONENTS = {"gateway", "router", "dataproxy", "worker"}
GRPC_HEALTH_NAMES = {
    "router": "rollgate.v1.Router",
    "dataproxy": "rollgate.v1.DataProxy",
    "worker": "rollgate.v1.Worker",
}
# Labels a selector may use: ones that never change between releases.
STABLE_SELECTOR_KEYS = {
    "app.kubernetes.io/name",
    "app.kubernetes.io/component",
    "rollgate.dev/upstream",
}
PORTS = {"gateway": 8080, "router": 50051, "dataproxy": 50052, "worker": 50061}
# Where the dataproxy and the workers serve DataProxy.Ledger and Worker.Turns framed
# (services/runtime/framed.py), and the variable that tells them; only gateways connect.
FRAMED_PORTS = {"dataproxy": 50062, "worker": 50063}
FRAMED_PORT_VARIABLES = {
    "dataproxy": "ROLLGATE_DATAPROXY_FRAMED_PORT",
    "worker": "ROLLGATE_WORKER_FRAMED_PORT",
}


def of_kind(objects: list[Manifest], kind: str) -> list[Manifest]:
    """The objects of one kind."""
    return [o for o in objects if o["kind"] == kind]


def workloads(objects: list[Manifest]) -> list[Manifest]:
    """Deployments and StatefulSets."""
    return [o for o in objects if o["kind"] in WORKLOAD_KINDS]


def component(obj: Manifest) -> str:
    """The app.kubernetes.io/component label of an object's pods (or of the object)."""
    labels = obj.get("spec", {}).get("template", {}).get("metadata", {}).get("labels")
    return str((labels or obj["metadata"]["labels"]).get("app.kubernetes.io/component", ""))


def rollgate_deployments(objects: list[Manifest]) -> list[Manifest]:
    """Deployments of the four rollgate services."""
    return [d for d in of_kind(objects, "Deployment") if component(d) in ROLLGATE_COMPONENTS]


def containers(objects: list[Manifest]) -> Iterator[tuple[Manifest, dict[str, Any]]]:
    """(workload, container) for every container of every workload."""
    for workload in workloads(objects):
        pod = workload["spec"]["template"]["spec"]
        for container in pod.get("initContainers", []) + pod["containers"]:
            yield workload, container


def service_ports(name: str) -> set[int]:
    """Every port a component serves its callers on (never its metrics port)."""
    return {PORTS[name]} | ({FRAMED_PORTS[name]} if name in FRAMED_PORTS else set())


def env_config(objects: list[Manifest]) -> dict[str, str]:
    """The data of the generated rollgate-env ConfigMap."""
    (config,) = [
        c for c in of_kind(objects, "ConfigMap") if c["metadata"]["name"].startswith("rollgate-env")
    ]
    return dict(config["data"])


def test_every_rendered_object_validates_against_the_kubernetes_schemas(
    overlay: list[Manifest],
) -> None:
    assert len(overlay) > 10
    for obj in overlay:
        # strict: unknown fields (typos such as `readinesProbe`) fail too.
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_base_renders_without_any_secret() -> None:
    base = render(OVERLAYS.parent / "base")
    assert of_kind(base, "Secret") == []
    assert {component(d) for d in of_kind(base, "Deployment")} == ROLLGATE_COMPONENTS


def test_every_service_has_a_deployment_service_and_service_account(
    overlay: list[Manifest],
) -> None:
    for kind in ("Deployment", "Service", "ServiceAccount"):
        present = {component(o) for o in of_kind(overlay, kind)}
        assert present >= ROLLGATE_COMPONENTS, (kind, present)
    for deployment in rollgate_deployments(overlay):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == f"rollgate-{component(deployment)}"
        assert pod["automountServiceAccountToken"] is False


def test_every_container_has_readiness_and_liveness_probes(overlay: list[Manifest]) -> None:
    for workload, container in containers(overlay):
        for probe in ("readinessProbe", "livenessProbe"):
            assert probe in container, (workload["metadata"]["name"], probe)


def test_grpc_services_probe_the_standard_health_service_by_name(
    overlay: list[Manifest],
) -> None:
    for deployment in rollgate_deployments(overlay):
        name = component(deployment)
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        if name == "gateway":
            assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
            assert container["livenessProbe"]["httpGet"]["path"] == "/health"
            continue
        readiness = container["readinessProbe"]["grpc"]
        assert readiness == {"port": PORTS[name], "service": GRPC_HEALTH_NAMES[name]}
        assert container["livenessProbe"]["grpc"]["port"] == PORTS[name]


def test_every_container_sets_cpu_and_memory_requests_and_limits(
    overlay: list[Manifest],
) -> None:
    for workload, container in containers(overlay):
        resources = container["resources"]
        for bound in ("requests", "limits"):
            assert set(resources[bound]) >= {"cpu", "memory"}, (workload["metadata"]["name"], bound)


def test_every_container_runs_non_root_read_only_without_privileges(
    overlay: list[Manifest],
) -> None:
    for workload, container in containers(overlay):
        pod = workload["spec"]["template"]["spec"]
        pod_sc = pod.get("securityContext", {})
        sc = container["securityContext"]
        where = (workload["metadata"]["name"], container["name"])
        assert sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, where
        assert sc.get("runAsUser", pod_sc.get("runAsUser", 1)) != 0, where
        assert sc["readOnlyRootFilesystem"] is True, where
        assert sc["allowPrivilegeEscalation"] is False, where
        assert sc.get("privileged", False) is False, where
        assert sc["capabilities"]["drop"] == ["ALL"], where
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {}))
        assert seccomp.get("type") == "RuntimeDefault", where


def test_rollgate_containers_run_as_uid_10001_with_a_writable_tmp_and_the_config_mounted(
    overlay: list[Manifest],
) -> None:
    for deployment in rollgate_deployments(overlay):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == 10001
        volumes = {v["name"]: v for v in pod["volumes"]}
        (container,) = pod["containers"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert "emptyDir" in volumes[mounts["/tmp"]]
        assert volumes[mounts["/etc/rollgate"]]["configMap"]["name"].startswith("rollgate-config")


def test_every_object_carries_the_recommended_labels(overlay: list[Manifest]) -> None:
    for obj in overlay:
        labels = obj["metadata"].get("labels", {})
        assert "app.kubernetes.io/name" in labels, obj["metadata"]["name"]
        assert labels.get("app.kubernetes.io/part-of") == "rollgate", obj["metadata"]["name"]
        assert labels.get("app.kubernetes.io/managed-by") == "kustomize", obj["metadata"]["name"]
    for workload in workloads(overlay):
        pod_labels = workload["spec"]["template"]["metadata"]["labels"]
        for key in ("app.kubernetes.io/name", "app.kubernetes.io/component"):
            assert key in pod_labels, (workload["metadata"]["name"], key)
    for deployment in rollgate_deployments(overlay):
        assert "app.kubernetes.io/version" in deployment["spec"]["template"]["metadata"]["labels"]


def test_workload_selectors_are_stable_subsets_of_their_pod_labels(
    overlay: list[Manifest],
) -> None:
    for workload in workloads(overlay):
        selector = workload["spec"]["selector"]["matchLabels"]
        pod_labels = workload["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= pod_labels.items(), workload["metadata"]["name"]
        assert set(selector) <= STABLE_SELECTOR_KEYS, (workload["metadata"]["name"], selector)


def test_every_service_selects_some_workload_and_every_workload_has_a_service(
    overlay: list[Manifest],
) -> None:
    services = of_kind(overlay, "Service")
    pods = [w["spec"]["template"]["metadata"]["labels"] for w in workloads(overlay)]
    for service in services:
        selector = service["spec"]["selector"]
        assert any(selector.items() <= labels.items() for labels in pods), service["metadata"]
    for workload in workloads(overlay):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert any(s["spec"]["selector"].items() <= labels.items() for s in services), workload[
            "metadata"
        ]["name"]
    # Every Service port targets a named port some selected container declares.
    for service in services:
        selected = [
            w
            for w in workloads(overlay)
            if service["spec"]["selector"].items()
            <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        declared = {
            p["name"]
            for w in selected
            for c in w["spec"]["template"]["spec"]["containers"]
            for p in c.get("ports", [])
        }
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in declared, (service["metadata"]["name"], port)


def test_grace_period_outlasts_the_prestop_sleep_plus_the_drain(overlay: list[Manifest]) -> None:
    env = env_config(overlay)
    # The drain, then serving on while clients go quiet (the stop notice), before the server stops.
    drain_s = float(env["ROLLGATE_GRACE_S"]) + float(
        env.get("ROLLGATE_STOP_NOTICE_S", STOP_NOTICE_S)
    )
    for deployment in rollgate_deployments(overlay):
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env_from = [e["configMapRef"]["name"] for e in container["envFrom"]]
        assert any(name.startswith("rollgate-env") for name in env_from)
        pre_stop_s = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pod["terminationGracePeriodSeconds"] > pre_stop_s + drain_s, deployment["metadata"]


def test_workers_advertise_their_pod_ip_and_are_named_after_the_pod(
    overlay: list[Manifest],
) -> None:
    workers = [d for d in rollgate_deployments(overlay) if component(d) == "worker"]
    assert workers
    for worker in workers:
        (container,) = worker["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        names = [e["name"] for e in container["env"]]
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["ROLLGATE_WORKER_ADVERTISE"]["value"] == "$(POD_IP):50061"
        # Kubernetes expands $(POD_IP) only when POD_IP is defined earlier in the list.
        assert names.index("POD_IP") < names.index("ROLLGATE_WORKER_ADVERTISE")
        assert env["ROLLGATE_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert container["args"][:1] == ["services.worker"]


def test_dataproxy_and_workers_are_told_the_framed_port_they_declare(
    overlay: list[Manifest],
) -> None:
    seen = set()
    for deployment in rollgate_deployments(overlay):
        name = component(deployment)
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        declared = {p["name"]: p["containerPort"] for p in container["ports"]}
        if name not in FRAMED_PORTS:
            assert "framed" not in declared, name
            assert not set(FRAMED_PORT_VARIABLES.values()) & set(env), name
            continue
        # A fixed port, never 0 (any free port): NetworkPolicies and Services name it.
        assert env[FRAMED_PORT_VARIABLES[name]] == str(FRAMED_PORTS[name]), name
        assert declared["framed"] == FRAMED_PORTS[name], name
        # Its own port: not the gRPC port, not the metrics port.
        assert len(set(declared.values())) == len(declared), (name, declared)
        seen.add(name)
    assert seen == set(FRAMED_PORTS)
    # Nothing turns the gateways' framed streams off.
    assert "ROLLGATE_FRAMED_STREAMS" not in env_config(overlay)


def test_the_dataproxy_service_carries_the_framed_port_with_the_pods_number(
    overlay: list[Manifest],
) -> None:
    services = {s["metadata"]["name"]: s for s in of_kind(overlay, "Service")}
    # The gateway reaches the dataproxy through its Service (ROLLGATE_DATAPROXY_ADDR), on the
    # port number a pod reports (LedgerEndpoint): the Service must forward that very number.
    ports = {p["name"]: p for p in services["rollgate-dataproxy"]["spec"]["ports"]}
    assert ports["framed"]["port"] == FRAMED_PORTS["dataproxy"]
    assert ports["framed"]["targetPort"] == "framed"
    assert ports["framed"].get("protocol", "TCP") == "TCP"
    # The workers' headless Service lists it too (the gateway dials pod IPs, tooling reads it).
    worker_ports = {p["name"]: p["port"] for p in services["rollgate-worker"]["spec"]["ports"]}
    assert worker_ports["framed"] == FRAMED_PORTS["worker"]
    for name in ROLLGATE_COMPONENTS:
        assert {p["port"] for p in services[f"rollgate-{name}"]["spec"]["ports"]} == (
            service_ports(name)
        ), name


def test_keys_come_only_from_the_rollgate_secrets_secret(overlay: list[Manifest]) -> None:
    for _, container in containers(overlay):
        for entry in container.get("env", []):
            if "KEY" in entry["name"] or entry["name"] == "ROLLGATE_REDIS_URL":
                ref = entry["valueFrom"]["secretKeyRef"]
                assert ref["name"].startswith("rollgate-secrets"), entry
    for config in of_kind(overlay, "ConfigMap"):
        assert not any("KEY" in k for k in config["data"]), config["metadata"]["name"]


def test_dev_secret_holds_only_obvious_placeholders(dev: list[Manifest]) -> None:
    (secret,) = of_kind(dev, "Secret")
    import base64

    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert set(data) == {"admin-key", "upstream-api-key", "redis-url"}
    assert "placeholder" in data["admin-key"]
    assert data["upstream-api-key"] == ""


def test_prod_ships_no_secret(prod: list[Manifest]) -> None:
    assert of_kind(prod, "Secret") == []


def test_dev_runs_one_replica_each_with_redis_aof_on_a_volume(dev: list[Manifest]) -> None:
    assert all(w["spec"].get("replicas", 1) == 1 for w in workloads(dev))
    (redis,) = of_kind(dev, "StatefulSet")
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--appendfsync") + 1] == "everysec"
    data_dir = args[args.index("--dir") + 1]
    mount = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}[data_dir]
    claims = {c["metadata"]["name"] for c in redis["spec"]["volumeClaimTemplates"]}
    assert mount in claims
    env = env_config(dev)
    assert "ROLLGATE_REDIS_URL" not in env  # it is in the Secret, like prod's


def test_dev_workers_front_the_in_cluster_mock_llm(dev: list[Manifest]) -> None:
    (worker,) = [d for d in rollgate_deployments(dev) if component(d) == "worker"]
    (container,) = worker["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    services = {s["metadata"]["name"] for s in of_kind(dev, "Service")}
    host = env["ROLLGATE_UPSTREAM_BASE_URL"].split("//", 1)[1].split(":", 1)[0]
    assert host in services
    # The mock speaks vLLM's token-id fields: kind vllm records exact token ids.
    assert env["ROLLGATE_UPSTREAM_KIND"] == "vllm"


def test_prod_autoscales_only_the_gateway_and_the_dataproxy(prod: list[Manifest]) -> None:
    hpas = of_kind(prod, "HorizontalPodAutoscaler")
    targets = {h["spec"]["scaleTargetRef"]["name"] for h in hpas}
    assert targets == {"rollgate-gateway", "rollgate-dataproxy"}
    deployments = {d["metadata"]["name"]: d for d in of_kind(prod, "Deployment")}
    for hpa in hpas:
        assert hpa["spec"]["minReplicas"] >= 2
        # The HPA owns the count: a replicas field would reset it on every apply.
        assert "replicas" not in deployments[hpa["spec"]["scaleTargetRef"]["name"]]["spec"]


def test_prod_rolls_out_without_losing_capacity(prod: list[Manifest]) -> None:
    for deployment in of_kind(prod, "Deployment"):
        strategy = deployment["spec"]["strategy"]
        assert strategy["type"] == "RollingUpdate"
        assert strategy["rollingUpdate"]["maxUnavailable"] == 0
        assert strategy["rollingUpdate"]["maxSurge"] >= 1


def test_prod_has_a_disruption_budget_for_every_service(prod: list[Manifest]) -> None:
    pdbs = of_kind(prod, "PodDisruptionBudget")
    covered = set()
    for pdb in pdbs:
        selector = pdb["spec"]["selector"]["matchLabels"]
        matched = [
            d
            for d in rollgate_deployments(prod)
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert matched, pdb["metadata"]["name"]
        covered |= {component(d) for d in matched}
    assert covered == ROLLGATE_COMPONENTS


def test_prod_runs_one_worker_deployment_per_upstream_replica(prod: list[Manifest]) -> None:
    workers = [d for d in rollgate_deployments(prod) if component(d) == "worker"]
    assert len(workers) >= 2
    upstreams = set()
    selectors = set()
    for worker in workers:
        (container,) = worker["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        upstreams.add(env["ROLLGATE_UPSTREAM_BASE_URL"])
        selectors.add(tuple(sorted(worker["spec"]["selector"]["matchLabels"].items())))
        assert worker["spec"]["replicas"] >= 1
    # Distinct upstreams, and no two Deployments fighting over the same pods.
    assert len(upstreams) == len(workers)
    assert len(selectors) == len(workers)


def test_prod_uses_an_external_redis_by_url(prod: list[Manifest]) -> None:
    assert of_kind(prod, "StatefulSet") == []
    for deployment in rollgate_deployments(prod):
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in container.get("env", [])}
        if component(deployment) in {"router", "dataproxy"}:
            ref = env["ROLLGATE_REDIS_URL"]["valueFrom"]["secretKeyRef"]
            assert (ref["name"], ref["key"]) == ("rollgate-secrets", "redis-url")
        else:
            assert "ROLLGATE_REDIS_URL" not in env


def pod_labels(objects: list[Manifest], name: str) -> dict[str, str]:
    """The pod labels of the first rollgate Deployment of component `name`."""
    for deployment in rollgate_deployments(objects):
        if component(deployment) == name:
            return dict(deployment["spec"]["template"]["metadata"]["labels"])
    raise AssertionError(f"no {name} Deployment")


def test_prod_network_policies_let_agents_reach_only_the_gateway(prod: list[Manifest]) -> None:
    policies = of_kind(prod, "NetworkPolicy")
    agent = Peer(labels={"app": "openclaw"}, same_namespace=False)
    assert ingress_allowed(policies, pod_labels(prod, "gateway"), agent, 8080)
    for name in ("router", "dataproxy", "worker"):
        for port in service_ports(name):
            assert not ingress_allowed(policies, pod_labels(prod, name), agent, port), name
    assert not ingress_allowed(policies, {"app.kubernetes.io/name": "redis"}, agent, 6379)
    # Even an unlabelled pod inside the namespace gets nowhere but the gateway.
    stranger = Peer(labels={"app": "debug"})
    for name in ("router", "dataproxy", "worker"):
        for port in service_ports(name):
            assert not ingress_allowed(policies, pod_labels(prod, name), stranger, port), name
    # And anything else deployed in the namespace is closed by default.
    assert not ingress_allowed(policies, {"app": "future-thing"}, stranger, 9000)


def test_prod_network_policies_let_only_trainer_pods_reach_the_trainer_port(
    prod: list[Manifest],
) -> None:
    policies = of_kind(prod, "NetworkPolicy")
    dataproxy = pod_labels(prod, "dataproxy")
    trainer = Peer(labels={"rollgate.dev/role": "trainer"}, same_namespace=False)
    assert ingress_allowed(policies, dataproxy, trainer, 50052)
    assert not ingress_allowed(policies, dataproxy, Peer(same_namespace=False), 50052)
    # The Trainer service shares 50052 with the DataProxy; the framed Ledger port is not theirs.
    assert not ingress_allowed(policies, dataproxy, trainer, FRAMED_PORTS["dataproxy"])
    for name in ("router", "worker"):
        for port in service_ports(name):
            assert not ingress_allowed(policies, pod_labels(prod, name), trainer, port), name
    assert not ingress_allowed(policies, {"app.kubernetes.io/name": "redis"}, trainer, 6379)


def test_prod_network_policies_allow_the_request_path_and_only_it(prod: list[Manifest]) -> None:
    policies = of_kind(prod, "NetworkPolicy")
    peer = {name: Peer(labels=pod_labels(prod, name)) for name in ROLLGATE_COMPONENTS}
    allowed = {
        ("gateway", "router"),
        ("gateway", "dataproxy"),
        ("worker", "router"),
        # The gateway relays each turn from the worker itself (docs/internals.md).
        ("gateway", "worker"),
    }
    for source in ROLLGATE_COMPONENTS:
        for target in ROLLGATE_COMPONENTS - {"gateway", source}:
            expected = (source, target) in allowed
            # The framed ports too: the gateway's framed streams to the dataproxy and workers.
            for port in service_ports(target):
                got = ingress_allowed(policies, pod_labels(prod, target), peer[source], port)
                assert got == expected, (source, target, port)


def test_prod_network_policies_let_only_the_gateway_reach_the_framed_ports(
    prod: list[Manifest],
) -> None:
    policies = of_kind(prod, "NetworkPolicy")
    gateway = Peer(labels=pod_labels(prod, "gateway"))
    others = [
        Peer(labels={"rollgate.dev/role": "trainer"}, same_namespace=False),
        # A trainer pod in rollgate's own namespace gets no further.
        Peer(labels={"rollgate.dev/role": "trainer"}),
        Peer(labels={"app.kubernetes.io/name": "prometheus"}, same_namespace=False),
        Peer(labels={"app": "openclaw"}, same_namespace=False),
        Peer(labels={"app": "debug"}),
        # A gateway's labels from another namespace are not the gateway.
        Peer(labels=pod_labels(prod, "gateway"), same_namespace=False),
        *(Peer(labels=pod_labels(prod, name)) for name in ROLLGATE_COMPONENTS - {"gateway"}),
    ]
    for name, port in FRAMED_PORTS.items():
        target = pod_labels(prod, name)
        # Without it the gateway logs framed_stream_unreachable_using_grpc and goes slower.
        assert ingress_allowed(policies, target, gateway, port), name
        for peer in others:
            assert not ingress_allowed(policies, target, peer, port), (name, peer)
    # Every worker Deployment's pods, not only the first one's.
    for worker in rollgate_deployments(prod):
        if component(worker) == "worker":
            labels = worker["spec"]["template"]["metadata"]["labels"]
            assert ingress_allowed(policies, labels, gateway, FRAMED_PORTS["worker"])


def test_prod_network_policies_open_every_port_a_rollgate_pod_declares(
    prod: list[Manifest],
) -> None:
    policies = of_kind(prod, "NetworkPolicy")
    callers = [
        Peer(labels={"app": "openclaw"}, same_namespace=False),
        Peer(labels={"rollgate.dev/role": "trainer"}, same_namespace=False),
        Peer(labels={"app.kubernetes.io/name": "prometheus"}, same_namespace=False),
        *(Peer(labels=pod_labels(prod, name)) for name in ROLLGATE_COMPONENTS),
    ]
    # A port a pod serves on that no policy opens would be dead in prod (and a framed one
    # would only show up as a warning and a slower gateway).
    for deployment in rollgate_deployments(prod):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        for port in container["ports"]:
            assert any(
                ingress_allowed(policies, labels, caller, port["containerPort"])
                for caller in callers
            ), (deployment["metadata"]["name"], port)


def test_prod_network_policies_let_only_router_and_dataproxy_reach_redis(
    prod: list[Manifest],
) -> None:
    policies = of_kind(prod, "NetworkPolicy")
    redis = {"app.kubernetes.io/name": "redis", "app.kubernetes.io/component": "master"}
    for name in ROLLGATE_COMPONENTS:
        got = ingress_allowed(policies, redis, Peer(labels=pod_labels(prod, name)), 6379)
        assert got == (name in {"router", "dataproxy"}), name
    # Replication between Redis pods still works.
    assert ingress_allowed(policies, redis, Peer(labels=redis), 6379)


@pytest.mark.parametrize("name", ["dev", "prod"])
def test_overlays_pin_the_image_and_never_use_latest(name: str) -> None:
    objects = render(OVERLAYS / name)
    images = {c["image"] for w, c in containers(objects) if component(w) in ROLLGATE_COMPONENTS}
    assert len(images) == 1
    (image,) = images
    assert ":" in image and not image.endswith(":latest")
