"""The one error tree: each error carries its gRPC status, HTTP status, type and code.

Servicers raise these; the server interceptor (services/runtime/grpc_server.py) puts them on
the wire as trailing metadata, and `from_rpc_error` rebuilds them on the other side, so the
gateway maps one tree to HTTP. A message is bounded here, once, whatever it echoes.
"""

from __future__ import annotations

from typing import Any, ClassVar, NoReturn

import grpc
import orjson

from services.runtime.logs import get_logger

log = get_logger(__name__)

ERROR_METADATA_KEY = "rollgate-error-bin"
# What an error message may echo: far below gRPC's 8 KiB trailing-metadata limit, and more
# than any message needs (an identifier that long is refused as too long before it is echoed).
MAX_ERROR_MESSAGE_CHARS = 1000
_TRUNCATED = "… (truncated)"
# The longest identifier (session, interaction, model, task, group, …) a request may carry.
MAX_IDENTIFIER_CHARS = 256


def bounded(text: str, limit: int = MAX_ERROR_MESSAGE_CHARS) -> str:
    """`text`, cut to `limit` characters with a marker when longer."""
    if len(text) <= limit:
        return text
    return text[: limit - len(_TRUNCATED)] + _TRUNCATED


class RollgateError(Exception):
    """Base of every error rollgate reports to a caller."""

    grpc_status: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL
    http_status: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    default_code: ClassVar[str] = "internal_error"

    def __init__(
        self, message: str, *, code: str | None = None, retry_after_s: float | None = None
    ) -> None:
        message = bounded(message)
        super().__init__(message)
        self.message = message
        self.code = bounded(code or self.default_code, 100)
        self.retry_after_s = retry_after_s

    def to_json(self) -> dict[str, Any]:
        """The OpenAI-style error body."""
        return {"error": {"message": self.message, "type": self.error_type, "code": self.code}}

    def to_payload(self) -> bytes:
        """This error as JSON {kind, message, code, retry_after_s}: `from_payload` rebuilds it."""
        payload = {
            "kind": type(self).__name__,
            "message": self.message,
            "code": self.code,
            "retry_after_s": self.retry_after_s,
        }
        return orjson.dumps(payload)

    def to_metadata(self) -> tuple[tuple[str, bytes], ...]:
        """Trailing metadata that lets the receiver rebuild this error exactly."""
        return ((ERROR_METADATA_KEY, self.to_payload()),)


class InvalidRequest(RollgateError):
    """The request is malformed or asks for something impossible."""

    grpc_status = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400
    error_type = "invalid_request_error"
    default_code = "invalid_request"


class Unauthenticated(RollgateError):
    """The credentials are missing, unknown or of the wrong kind."""

    grpc_status = grpc.StatusCode.UNAUTHENTICATED
    http_status = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"


class PermissionDenied(RollgateError):
    """The credentials are valid but not for this operation."""

    grpc_status = grpc.StatusCode.PERMISSION_DENIED
    http_status = 403
    error_type = "permission_error"
    default_code = "permission_denied"


class NotFound(RollgateError):
    """The named thing (interaction, model, response) does not exist."""

    grpc_status = grpc.StatusCode.NOT_FOUND
    http_status = 404
    error_type = "not_found_error"
    default_code = "not_found"


class Conflict(RollgateError):
    """The request conflicts with the current state (e.g. no active episode)."""

    grpc_status = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 409
    error_type = "conflict_error"
    default_code = "conflict"


class TooManyRequests(RollgateError):
    """Capacity or rate limit reached; retry after `retry_after_s`."""

    grpc_status = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429
    error_type = "rate_limit_error"
    default_code = "rate_limited"


class Unavailable(RollgateError):
    """Temporarily unable to serve (between episodes, no worker, a service down)."""

    grpc_status = grpc.StatusCode.UNAVAILABLE
    http_status = 503
    error_type = "service_unavailable"
    default_code = "unavailable"


class UpstreamError(RollgateError):
    """The upstream LLM failed or answered with an error."""

    grpc_status = grpc.StatusCode.UNKNOWN
    http_status = 502
    error_type = "upstream_error"
    default_code = "upstream_error"


class UpstreamTimeout(RollgateError):
    """The upstream LLM or an internal hop did not answer in time."""

    grpc_status = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504
    error_type = "timeout_error"
    default_code = "timeout"


class InternalError(RollgateError):
    """A bug or an unexpected state: the message says what."""


_KINDS: dict[str, type[RollgateError]] = {
    cls.__name__: cls
    for cls in (
        RollgateError,
        InvalidRequest,
        Unauthenticated,
        PermissionDenied,
        NotFound,
        Conflict,
        TooManyRequests,
        Unavailable,
        UpstreamError,
        UpstreamTimeout,
        InternalError,
    )
}


def state_store_unavailable() -> Unavailable:
    """What a caller hears when Redis cannot be reached (the details go to the log)."""
    return Unavailable(
        "state store unavailable: retry shortly", code="state_store_unavailable", retry_after_s=1.0
    )


def check_identifier(value: str, name: str, *, limit: int = MAX_IDENTIFIER_CHARS) -> str:
    """`value` if it is at most `limit` characters, else InvalidRequest naming the limit."""
    if len(value) > limit:
        raise InvalidRequest(
            f"{name} is {len(value)} characters long; the limit is {limit}",
            code="identifier_too_long",
        )
    return value


def from_payload(value: bytes) -> RollgateError | None:
    """The error `RollgateError.to_payload` wrote, or None when `value` is not one."""
    try:
        payload = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(payload, dict):
        return None
    cls = _KINDS.get(str(payload.get("kind", "")), RollgateError)
    retry = payload.get("retry_after_s")
    return cls(
        str(payload.get("message", "")),
        code=payload.get("code") if isinstance(payload.get("code"), str) else None,
        retry_after_s=float(retry) if isinstance(retry, int | float) else None,
    )


def _from_metadata(err: grpc.aio.AioRpcError) -> RollgateError | None:
    for key, value in err.trailing_metadata() or ():
        if key == ERROR_METADATA_KEY and isinstance(value, bytes):
            return from_payload(value)
    return None


def from_rpc_error(err: grpc.aio.AioRpcError, *, hop: str) -> RollgateError:
    """Rebuilds the RollgateError a peer raised, or describes the failed hop.

    A bare status (no rollgate metadata: a crash, the network, a transport limit) is described
    by the hop and its status only; its details can name addresses and exception classes, so
    they go to the log, never to the caller.
    """
    rebuilt = _from_metadata(err)
    if rebuilt is not None:
        return rebuilt
    code = err.code()
    log.warning("rpc_failed", hop=hop, code=code.name, details=err.details())
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(
            f"the {hop} is unreachable; retry shortly",
            code=f"{hop}_unavailable",
            retry_after_s=1.0,
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return UpstreamTimeout(f"the {hop} did not answer in time", code=f"{hop}_timeout")
    if code == grpc.StatusCode.CANCELLED:
        return Unavailable(
            f"the call to the {hop} was cancelled; retry", code=f"{hop}_cancelled", retry_after_s=1
        )
    # RESOURCE_EXHAUSTED without our metadata is a transport limit (a message or its metadata
    # too large), not a rate limit: a 429 would make clients retry forever.
    return InternalError(
        f"the {hop} failed ({code.name}); see the service logs", code=f"{hop}_failed"
    )


async def abort_with(context: grpc.aio.ServicerContext[Any, Any], error: RollgateError) -> NoReturn:
    """Ends the RPC with `error`, carried in trailing metadata (servicers just raise it: the
    server interceptor calls this)."""
    context.set_trailing_metadata(error.to_metadata())
    await context.abort(error.grpc_status, error.message)
    raise AssertionError("unreachable: context.abort raises")
