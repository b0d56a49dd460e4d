"""Which worker serves a (session, model): the router's answer, cached for a few seconds."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from protos import router_pb2
from services.runtime import tracing
from services.runtime.errors import from_rpc_error

if TYPE_CHECKING:
    from protos.router_pb2_grpc import RouterAsyncStub


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerChoice:
    """The worker the router chose."""

    worker_id: str
    address: str


class RouteCache:
    """A bounded LRU of router answers per (key digest, model), each valid for `ttl_s`."""

    def __init__(self, *, ttl_s: float, max_entries: int) -> None:
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str], tuple[float, WorkerChoice]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, digest: str, model: str) -> WorkerChoice | None:
        """The cached choice, or None when absent or expired."""
        entry = self._entries.get((digest, model))
        if entry is None:
            return None
        expires_at, choice = entry
        if expires_at <= time.monotonic():
            del self._entries[(digest, model)]
            return None
        self._entries.move_to_end((digest, model))
        return choice

    def put(self, digest: str, model: str, choice: WorkerChoice) -> None:
        """Remembers `choice`, evicting the least recently used entry when full."""
        self._entries[(digest, model)] = (time.monotonic() + self._ttl_s, choice)
        self._entries.move_to_end((digest, model))
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)

    def drop(self, digest: str, model: str) -> None:
        """Forgets the choice for (digest, model)."""
        self._entries.pop((digest, model), None)


async def choose_worker(
    router: RouterAsyncStub,
    cache: RouteCache,
    *,
    digest: str,
    model: str,
    timeout_s: float,
    avoid_worker_id: str = "",
) -> WorkerChoice:
    """The worker for (digest, model): from the cache, else from `Router.Route`."""
    if not avoid_worker_id:
        cached = cache.get(digest, model)
        if cached is not None:
            return cached
    request = router_pb2.RouteRequest(session=digest, model=model, avoid_worker_id=avoid_worker_id)
    try:
        response = await router.Route(request, timeout=timeout_s, metadata=tracing.grpc_metadata())
    except grpc.aio.AioRpcError as err:
        raise from_rpc_error(err, hop="router") from None
    choice = WorkerChoice(worker_id=response.worker_id, address=response.address)
    cache.put(digest, model, choice)
    return choice
