"""deploy/grafana/rollgate.json: an importable Grafana dashboard whose every query uses
metrics that docs/metrics.md documents (the end-to-end workload test checks they are served)."""

from __future__ import annotations

import json
import re
from typing import Any

from tests.deploy.conftest import REPO

DASHBOARD = REPO / "deploy" / "grafana" / "rollgate.json"
METRIC = re.compile(r"\b((?:rollgate|process)_[a-z0-9_]+)\b")
SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def queries() -> list[str]:
    """Every PromQL expression of every panel."""
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def metric_names() -> set[str]:
    """The metric names the dashboard's queries use, without sample suffixes."""
    names = set()
    for expr in queries():
        for name in METRIC.findall(expr):
            for suffix in SUFFIXES:
                if name.endswith(suffix) and not name.endswith("_seconds_total"):
                    name = name[: -len(suffix)]
                    break
            names.add(name)
    return names


def test_the_dashboard_is_importable_with_a_datasource_variable() -> None:
    board = dashboard()
    assert board["uid"] == "rollgate-overview" and board["schemaVersion"] >= 36
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            expr = target["expr"]
            for opening, closing in ("()", "{}", "[]"):
                assert expr.count(opening) == expr.count(closing), expr
            assert expr.count('"') % 2 == 0, expr
            # Every variable a query uses is defined (or one of Grafana's own).
            for used in re.findall(r"\$(\w+)", expr):
                assert used in variables or used.startswith("__"), (used, expr)


def test_every_metric_the_dashboard_uses_is_documented() -> None:
    documented = (REPO / "docs" / "metrics.md").read_text()
    for name in metric_names():
        assert f"`{name}" in documented or name.startswith("process_"), name


def test_the_dashboard_covers_the_questions_of_the_issue() -> None:
    text = "\n".join(queries())
    for metric in (
        "rollgate_grpc_server_handled_total",  # is traffic flowing
        "rollgate_stream_backlog_entries",  # is the trainer keeping up
        "rollgate_exact_token_ratio",  # are the token ids exact
        "rollgate_grpc_server_handling_seconds_bucket",  # which worker is slow
        "rollgate_weight_version",
        "rollgate_submission_paused",
    ):
        assert metric in text, metric


def test_every_query_selects_the_job_variable_so_deployments_are_not_mixed() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["job"]["query"] == "label_values(rollgate_build_info, job)"
    assert variables["job"]["includeAll"] and variables["job"]["multi"]
    for expr in queries():
        # Each metric selector, with its matchers if any.
        for name, matchers in re.findall(r"\b((?:rollgate|process)_[a-z0-9_]+)(\{[^}]*\})?", expr):
            assert 'job=~"$job"' in matchers, (name, expr)
        assert 'job="' not in expr and "job!" not in expr, expr  # no job named in a query
