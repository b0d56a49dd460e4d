"""The gateway's gRPC peers: a target of several dataproxy replicas is one target each."""

from __future__ import annotations

from services.gateway.backends import target_addresses


def test_a_target_of_several_replicas_is_one_target_per_replica() -> None:
    assert target_addresses("ipv4:10.0.0.1:50052,10.0.0.2:50052") == [
        "ipv4:10.0.0.1:50052",
        "ipv4:10.0.0.2:50052",
    ]
    assert target_addresses("ipv6:[::1]:50052,[::2]:50052") == [
        "ipv6:[::1]:50052",
        "ipv6:[::2]:50052",
    ]


def test_a_target_of_one_address_or_a_name_is_itself() -> None:
    assert target_addresses("dataproxy:50052") == ["dataproxy:50052"]
    assert target_addresses("dns:///rollgate-dataproxy:50052") == [
        "dns:///rollgate-dataproxy:50052"
    ]
