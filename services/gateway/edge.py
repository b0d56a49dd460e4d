"""The gateway's HTTP/1.1 edge: what happens before a request reaches a route.

aiohttp answers some requests itself, in text/plain, before any middleware runs: requests its
parser refuses (bad methods, oversized or malformed headers, bad framing, bad URLs, unknown
HTTP versions), an `Expect` it does not know, a handler that crashed past every middleware.
Here those answers take the routes' error shape, with the status that names the problem, and
a client that sends its request head slowly is cut off after `header_timeout_s`.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web, web_protocol
from aiohttp.http import HttpVersion10, HttpVersion11
from aiohttp.http_exceptions import (
    BadHttpMethod,
    BadStatusLine,
    ContentEncodingError,
    HttpProcessingError,
    InvalidURLError,
    LineTooLong,
    PayloadEncodingError,
)
from aiohttp.streams import StreamReader

from services.gateway.http_errors import (
    error_response,
    http_exception_response,
    undecodable_body,
)
from services.gateway.protocols import ErrorShapes
from services.runtime.errors import InternalError, InvalidRequest, RollgateError, UpstreamTimeout
from services.runtime.logs import get_logger

log = get_logger(__name__)

# Content-Encodings the body parser decodes; anything else would reach a route undecoded.
SUPPORTED_CONTENT_ENCODINGS = frozenset({"", "identity", "gzip", "deflate"})
# Headers rollgate interprets (keys, ids, flags, framing): their values must be ASCII. Other
# headers only have to be valid UTF-8 (free text such as X-Title passes through untouched).
_ASCII_HEADERS = frozenset(
    name.lower()
    for name in (
        "Authorization",
        "X-Api-Key",
        "X-Request-Id",
        "X-Session-Id",
        "X-Turn-Type",
        "X-Session-Done",
        "Idempotency-Key",
        "Content-Type",
        "Content-Encoding",
        "Content-Length",
        "Transfer-Encoding",
        "Expect",
        "Upgrade",
        "Connection",
    )
)
_METHODS_SERVED = "GET, POST"
_LINGER_AFTER_408_S = 2.0
_TOKEN = re.compile(r"[A-Za-z]{1,20}")


@dataclass(frozen=True, slots=True, kw_only=True)
class EdgeLimits:
    """The HTTP/1.1 edge's limits (GatewaySettings holds them; docs/deploy.md documents them)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 75.0
    max_header_bytes: int = 8190
    max_headers: int = 128


class RequestTimeout(InvalidRequest):
    """The request head did not arrive in time."""

    http_status = 408
    default_code = "request_timeout"


class MethodNotAllowed(InvalidRequest):
    """An HTTP method the gateway does not serve at all."""

    http_status = 405
    default_code = "method_not_allowed"


class UriTooLong(InvalidRequest):
    """The request line is over the header size limit."""

    http_status = 414
    default_code = "uri_too_long"


class HeadersTooLarge(InvalidRequest):
    """A header line, or the number of headers, is over its limit."""

    http_status = 431
    default_code = "headers_too_large"


class UnsupportedEncoding(InvalidRequest):
    """A Content-Encoding the gateway cannot decode."""

    http_status = 415
    default_code = "unsupported_content_encoding"


class ExpectationFailed(InvalidRequest):
    """An `Expect` other than `100-continue`."""

    http_status = 417
    default_code = "expectation_failed"


class VersionNotSupported(InvalidRequest):
    """An HTTP version other than 1.0 and 1.1."""

    http_status = 505
    default_code = "http_version_not_supported"


def parser_error(
    exc: BaseException | None, *, max_header_bytes: int, max_headers: int
) -> RollgateError:
    """The client-facing error for a request aiohttp's parser refused (never echoing bytes)."""
    if isinstance(exc, BadHttpMethod):
        token = _first_token(exc.message)
        if token is not None:
            hint = (
                f"; methods are case-sensitive: use {token.upper()}"
                if token.upper() in ("GET", "POST")
                else ""
            )
            return MethodNotAllowed(
                f"the gateway does not serve the method {token}{hint} (it serves {_METHODS_SERVED})"
            )
        return InvalidRequest(
            "malformed request line: the method is not a valid HTTP token",
            code="malformed_request_line",
        )
    if isinstance(exc, LineTooLong):
        if re.search(r"reading: (bytearray\()?b'(/|\*|[a-zA-Z]+://)", exc.message):
            return UriTooLong(
                f"the request line is longer than {max_header_bytes} bytes; shorten the URL "
                "(send data in the body)"
            )
        return HeadersTooLarge(
            f"a header line is longer than {max_header_bytes} bytes "
            "(the limit is ROLLGATE_MAX_HEADER_BYTES)"
        )
    if isinstance(exc, ContentEncodingError):
        # The parser decodes a body that arrived with its head: it fails on a codec it lacks
        # (brotli, zstd: "Please install …") or on bytes not compressed as declared.
        if "install" in exc.message:
            return UnsupportedEncoding(
                "this Content-Encoding cannot be decoded here; send the body uncompressed, or "
                "compressed with gzip or deflate"
            )
        return undecodable_body()
    if isinstance(exc, InvalidURLError):
        part = "query string" if "query" in exc.message else "path"
        return InvalidRequest(
            f"the URL {part} contains a character that must be percent-encoded "
            "(non-ASCII, a control character or a space)",
            code="invalid_url",
        )
    if isinstance(exc, BadStatusLine) and "HTTP version" in exc.message:
        return VersionNotSupported("only HTTP/1.0 and HTTP/1.1 are served")
    if isinstance(exc, HttpProcessingError):
        return _framing_error(exc.message, max_headers=max_headers)
    return InvalidRequest("the request is not valid HTTP/1.1", code="malformed_request")


def _framing_error(message: str, *, max_headers: int) -> RollgateError:
    """Header and body-framing errors, by llhttp's description (its first line)."""
    described = message.split(":\n", 1)[0].strip()
    lowered = described.lower()
    if "pri" in lowered.replace("/", " ").split():
        # HTTP/2 with prior knowledge: its connection preface starts `PRI * HTTP/2.0`.
        return VersionNotSupported(
            "HTTP/2 is not served: speak HTTP/1.1 to the gateway (put an HTTP/2 proxy in front "
            "for HTTP/2 clients)"
        )
    if "too many headers" in lowered:
        return HeadersTooLarge(
            f"more than {max_headers} headers (the limit is ROLLGATE_MAX_HEADERS)"
        )
    if "content-length" in lowered:
        return InvalidRequest(
            "Content-Length is invalid, repeated, or sent with Transfer-Encoding: send one "
            "decimal Content-Length, or Transfer-Encoding: chunked alone",
            code="invalid_content_length",
        )
    if "transfer-encoding" in lowered or "chunk" in lowered:
        return InvalidRequest(
            "Transfer-Encoding is invalid: only `chunked` (as the last coding) is accepted, "
            "with well-formed chunks",
            code="invalid_transfer_encoding",
        )
    if "whitespace" in lowered or "fold" in lowered:
        return InvalidRequest(
            "a header is folded over several lines or has whitespace before its colon; send "
            "each header on one line",
            code="invalid_header",
        )
    if "header" in lowered:
        return InvalidRequest(
            "a header is malformed: its name must be a token followed by a colon, and its "
            "value must not contain NUL or other control characters",
            code="invalid_header",
        )
    if "crlf" in lowered or "lf" in lowered.split():
        return InvalidRequest(
            "malformed request: lines must end with CRLF", code="malformed_request"
        )
    return InvalidRequest(
        f"the request is not valid HTTP/1.1 ({_safe_description(described)})",
        code="malformed_request",
    )


def _safe_description(described: str) -> str:
    # llhttp's descriptions never carry request bytes; an odd one might: keep letters only.
    return re.sub(r"[^A-Za-z0-9 `'-]", "", described)[:120] or "unparseable"


def _first_token(message: str) -> str | None:
    """The method of the refused request line, when it is a plain word."""
    match = re.search(r"b'([^ ']*)", message)
    if match is None:
        return None
    token = match.group(1)
    return token if _TOKEN.fullmatch(token) else None


def _answered_in_http11(
    request: web.BaseRequest, response: web.StreamResponse
) -> web.StreamResponse:
    """A refusal of an HTTP/2.0 or HTTP/0.9 request line, answered `HTTP/1.1 505` and closed.

    aiohttp writes a response's status line in the request's version (`HTTP/2.0 505` would
    claim a protocol the gateway does not speak) and offers no public way to change it, so the
    parsed message's version is replaced: private attributes of the pinned aiohttp, which
    tests/gateway/test_http_edge.py checks on every such request line (it fails loudly if the
    attribute goes away).
    """
    request._message = request._message._replace(version=HttpVersion11)
    request._cache["version"] = HttpVersion11  # `version` is reified
    response.force_close()
    return response


def check_request_head(request: web.BaseRequest) -> None:
    """The checks aiohttp's parser leaves to us: version, header bytes, Content-Encoding."""
    if request.version not in (HttpVersion10, HttpVersion11):
        raise VersionNotSupported("only HTTP/1.0 and HTTP/1.1 are served")
    for name, value in request.headers.items():
        if value.isascii():
            continue
        if name.lower() in _ASCII_HEADERS:
            raise InvalidRequest(
                f"the {_header_name(name)} header contains non-ASCII bytes; its value must be "
                "ASCII (keys and ids are)",
                code="invalid_header",
            )
        if _has_undecodable_bytes(value):
            raise InvalidRequest(
                f"the {_header_name(name)} header is not valid UTF-8", code="invalid_header"
            )
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in SUPPORTED_CONTENT_ENCODINGS:
        raise UnsupportedEncoding(
            f"Content-Encoding {encoding[:40]!r} is not supported: send the body uncompressed, "
            "or compressed with gzip or deflate"
        )


def _header_name(name: str) -> str:
    return name[:64]


def _has_undecodable_bytes(value: str) -> bool:
    # aiohttp decodes header bytes that are not UTF-8 as lone surrogates.
    try:
        value.encode()
    except UnicodeEncodeError:
        return True
    return False


_AppHandler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
# Counts a request answered here, before routing: (method or UNPARSED_METHOD, status).
RefusalHook = Callable[[str, int], None]
# The method label of a request whose request line never parsed.
UNPARSED_METHOD = "unparsed"


def _not_counted(method: str, status: int) -> None:
    """The refusal hook of an edge without metrics."""


# The edge of an app without protocols of their own error shape.
OPENAI_ONLY = ErrorShapes()


def edge_handler(
    app_handler: _AppHandler,
    on_refused: RefusalHook = _not_counted,
    shapes: ErrorShapes = OPENAI_ONLY,
) -> _AppHandler:
    """Wraps the application: head checks first, and aiohttp's own HTTP exceptions as JSON
    (in the shape of the protocol the path belongs to, as the app's own errors)."""

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        protocol = request.protocol
        if isinstance(protocol, GatewayRequestHandler):
            protocol.head_received()
            protocol.watch_body(request)
        try:
            check_request_head(request)
            return await app_handler(request)
        except RollgateError as err:
            log.info("request_refused", path=request.path, status=err.http_status, code=err.code)
            on_refused(request.method, err.http_status)
            if request.version not in (HttpVersion10, HttpVersion11):
                return _answered_in_http11(request, shapes.reshape(request, error_response(err)))
            return shapes.reshape(request, error_response(err))
        except web.HTTPException as exc:
            # Raised before the middlewares (an unknown Expect): same shape as theirs.
            if exc.status < 400:
                raise
            on_refused(request.method, exc.status)
            if exc.status == 417:
                expect = ExpectationFailed(
                    "the only Expect value served is 100-continue; drop the header or "
                    "send `Expect: 100-continue`"
                )
                return shapes.reshape(request, error_response(expect))
            return shapes.reshape(request, http_exception_response(request, exc))

    return handle


class GatewayRequestHandler(web_protocol.RequestHandler):
    """aiohttp's connection handler with JSON parser errors and a request-head deadline."""

    def __init__(
        self,
        manager: web.Server,
        *,
        limits: EdgeLimits,
        on_refused: RefusalHook = _not_counted,
        shapes: ErrorShapes = OPENAI_ONLY,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            manager,
            keepalive_timeout=limits.keepalive_timeout_s,
            max_line_size=limits.max_header_bytes,
            max_field_size=limits.max_header_bytes,
            max_headers=limits.max_headers,
            **kwargs,
        )
        self._limits = limits
        self._on_refused = on_refused
        self._shapes = shapes
        # True while the connection waits for the head of its next request.
        self._awaiting_head = True
        # Loop time of the first byte of the head under way (None: no head is).
        self._head_since: float | None = None
        # The body under watch, and the loop time its wait began.
        self._body: StreamReader | None = None
        self._body_since = 0.0
        # One timer for both deadlines, armed for the earliest one known and never moved later:
        # a request done in time costs no timer of its own (arming and cancelling one per head
        # and per body cost more than a wake-up every `header_timeout_s` that finds none due).
        self._deadlines: asyncio.TimerHandle | None = None
        # Set once a 408 went out: what the client still sends is read and dropped.
        self._timed_out = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Starts waiting for the first request head."""
        super().connection_made(transport)
        self._awaiting_head = True

    def data_received(self, data: bytes) -> None:
        """Starts the head deadline at the first byte of a request head."""
        if self._timed_out:
            return
        if self._awaiting_head and self._head_since is None and data:
            self._head_since = now = self._loop.time()
            self._due_by(now + self._limits.header_timeout_s)
        super().data_received(data)

    def head_received(self) -> None:
        """A complete head arrived (its request is being handled): no deadline until the next."""
        self._awaiting_head = False
        self._head_since = None

    def watch_body(self, request: web.BaseRequest) -> None:
        """Gives the request's body `body_timeout_s` to arrive; then reading it fails with 408."""
        payload = request.content
        if not request.body_exists or payload.is_eof():
            return
        # Requests on a connection come one after the other: the previous body is complete.
        self._body = payload
        self._body_since = now = self._loop.time()
        self._due_by(now + self._limits.body_timeout_s)

    def _due_by(self, when: float) -> None:
        """Makes the deadline timer fire by `when` (loop time)."""
        timer = self._deadlines
        if timer is not None:
            if timer.when() <= when:
                return
            timer.cancel()
        self._deadlines = self._loop.call_at(when, self._check_deadlines)

    def _check_deadlines(self) -> None:
        """The deadline timer: a head or a body past its deadline is answered 408; the timer
        is armed again for what is still under way."""
        self._deadlines = None
        now = self._loop.time()
        if self._awaiting_head and self._head_since is not None:
            due = self._head_since + self._limits.header_timeout_s
            if due <= now:
                self._head_timed_out()
                return
            self._due_by(due)
        body = self._body
        if body is not None:
            due = self._body_since + self._limits.body_timeout_s
            if body.is_eof():
                self._body = None
            elif due <= now:
                self._body = None
                self._body_timed_out(body)
            else:
                self._due_by(due)

    def _body_timed_out(self, payload: StreamReader) -> None:
        if payload.is_eof():
            return
        log.info("request_body_timeout", timeout_s=self._limits.body_timeout_s)
        # The handler's read raises this (the error middleware answers 408); EOF stops
        # aiohttp from draining the rest, and the connection closes after the answer.
        payload.set_exception(
            RequestTimeout(
                f"the request body did not arrive within {self._limits.body_timeout_s:g} s "
                "(ROLLGATE_BODY_TIMEOUT_S)"
            )
        )
        payload.feed_eof()
        self.close()

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        """After each response the connection waits for the next head (keep-alive)."""
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._awaiting_head = True

    def connection_lost(self, exc: BaseException | None) -> None:
        """Drops the deadlines with the connection."""
        if self._deadlines is not None:
            self._deadlines.cancel()
            self._deadlines = None
        self._body = None
        super().connection_lost(exc)

    def _head_timed_out(self) -> None:
        transport = self.transport
        if not self._awaiting_head or transport is None or transport.is_closing():
            return
        error = RequestTimeout(
            f"the request head did not arrive within {self._limits.header_timeout_s:g} s "
            "(ROLLGATE_HEADER_TIMEOUT_S); send the request line and headers at once"
        )
        log.info("request_head_timeout", timeout_s=self._limits.header_timeout_s)
        self._on_refused(UNPARSED_METHOD, error.http_status)
        self._timed_out = True
        transport.write(_raw_error_response(error))
        # Half-close and keep reading a moment, so a client still sending does not get a
        # reset that would destroy the 408 before it reads it.
        if transport.can_write_eof():
            transport.write_eof()
        self._loop.call_later(_LINGER_AFTER_408_S, self.force_close)

    def log_exception(self, *args: Any, **kwargs: Any) -> None:
        """aiohttp's unhandled-exception log, except for a body the client did not encode as
        it said (found while draining it after the answer): a client mistake, not a crash."""
        exc = kwargs.get("exc_info")
        if isinstance(exc, web.RequestPayloadError | PayloadEncodingError):
            log.info("request_body_undecodable", error=type(exc).__name__)
            return
        super().log_exception(*args, **kwargs)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """The answer to a request the parser refused, or that failed past every middleware."""
        if request.writer.output_size > 0:
            raise ConnectionError("the response has started; cannot send an error as well")
        error: RollgateError
        if status == 500:
            log.error("unhandled_error", path=request.path, exc_info=exc)
            error = InternalError("internal error; see the gateway logs")
        elif status == 504:
            error = UpstreamTimeout("the request timed out in the gateway", code="gateway_timeout")
        else:
            error = parser_error(
                exc,
                max_header_bytes=self._limits.max_header_bytes,
                max_headers=self._limits.max_headers,
            )
            log.info("request_unparseable", status=error.http_status, code=error.code)
            self._on_refused(UNPARSED_METHOD, error.http_status)
        response = self._shapes.reshape(request, error_response(error))
        if isinstance(error, MethodNotAllowed):
            response.headers["Allow"] = _METHODS_SERVED
        # Said explicitly: the answer goes out as HTTP/1.0 (the request was never parsed).
        response.headers["Connection"] = "close"
        response.force_close()
        return response


def _raw_error_response(error: RollgateError) -> bytes:
    """A whole HTTP/1.1 error response as bytes (no request exists to answer through)."""
    body = orjson.dumps(error.to_json())
    reason = {408: "Request Timeout"}.get(error.http_status, "Error")
    head = (
        f"HTTP/1.1 {error.http_status} {reason}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


class GatewayHttpServer(web.Server):
    """aiohttp's low-level server, making GatewayRequestHandler connections."""

    def __init__(
        self,
        handler: _AppHandler,
        *,
        limits: EdgeLimits,
        on_refused: RefusalHook = _not_counted,
        shapes: ErrorShapes = OPENAI_ONLY,
        **kwargs: Any,
    ) -> None:
        super().__init__(handler, **kwargs)
        self._limits = limits
        self._on_refused = on_refused
        self._shapes = shapes
        # What RequestHandler takes (Server keeps the rest itself).
        self._handler_kwargs = {
            k: v
            for k, v in kwargs.items()
            if k not in ("request_factory", "handler_cancellation", "loop")
        }

    def __call__(self) -> GatewayRequestHandler:
        return GatewayRequestHandler(
            self,
            loop=asyncio.get_running_loop(),
            limits=self._limits,
            on_refused=self._on_refused,
            shapes=self._shapes,
            **self._handler_kwargs,
        )


class GatewayRunner(web.AppRunner):
    """AppRunner serving through GatewayHttpServer (the app's startup and cleanup unchanged)."""

    def __init__(
        self,
        app: web.Application,
        *,
        limits: EdgeLimits,
        on_refused: RefusalHook = _not_counted,
        shapes: ErrorShapes = OPENAI_ONLY,
    ) -> None:
        super().__init__(app, access_log=None)
        self._limits = limits
        self._on_refused = on_refused
        self._shapes = shapes

    async def _make_server(self) -> web.Server:
        # The app's own server runs its startup and freezes it; ours takes its handler and
        # request factory (public attributes) and adds the edge around them.
        base = await super()._make_server()
        return GatewayHttpServer(
            edge_handler(base.request_handler, self._on_refused, self._shapes),
            limits=self._limits,
            on_refused=self._on_refused,
            shapes=self._shapes,
            request_factory=base.request_factory,
            # A client that disconnects cancels its handler, and so its RPC.
            handler_cancellation=True,
            access_log=None,
        )
