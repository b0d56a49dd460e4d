"""GET /v1/models: the models the live workers' upstreams serve, as an OpenAI list."""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from aiohttp import web

from protos import dataproxy_pb2, router_pb2
from services.gateway.auth import KeyKind, require_any_key
from services.gateway.backends import BACKENDS, SETTINGS
from services.gateway.http_errors import json_response
from services.gateway.key_admin import KEYS
from services.gateway.protocols import Protocol, Route, openai_paths
from services.runtime.errors import from_rpc_error
from services.runtime.keys import key_digest

STARTED_AT = web.AppKey("started_at", int)


def model_list(workers: Iterable[router_pb2.WorkerInfo], *, created: int) -> dict[str, object]:
    """The OpenAI model list for the union of the live workers' models."""
    names = sorted({model for worker in workers if worker.live for model in worker.models})
    data = [
        {"id": name, "object": "model", "created": created, "owned_by": "rollgate"}
        for name in names
    ]
    return {"object": "list", "data": data}


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models and /models (session or admin key)."""
    settings = request.app[SETTINGS]
    backends = request.app[BACKENDS]
    kind, key = await require_any_key(request.headers, settings.admin_key, request.app[KEYS].lookup)
    if kind is KeyKind.SESSION:
        # Rejects well-formed keys the dataproxy does not know (401).
        try:
            await backends.dataproxy.ResolveKey(
                dataproxy_pb2.ResolveKeyRequest(key_digest=key_digest(key)),
                timeout=settings.rpc_timeout_s,
            )
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, hop="dataproxy") from None
    try:
        response = await backends.router.ListWorkers(
            router_pb2.ListWorkersRequest(), timeout=settings.rpc_timeout_s
        )
    except grpc.aio.AioRpcError as err:
        raise from_rpc_error(err, hop="router") from None
    return json_response(model_list(response.workers, created=request.app[STARTED_AT]))


PROTOCOL = Protocol(
    name="models",
    # Twinned under the session prefixes like a session-key route, where the admin key (which
    # names no episode) is taken as well.
    routes=tuple(
        Route(method="GET", path=path, handler=list_models, admin_key=True)
        for path in openai_paths("/models")
    ),
)
