"""A small evaluator of Kubernetes NetworkPolicy ingress rules, enough to ask who reaches what."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Labels = Mapping[str, str]


@dataclass(frozen=True, slots=True, kw_only=True)
class Peer:
    """A pod that opens a connection: its labels, and whether it is in the policies' namespace."""

    labels: Labels = field(default_factory=dict)
    same_namespace: bool = True
    namespace_labels: Labels = field(default_factory=dict)


def selects(selector: Mapping[str, Any] | None, labels: Labels) -> bool:
    """Whether a label selector (matchLabels and matchExpressions) matches `labels`."""
    if selector is None:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def _peer_matches(rule_peer: Mapping[str, Any], peer: Peer) -> bool:
    if "ipBlock" in rule_peer:
        return False  # pods are judged by labels here, never by address
    pod_sel = rule_peer.get("podSelector")
    ns_sel = rule_peer.get("namespaceSelector")
    if ns_sel is None:
        # A bare podSelector only ever matches pods of the policy's own namespace.
        return peer.same_namespace and selects(pod_sel, peer.labels)
    if not selects(ns_sel, peer.namespace_labels):
        return False
    return pod_sel is None or selects(pod_sel, peer.labels)


def _port_matches(rule_ports: Sequence[Mapping[str, Any]] | None, port: int) -> bool:
    if not rule_ports:
        return True
    return any(p.get("port") in (None, port) for p in rule_ports)


def ingress_allowed(
    policies: Sequence[Mapping[str, Any]], target: Labels, source: Peer, port: int
) -> bool:
    """Whether `source` may open TCP `port` on a pod labelled `target`, under `policies`."""
    isolating = [
        p
        for p in policies
        if "Ingress" in (p["spec"].get("policyTypes") or ["Ingress"])
        and selects(p["spec"]["podSelector"], target)
    ]
    if not isolating:
        return True
    for policy in isolating:
        for rule in policy["spec"].get("ingress") or []:
            peers = rule.get("from")
            peer_ok = not peers or any(_peer_matches(peer, source) for peer in peers)
            if peer_ok and _port_matches(rule.get("ports"), port):
                return True
    return False
