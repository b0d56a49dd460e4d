"""The one place that turns errors into HTTP: RollgateError and aiohttp's own 4xx become JSON."""

from __future__ import annotations

import math
from typing import Any

import orjson
from aiohttp import web

from services.runtime.errors import InternalError, InvalidRequest, RollgateError
from services.runtime.logs import get_logger

log = get_logger(__name__)

JSON_CONTENT_TYPE = "application/json"

# aiohttp raises these itself (no route, wrong method, body too large, ...).
_HTTP_EXCEPTION_SHAPES: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "invalid_request"),
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
}


def json_response(payload: Any, *, status: int = 200) -> web.Response:
    """A response whose body is `payload` encoded by orjson."""
    return web.Response(body=orjson.dumps(payload), status=status, content_type=JSON_CONTENT_TYPE)


def retry_after_header(err: RollgateError) -> dict[str, str]:
    """The `Retry-After` header (whole seconds, rounded up) when the error carries one."""
    if err.retry_after_s is None:
        return {}
    return {"Retry-After": str(max(0, math.ceil(err.retry_after_s)))}


def error_response(err: RollgateError) -> web.Response:
    """The HTTP response for `err`: its status, its JSON body, Retry-After when set."""
    response = json_response(err.to_json(), status=err.http_status)
    response.headers.update(retry_after_header(err))
    return response


def sse_error_event(err: RollgateError) -> bytes:
    """The one SSE event that ends a stream which failed after its first chunk."""
    return b"data: " + orjson.dumps(err.to_json()) + b"\n\n"


def undecodable_body() -> InvalidRequest:
    """A body that is not compressed as its Content-Encoding says, or has broken chunks."""
    return InvalidRequest(
        "the request body could not be decoded: if it is sent with Content-Encoding, it "
        "must be compressed that way (or drop the header); chunked bodies must be well-formed",
        code="invalid_body_encoding",
    )


def method_not_allowed_message(method: str, path: str, allowed: set[str] | frozenset[str]) -> str:
    """What a 405 tells the client: the method it used, the path, and the methods to use instead."""
    methods = sorted(allowed)
    if not methods:
        return f"{path} does not accept {method}"
    return f"{path} does not accept {method}; use {' or '.join(methods)}"


def http_exception_response(request: web.BaseRequest, exc: web.HTTPException) -> web.Response:
    """aiohttp's own HTTP errors (no route, wrong method, body too large) in the JSON shape."""
    error_type, code = _HTTP_EXCEPTION_SHAPES.get(
        exc.status, ("invalid_request_error", "http_error")
    )
    if isinstance(exc, web.HTTPMethodNotAllowed):
        message = method_not_allowed_message(request.method, request.path, exc.allowed_methods)
    elif exc.status == 413:
        message = f"request body too large: {exc.text}" if exc.text else "request body too large"
    elif exc.status == 404:
        message = "no such endpoint; see /v1/chat/completions, /v1/models and /rl/*"
    else:
        message = exc.reason
    body = {"error": {"message": message, "type": error_type, "code": code}}
    response = json_response(body, status=exc.status)
    if "Allow" in exc.headers:
        response.headers["Allow"] = exc.headers["Allow"]
    return response


def failure_response(request: web.BaseRequest, err: Exception) -> web.Response:
    """The JSON response for what a handler raised (aiohttp's HTTP exceptions aside: they are
    `http_exception_response`'s), logged as what it is. Call it while handling `err`."""
    if isinstance(err, RollgateError):
        level = log.warning if err.http_status >= 500 else log.info
        level(
            "request_failed",
            path=request.path,
            status=err.http_status,
            code=err.code,
            message=err.message,
        )
        return error_response(err)
    if isinstance(err, web.RequestPayloadError):
        # The body could not be read: a Content-Encoding it does not have, broken chunks. The
        # rest of it cannot be framed either: the connection closes (aiohttp would otherwise
        # drain it, hit the same error and log it as an unhandled exception).
        response = error_response(undecodable_body())
        response.force_close()
        return response
    log.exception("unhandled_error", path=request.path, method=request.method)
    return error_response(InternalError("internal error; see the gateway logs"))
