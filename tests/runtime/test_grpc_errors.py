"""The server interceptor: every servicer's errors mapped once, bounded, and never a false 429."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from protos import dataproxy_pb2, router_pb2
from services.runtime.errors import (
    ERROR_METADATA_KEY,
    MAX_ERROR_MESSAGE_CHARS,
    InternalError,
    InvalidRequest,
    NotFound,
    TooManyRequests,
    Unavailable,
    from_rpc_error,
)
from services.runtime.grpc_client import open_channel
from services.runtime.grpc_server import (
    MAX_RPC_STRING_CHARS,
    GrpcServer,
    ServerSpec,
    check_request_strings,
)

SERVICE = "rollgate.test.Probe"
HUGE = "x" * 16_384


async def _unary(request: router_pb2.RouteRequest, context: Any) -> router_pb2.RouteResponse:
    what = request.model
    if what == "not-found":
        raise NotFound(f"no interaction {request.session!r} in this episode")
    if what == "redis":
        raise RedisConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
    if what == "crash":
        raise ValueError("internal detail at 10.0.0.7:50052")
    if what == "bare-exhausted":
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "trailing metadata too large")
    if what == "limit":
        raise TooManyRequests("capacity reached", retry_after_s=2.0)
    return router_pb2.RouteResponse(worker_id="w", address=request.session[:10])


async def _stream(
    request: router_pb2.RouteRequest, context: Any
) -> AsyncIterator[router_pb2.RouteResponse]:
    yield router_pb2.RouteResponse(worker_id="first")
    raise Unavailable("between episodes", retry_after_s=1.0)


async def _bidi(
    requests: AsyncIterator[router_pb2.RouteRequest], context: Any
) -> AsyncIterator[router_pb2.RouteResponse]:
    async for request in requests:
        if request.model == "redis":
            raise RedisConnectionError("Error 111 connecting to 127.0.0.1:6379.")
        if request.model == "crash":
            raise ValueError("internal detail at 10.0.0.7:50052")
        yield router_pb2.RouteResponse(worker_id=request.model)


async def _client_stream(
    requests: AsyncIterator[router_pb2.RouteRequest], context: Any
) -> router_pb2.RouteResponse:
    async for request in requests:
        if request.model == "limit":
            raise TooManyRequests("capacity reached", retry_after_s=2.0)
    return router_pb2.RouteResponse(worker_id="done")


@pytest.fixture
async def probe() -> AsyncIterator[grpc.aio.Channel]:
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(
            _unary,
            request_deserializer=router_pb2.RouteRequest.FromString,
            response_serializer=router_pb2.RouteResponse.SerializeToString,
        ),
        "Stream": grpc.unary_stream_rpc_method_handler(
            _stream,
            request_deserializer=router_pb2.RouteRequest.FromString,
            response_serializer=router_pb2.RouteResponse.SerializeToString,
        ),
        "Bidi": grpc.stream_stream_rpc_method_handler(
            _bidi,
            request_deserializer=router_pb2.RouteRequest.FromString,
            response_serializer=router_pb2.RouteResponse.SerializeToString,
        ),
        "ClientStream": grpc.stream_unary_rpc_method_handler(
            _client_stream,
            request_deserializer=router_pb2.RouteRequest.FromString,
            response_serializer=router_pb2.RouteResponse.SerializeToString,
        ),
    }
    server = GrpcServer(ServerSpec(name="probe", host="127.0.0.1", port=0, service_names=()))
    server.server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, handlers),)
    )
    async with server:
        channel = open_channel(f"127.0.0.1:{server.port}")
        try:
            yield channel
        finally:
            await channel.close()


async def _call(channel: grpc.aio.Channel, **fields: str) -> grpc.aio.AioRpcError:
    call = channel.unary_unary(
        f"/{SERVICE}/Unary",
        request_serializer=router_pb2.RouteRequest.SerializeToString,
        response_deserializer=router_pb2.RouteResponse.FromString,
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(router_pb2.RouteRequest(**fields), timeout=10)
    return caught.value


async def test_an_error_echoing_a_huge_value_keeps_its_status_with_a_bounded_message(
    probe: grpc.aio.Channel,
) -> None:
    # Short enough to pass the request check, long enough to overflow metadata if echoed whole.
    err = await _call(probe, model="not-found", session="s" * (MAX_RPC_STRING_CHARS - 1))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    rebuilt = from_rpc_error(err, hop="probe")
    assert isinstance(rebuilt, NotFound) and rebuilt.http_status == 404
    assert len(rebuilt.message) <= MAX_ERROR_MESSAGE_CHARS
    assert rebuilt.message.startswith("no interaction 'sss") and "truncated" in rebuilt.message


async def test_an_over_long_identifier_is_invalid_and_names_the_field_and_limit(
    probe: grpc.aio.Channel,
) -> None:
    err = await _call(probe, model="ok", session=HUGE)
    rebuilt = from_rpc_error(err, hop="probe")
    assert isinstance(rebuilt, InvalidRequest) and rebuilt.http_status == 400
    assert (
        rebuilt.message == f"session is 16384 characters long; the limit is {MAX_RPC_STRING_CHARS}"
    )


async def test_redis_failures_are_state_store_unavailable_without_internal_details(
    probe: grpc.aio.Channel,
) -> None:
    rebuilt = from_rpc_error(await _call(probe, model="redis"), hop="probe")
    assert isinstance(rebuilt, Unavailable) and rebuilt.retry_after_s == 1.0
    assert rebuilt.code == "state_store_unavailable"
    assert "state store unavailable" in rebuilt.message
    assert "6379" not in rebuilt.message and "ConnectionError" not in rebuilt.message


async def test_an_unexpected_exception_is_internal_without_its_details(
    probe: grpc.aio.Channel,
) -> None:
    err = await _call(probe, model="crash")
    assert err.code() == grpc.StatusCode.INTERNAL
    rebuilt = from_rpc_error(err, hop="probe")
    assert isinstance(rebuilt, InternalError)
    assert "10.0.0.7" not in rebuilt.message and "ValueError" not in rebuilt.message
    assert "internal detail" not in (err.details() or "")


async def test_429_only_for_a_real_limit(probe: grpc.aio.Channel) -> None:
    real = from_rpc_error(await _call(probe, model="limit"), hop="probe")
    assert isinstance(real, TooManyRequests) and real.retry_after_s == 2.0
    # A bare RESOURCE_EXHAUSTED (a transport limit) carries no rollgate error: not a 429.
    bare = await _call(probe, model="bare-exhausted")
    assert bare.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert all(key != ERROR_METADATA_KEY for key, _ in bare.trailing_metadata() or ())
    rebuilt = from_rpc_error(bare, hop="probe")
    assert rebuilt.http_status != 429 and isinstance(rebuilt, InternalError)
    assert "trailing metadata" not in rebuilt.message


async def test_a_stream_that_fails_after_a_message_carries_the_error(
    probe: grpc.aio.Channel,
) -> None:
    call = probe.unary_stream(
        f"/{SERVICE}/Stream",
        request_serializer=router_pb2.RouteRequest.SerializeToString,
        response_deserializer=router_pb2.RouteResponse.FromString,
    )(router_pb2.RouteRequest(), timeout=10)
    first = await call.read()
    assert isinstance(first, router_pb2.RouteResponse) and first.worker_id == "first"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call.read()
    rebuilt = from_rpc_error(caught.value, hop="probe")
    assert isinstance(rebuilt, Unavailable) and rebuilt.message == "between episodes"


async def test_a_successful_call_passes_through(probe: grpc.aio.Channel) -> None:
    call = probe.unary_unary(
        f"/{SERVICE}/Unary",
        request_serializer=router_pb2.RouteRequest.SerializeToString,
        response_deserializer=router_pb2.RouteResponse.FromString,
    )
    reply = await call(router_pb2.RouteRequest(model="ok", session="abc"), timeout=10)
    assert (reply.worker_id, reply.address) == ("w", "abc")


async def _bidi_error(channel: grpc.aio.Channel, *models: str) -> grpc.aio.AioRpcError:
    call = channel.stream_stream(
        f"/{SERVICE}/Bidi",
        request_serializer=router_pb2.RouteRequest.SerializeToString,
        response_deserializer=router_pb2.RouteResponse.FromString,
    )(timeout=10)
    for model in models:
        await call.write(router_pb2.RouteRequest(model=model))
    await call.done_writing()
    assert (await call.read()).worker_id == models[0]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call.read()
    return caught.value


async def test_streaming_rpcs_in_both_directions_get_the_same_mapping(
    probe: grpc.aio.Channel,
) -> None:
    # A bidi stream (the dataproxy's Ledger is one) and a client stream: the one interceptor
    # maps their errors too (they reached the client as UNKNOWN "Unexpected <class …>").
    redis = from_rpc_error(await _bidi_error(probe, "ok", "redis"), hop="probe")
    assert isinstance(redis, Unavailable) and redis.code == "state_store_unavailable"
    crash = await _bidi_error(probe, "ok", "crash")
    assert crash.code() == grpc.StatusCode.INTERNAL
    assert "10.0.0.7" not in (crash.details() or "") and "ValueError" not in (crash.details() or "")
    assert isinstance(from_rpc_error(crash, hop="probe"), InternalError)

    call = probe.stream_unary(
        f"/{SERVICE}/ClientStream",
        request_serializer=router_pb2.RouteRequest.SerializeToString,
        response_deserializer=router_pb2.RouteResponse.FromString,
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(iter([router_pb2.RouteRequest(model="limit")]), timeout=10)
    limited = from_rpc_error(caught.value, hop="probe")
    assert isinstance(limited, TooManyRequests) and limited.retry_after_s == 2.0
    reply = await call(iter([router_pb2.RouteRequest(model="ok")]), timeout=10)
    assert reply.worker_id == "done"


def test_nested_request_strings_are_bounded_too() -> None:
    nested = dataproxy_pb2.LedgerRequest(begin=dataproxy_pb2.BeginTurn(session_id=HUGE))
    with pytest.raises(InvalidRequest, match="session_id is 16384 characters long"):
        check_request_strings(nested)
    check_request_strings(
        dataproxy_pb2.LedgerRequest(begin=dataproxy_pb2.BeginTurn(session_id="s"))
    )
