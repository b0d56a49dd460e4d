"""What each service registers is what docs/metrics.md lists (one table per service, plus the
one every service serves) and all the Grafana dashboard asks for: the real services run
in-process with their metrics ports, in a state where every conditional family is served
(a staleness bound, granted capacity, a pause), and their /metrics pages are read."""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos import trainer_pb2, trainer_pb2_grpc
from rollgate.mock_llm import MockLLM
from rollgate.redis_server import free_port
from services.dataproxy.__main__ import serving as dataproxy_serving
from services.dataproxy.settings import DataProxySettings
from services.gateway.app import GatewayServer
from services.router.__main__ import serving as router_serving
from services.router.settings import RouterSettings
from services.runtime.grpc_client import open_channel
from services.runtime.metrics import MetricsEndpoint
from services.runtime.secret import Secret
from services.worker.__main__ import serving as worker_serving
from services.worker.settings import WorkerSettings
from tests.deploy.test_grafana import queries
from tests.gateway.conftest import gateway_settings
from tests.harness.poll import eventually

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "metrics.md"
SERVICES = ("gateway", "router", "dataproxy", "worker")
ADMIN_KEY = "rg-admin-catalog-0123456789"
# Families of prometheus_client's own collectors (documented as `process_*`, `python_info`).
COLLECTOR_PREFIXES = ("process_", "python_")

# service -> {family name as documented (counters with _total) -> type}
Catalog = dict[str, dict[str, str]]


def documented_name(name: str, kind: str) -> str:
    """How docs/metrics.md names a family: counters by their sample name (`…_total`)."""
    return f"{name}_total" if kind == "counter" else name


def sample_names(name: str, kind: str) -> set[str]:
    """The names a query can select for a family."""
    if kind == "counter":
        return {f"{name}_total"}
    if kind == "histogram":
        return {f"{name}_bucket", f"{name}_count", f"{name}_sum"}
    return {name}


async def _scrape(http: aiohttp.ClientSession, port: int) -> dict[str, str]:
    async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return {f.name: f.type for f in text_string_to_metric_families(text)}


async def _serve_and_scrape(redis_url: str) -> Catalog:
    prefix = f"rgcatalog:{uuid.uuid4().hex[:8]}:"
    ports = {name: free_port() for name in ("router", "dataproxy", "worker")}
    async with contextlib.AsyncExitStack() as exits:
        router = await exits.enter_async_context(
            router_serving(
                RouterSettings(
                    port=0,
                    redis_url=redis_url,
                    redis_prefix=prefix,
                    grace_s=0.5,
                    metrics=MetricsEndpoint(port=ports["router"]),
                )
            )
        )
        proxy = await exits.enter_async_context(
            dataproxy_serving(
                DataProxySettings(
                    port=0,
                    redis_url=redis_url,
                    redis_prefix=prefix,
                    admin_key=Secret(ADMIN_KEY),
                    # A staleness bound: the capacity families are served.
                    max_head_offpolicyness=2,
                    grace_s=0.5,
                    metrics=MetricsEndpoint(port=ports["dataproxy"]),
                )
            )
        )
        mock = await exits.enter_async_context(MockLLM(port=0))
        await exits.enter_async_context(
            worker_serving(
                WorkerSettings(
                    port=0,
                    router_addr=f"127.0.0.1:{router.port}",
                    worker_id="w-catalog",
                    upstream_base_url=mock.base_url,
                    upstream_models=(mock.model,),
                    upstream_kind="vllm",
                    grace_s=0.5,
                    metrics=MetricsEndpoint(port=ports["worker"]),
                )
            )
        )
        gateway = await exits.enter_async_context(
            GatewayServer(
                gateway_settings(
                    router_addr=f"127.0.0.1:{router.port}",
                    dataproxy_addr=f"127.0.0.1:{proxy.port}",
                )
            )
        )
        assert gateway.metrics_server.port is not None
        ports["gateway"] = gateway.metrics_server.port
        channel = open_channel(f"127.0.0.1:{proxy.port}")
        exits.push_async_callback(channel.close)
        trainer = trainer_pb2_grpc.TrainerStub(channel)
        auth = (("authorization", f"Bearer {ADMIN_KEY}"),)
        # Granted capacity and a pause: their families are served only then.
        await trainer.GrantCapacity(
            trainer_pb2.GrantCapacityRequest(episodes=1), metadata=auth, timeout=10
        )
        await trainer.PauseSubmission(
            trainer_pb2.PauseSubmissionRequest(timeout_s=1), metadata=auth, timeout=10
        )
        http = await exits.enter_async_context(aiohttp.ClientSession())

        async def router_lists_the_worker() -> bool:
            return "rollgate_worker_live" in await _scrape(http, ports["router"])

        await eventually(router_lists_the_worker, timeout_s=20, what="the worker registered")
        catalog: Catalog = {}
        for service in SERVICES:
            families = await _scrape(http, ports[service])
            catalog[service] = {
                documented_name(n, t): t
                for n, t in families.items()
                if not _created_of(n, families)
            }
        return catalog


def _created_of(name: str, families: dict[str, str]) -> bool:
    """prometheus_client's `<counter or histogram>_created` gauge (its start time)."""
    base = name.removesuffix("_created")
    return base != name and families.get(base) in ("counter", "histogram")


@pytest.fixture(scope="module")
def registered(redis_url: str) -> Iterator[Catalog]:
    yield asyncio.run(_serve_and_scrape(redis_url))


def documented() -> dict[str, dict[str, str]]:
    """docs/metrics.md: section ("every service" or a service) -> {metric -> type column}."""
    sections: dict[str, dict[str, str]] = {}
    current: str | None = None
    for line in DOCS.read_text().splitlines():
        heading = re.fullmatch(r"## (.+)", line)
        if heading:
            current = heading.group(1).strip().lower()
            continue
        if current is None or not line.startswith("| `"):
            continue
        first, kind = (cell.strip() for cell in line.strip("|").split("|")[:2])
        for name in re.findall(r"`([a-z0-9_*]+)`", first):
            sections.setdefault(current, {})[name] = kind
    return sections


def _matches(documented_name: str, name: str) -> bool:
    if documented_name.endswith("*"):
        return name.startswith(documented_name[:-1])
    return documented_name == name


def test_each_service_serves_exactly_the_metrics_its_table_lists(registered: Catalog) -> None:
    docs = documented()
    common = docs["every service"]
    for service in SERVICES:
        table = docs[service]
        served = registered[service]
        for name, kind in served.items():
            in_common = [d for d in common if _matches(d, name)]
            if in_common:
                assert name not in table, f"{service}: {name} is in both tables"
                continue
            assert name in table, f"{service} serves {name} ({kind}): not in its table"
            # The type column: `counter`, `gauge`, `histogram` (`gauge, global` for the
            # router's values read from Redis).
            assert table[name].split(",")[0] == kind, (service, name, table[name], kind)
        for name in table:
            assert name in served, f"{service}'s table lists {name}, which it does not serve"
        for name in common:
            assert any(_matches(name, s) for s in served), f"{service} does not serve {name}"


def test_every_metric_the_dashboard_queries_is_served_by_some_service(
    registered: Catalog,
) -> None:
    selectable = {
        sample
        for catalog in registered.values()
        for name, kind in catalog.items()
        for sample in sample_names(name.removesuffix("_total") if kind == "counter" else name, kind)
    }
    for expr in queries():
        for name in re.findall(r"\b((?:rollgate|process)_[a-z0-9_]+)\b", expr):
            assert name in selectable, f"the dashboard queries {name}, which no service serves"
