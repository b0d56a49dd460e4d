"""The one error tree: each error carries its gRPC status, HTTP status, type and code.

Servicers raise these; `abort_with` puts them on the wire as trailing metadata, and
`from_rpc_error` rebuilds them on the other side, so the gateway maps one tree to HTTP.
"""

from __future__ import annotations

from typing import Any, ClassVar, NoReturn

import grpc
import orjson

ERROR_METADATA_KEY = "rollgate-error-bin"


class RollgateError(Exception):
    """Base of every error rollgate reports to a caller."""

    grpc_status: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL
    http_status: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    default_code: ClassVar[str] = "internal_error"

    def __init__(
        self, message: str, *, code: str | None = None, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.retry_after_s = retry_after_s

    def to_json(self) -> dict[str, Any]:
        """The OpenAI-style error body."""
        return {"error": {"message": self.message, "type": self.error_type, "code": self.code}}

    def to_metadata(self) -> tuple[tuple[str, bytes], ...]:
        """Trailing metadata that lets the receiver rebuild this error exactly."""
        payload = {
            "kind": type(self).__name__,
            "message": self.message,
            "code": self.code,
            "retry_after_s": self.retry_after_s,
        }
        return ((ERROR_METADATA_KEY, orjson.dumps(payload)),)


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

# Used when the peer sent a bare gRPC status (a crash, a network failure, a deadline).
_BY_STATUS: dict[grpc.StatusCode, type[RollgateError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: Conflict,
    grpc.StatusCode.RESOURCE_EXHAUSTED: TooManyRequests,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: UpstreamTimeout,
    grpc.StatusCode.CANCELLED: Unavailable,
}


def from_rpc_error(err: grpc.aio.AioRpcError, *, hop: str) -> RollgateError:
    """Rebuilds the RollgateError a peer raised, or describes the failed hop."""
    for key, value in err.trailing_metadata() or ():
        if key == ERROR_METADATA_KEY and isinstance(value, bytes):
            payload = orjson.loads(value)
            cls = _KINDS.get(payload.get("kind", ""), RollgateError)
            return cls(
                payload.get("message", ""),
                code=payload.get("code"),
                retry_after_s=payload.get("retry_after_s"),
            )
    cls = _BY_STATUS.get(err.code(), InternalError)
    if err.code() == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(
            f"the {hop} is unreachable ({err.details()}); retry shortly",
            code=f"{hop}_unavailable",
            retry_after_s=1.0,
        )
    if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return UpstreamTimeout(f"the {hop} did not answer in time", code=f"{hop}_timeout")
    return cls(f"{hop} failed: {err.code().name}: {err.details()}")


async def abort_with(context: grpc.aio.ServicerContext[Any, Any], error: RollgateError) -> NoReturn:
    """Ends the RPC with `error`, carried in trailing metadata."""
    context.set_trailing_metadata(error.to_metadata())
    await context.abort(error.grpc_status, error.message)
    raise AssertionError("unreachable: context.abort raises")
