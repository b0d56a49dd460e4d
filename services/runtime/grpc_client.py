"""gRPC channels: one per peer address, opened and closed by their owner."""

from __future__ import annotations

import json
from typing import Any

import grpc

from grpcpoller import unblock_grpc_poller
from services.runtime.grpc_server import MAX_MESSAGE_BYTES

CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # Fail fast while a peer restarts instead of backing off for up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    ("grpc.enable_retries", 0),
)

# A target listing several replicas ("ipv4:a:1,b:2") spreads calls and skips dead ones. One
# address keeps pick_first: after a restart its first call reconnects at once, where
# round_robin would fail calls fast until its reconnect backoff ends. With several, a call
# made while no replica is ready (one restarted and still in its reconnect backoff, ≤ 2 s, as
# the other stops: a rolling restart) waits for one, within its own deadline, instead of
# failing UNAVAILABLE at once.
_WAIT_FOR_READY = {
    "methodConfig": [{"name": [{}], "waitForReady": True}],
    "healthCheckConfig": {"serviceName": ""},
}
_MULTI_TARGET_OPTIONS = (
    ("grpc.lb_policy_name", "round_robin"),
    ("grpc.service_config", json.dumps(_WAIT_FOR_READY)),
)


def open_channel(address: str) -> grpc.aio.Channel:
    """An insecure channel to `address` (host:port) with rollgate's options."""
    options = CHANNEL_OPTIONS + (_MULTI_TARGET_OPTIONS if "," in address else ())
    channel = grpc.aio.insecure_channel(address, options=options)
    unblock_grpc_poller()
    return channel


class ChannelPool:
    """Channels to peers known only at run time (workers), keyed by address."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        """The channel to `address`, opened on first use."""
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = open_channel(address)
        return channel

    async def discard(self, address: str) -> None:
        """Closes the channel to a peer that went away."""
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def __aenter__(self) -> ChannelPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
