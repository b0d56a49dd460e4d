"""The HTTP client of the upstream LLM: the request it gets, the session, and its failures."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import yarl
from multidict import CIMultiDictProxy

from services.runtime import tracing
from services.runtime.errors import (
    InvalidRequest,
    RollgateError,
    TooManyRequests,
    Unavailable,
    UpstreamError,
    UpstreamTimeout,
)
from services.runtime.logs import get_logger
from services.runtime.secret import Secret, mask_addresses, scrub
from services.worker.http1 import ConnectError, Http1Pool, Http1Response, HttpError
from services.worker.turn import ClientAsk

log = get_logger(__name__)

# Fields only rollgate or OpenAI's own service understands, and anything that could redirect or
# re-authenticate the upstream call. `metadata` only goes with OpenAI's `store`.
DENYLIST = frozenset(
    {
        "store",
        "session_id",
        "turn_type",
        "session_done",
        "api_base",
        "base_url",
        "api_key",
        "extra_headers",
        "extra_query",
        "extra_body",
        "metadata",
        "prompt_cache_key",
    }
)

DONE = b"[DONE]"
# How much of an error body is read to find its message.
_ERROR_BODY_LIMIT = 64 * 1024
_JSON = {"Content-Type": "application/json"}


@dataclass(slots=True, kw_only=True)  # not frozen: built every turn (half the cost)
class ClientRequest:
    """A chat-completions request as the worker gets it: the recorded part as JSON bytes it
    forwards without parsing, and every other field of the body, parsed."""

    # {"tools"?, "messages"} (the gateway serialized it; what the dataproxy records).
    request_json: bytes
    params: dict[str, Any]


@dataclass(slots=True, kw_only=True)  # not frozen: built every turn (half the cost)
class UpstreamRequest:
    """The body the upstream gets, and what the client asked to see."""

    body: bytes
    # {"tools"?, "messages"} as forwarded.
    request_json: bytes
    ask: ClientAsk
    model: str

    def conversation(self) -> tuple[list[Any], list[Any] | None]:
        """The forwarded messages and tools, parsed (only for templates that re-render the
        prompt: the hot path never parses them)."""
        return _conversation(self.request_json)


def _conversation(request_json: bytes) -> tuple[list[Any], list[Any] | None]:
    recorded = orjson.loads(request_json)
    tools = recorded.get("tools")
    return list(recorded.get("messages") or []), tools if isinstance(tools, list) else None


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestPolicy:
    """What the server's configuration adds to every request: aliases, defaults, group size."""

    # alias → served model id.
    aliases: Mapping[str, str] = field(default_factory=dict)
    default_max_tokens: int | None = None
    default_temperature: float | None = None
    # G > 1: ask the upstream for G samples (`n`); the client sees sample 0 only.
    n_samples: int = 1


def _apply_policy(body: dict[str, Any], policy: RequestPolicy) -> None:
    model = body.get("model")
    if isinstance(model, str) and model in policy.aliases:
        body["model"] = policy.aliases[model]
    if (
        policy.default_max_tokens is not None
        and body.get("max_tokens") is None
        and body.get("max_completion_tokens") is None
    ):
        body["max_tokens"] = policy.default_max_tokens
    if policy.default_temperature is not None and body.get("temperature") is None:
        body["temperature"] = policy.default_temperature
    if policy.n_samples > 1:
        body["n"] = policy.n_samples


def parse_client_body(body_json: bytes) -> dict[str, Any]:
    """The client's chat-completions body, parsed once; InvalidRequest when it is not one."""
    try:
        body = orjson.loads(body_json)
    except orjson.JSONDecodeError as err:
        raise InvalidRequest(f"the request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    if not isinstance(body.get("messages"), list):
        raise InvalidRequest("the request body needs a 'messages' list")
    return body


# The fields of a body that make up its recorded part (ClientRequest.request_json).
RECORDED_FIELDS = ("tools", "messages")


def recorded_json(body: dict[str, Any]) -> bytes:
    """{"tools"?, "messages"} of a parsed body, tools first: the next turn's request then
    extends this one's bytes (the dataproxy stores an open episode's shared prefix once)."""
    recorded: dict[str, Any] = {"tools": body["tools"]} if "tools" in body else {}
    recorded["messages"] = body["messages"]
    return orjson.dumps(recorded)


def client_request(*, body_json: bytes, request_json: bytes, params_json: bytes) -> ClientRequest:
    """The request from a whole body (parsed here), or from what the gateway already parsed
    out of it (the recorded part as is, the other fields parsed)."""
    if not request_json:
        body = parse_client_body(body_json)
        params = {k: v for k, v in body.items() if k not in RECORDED_FIELDS}
        return ClientRequest(request_json=recorded_json(body), params=params)
    try:
        params = orjson.loads(params_json or b"{}")
    except orjson.JSONDecodeError as err:
        raise InvalidRequest(f"the request parameters are not valid JSON: {err}") from None
    if not isinstance(params, dict):
        raise InvalidRequest("the request parameters must be a JSON object")
    for name in RECORDED_FIELDS:
        params.pop(name, None)
    return ClientRequest(request_json=request_json, params=params)


def chat_body(params: dict[str, Any], request_json: bytes) -> bytes:
    """The upstream chat body: the recorded part's bytes with the parameters spliced in (no
    re-serialization of the messages; `params` never holds tools or messages)."""
    rest = orjson.dumps(params)
    if rest == b"{}":
        return request_json
    return request_json[:-1] + b"," + rest[1:]


def build_upstream_request(
    client: ClientRequest,
    *,
    stream: bool,
    prepare: Callable[[dict[str, Any]], None],
    policy: RequestPolicy | None = None,
    encode: Callable[[dict[str, Any], bytes], bytes] = chat_body,
) -> UpstreamRequest:
    """Strips the denylist, forces logprobs (and usage when streaming); `prepare` adds the rest.

    `policy` rewrites an alias to its served id and fills in default sampling parameters the
    client left out; `encode` turns the parameters and the recorded part into the upstream's
    bytes (its own format).
    """
    policy = policy or RequestPolicy()
    body = dict(client.params)
    ask = ClientAsk.of(body)
    if policy.n_samples > 1:
        ask = dataclasses.replace(ask, only_choice_zero=True)
    for name in DENYLIST & body.keys():
        del body[name]
    _apply_policy(body, policy)
    body["logprobs"] = True
    if not ask.logprobs:
        body.pop("top_logprobs", None)
    body["stream"] = stream
    if stream:
        body["stream_options"] = {"include_usage": True}
    else:
        body.pop("stream_options", None)
    prepare(body)
    model = body.get("model")
    return UpstreamRequest(
        body=encode(body, client.request_json),
        request_json=client.request_json,
        ask=ask,
        model=model if isinstance(model, str) else "",
    )


class SseParser:
    """Splits an SSE byte stream into `data:` payloads, across arbitrary read boundaries.

    A read without a line end is only kept (no copy, no scan of what came before: an event of
    a prompt's ids is 70 KB and can come in several reads); the pieces of a line are joined
    once, when its end comes, and a payload is copied out of its line once."""

    def __init__(self) -> None:
        self._partial: list[bytes] = []  # the unfinished line's pieces
        self._data: list[bytes] = []

    def feed(self, data: bytes) -> list[bytes]:
        """The payloads of every event completed by `data`."""
        partial = self._partial
        if data.rfind(b"\n") < 0:  # from the end: at once for a read that ends an event
            if data:
                partial.append(data)
            return []
        if partial:
            partial.append(data)
            data = b"".join(partial)
            partial.clear()
        lines = data.split(b"\n")
        rest = lines.pop()
        if rest:
            partial.append(rest)
        events: list[bytes] = []
        for raw in lines:
            line = raw.removesuffix(b"\r")
            if not line:
                if self._data:
                    events.append(b"\n".join(self._data))
                    self._data = []
            elif line.startswith(b"data: "):
                self._data.append(line[6:])
            elif line.startswith(b"data:"):
                self._data.append(line[5:])
        return events

    def close(self) -> list[bytes]:
        """The payload of a last event that had no blank line after it."""
        pending = b"".join(self._partial)
        if pending.startswith(b"data:"):
            self._data.append(pending[5:].strip())
        self._partial = []
        events = [b"\n".join(self._data)] if self._data else []
        self._data = []
        return events


# How much of an upstream's own error text a client is told.
UPSTREAM_TEXT_CHARS = 500


def upstream_text(text: str) -> str:
    """An upstream's own words (its error message), fit to pass on to a client: bounded, and
    without secrets or internal addresses (a proxy's or engine's error text can name the URL
    it called, an IP, a key). The worker's log keeps the text as it came."""
    return mask_addresses(scrub(text[: UPSTREAM_TEXT_CHARS * 2].strip()))[:UPSTREAM_TEXT_CHARS]


def _error_text(body: bytes) -> str:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode(errors="replace")
    if isinstance(parsed, dict):
        error = parsed.get("error", parsed)
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if isinstance(parsed.get("detail"), str):
            return str(parsed["detail"])
    return body.decode(errors="replace")


def _retry_after_s(headers: CIMultiDictProxy[str]) -> float | None:
    raw = headers.get("Retry-After", "")
    try:
        return max(0.0, float(raw))
    except ValueError:
        return None


def error_for_status(
    status: int,
    body: bytes,
    headers: CIMultiDictProxy[str],
    *,
    url: str,
    key_var: str = "ROLLGATE_UPSTREAM_API_KEY",
) -> RollgateError:
    """The rollgate error for an upstream HTTP error answer (never echoing the key)."""
    raw = _error_text(body)
    message = upstream_text(raw)
    if status not in (401, 403):
        # The upstream's words as they came (URLs, addresses) are the operator's to read.
        log.warning("upstream_error_answer", status=status, url=url, message=raw[:2000])
    if status in (401, 403):
        return UpstreamError(
            f"the upstream rejected the server's API key (check {key_var})",
            code="upstream_auth_failed",
        )
    if status == 404:
        # The URL is the operator's to see (the worker's log), not the client's.
        log.warning("upstream_not_found", url=url, message=raw[:2000])
        return UpstreamError(
            f"the upstream answered 404 ({message}): either the model id is not served there "
            "(compare it with the upstream's GET …/models) or the worker's base URL is wrong: "
            "the worker's log names the URL called; compare it with the base URL the provider "
            "documents (a bare host gets /v1 appended; a base URL with a path is used exactly as given)",
            code="upstream_not_found",
        )
    if status == 429:
        return TooManyRequests(
            f"the upstream is rate limiting: {message}",
            code="upstream_rate_limited",
            retry_after_s=_retry_after_s(headers),
        )
    if 400 <= status < 500:
        return InvalidRequest(f"the upstream refused the request: {message}")
    return UpstreamError(f"the upstream failed with HTTP {status}: {message}")


# What post_chat yields: either client's answer (the same calls on both).
Response = aiohttp.ClientResponse | Http1Response
# What a failed read raises, from either client.
_READ_ERRORS = (aiohttp.ClientError, HttpError)


class UpstreamClient:
    """The upstream's HTTP clients, opened and closed by `async with`: chat calls to an
    `http://` upstream on rollgate's lean HTTP/1.1 client (services/worker/http1.py), the rest
    (and an `https://` upstream) on one aiohttp session."""

    def __init__(
        self,
        *,
        base_url: str,
        api_key: Secret,
        key_var: str = "ROLLGATE_UPSTREAM_API_KEY",
        connect_timeout_s: float = 10.0,
    ) -> None:
        self.base_url = base_url
        self.chat_url = base_url + "/chat/completions"
        # The server root (without /v1): SGLang's native endpoints live there.
        self.root_url = base_url.removesuffix("/v1")
        self.key_var = key_var
        self._api_key = api_key
        self._connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None
        # Chat calls to an http:// upstream, and the URL prefix they are made under.
        self._http1: Http1Pool | None = None
        self._origin = ""

    async def __aenter__(self) -> UpstreamClient:
        headers = {"Authorization": f"Bearer {self._api_key.reveal()}"} if self._api_key else {}
        self._session = aiohttp.ClientSession(
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=None, connect=self._connect_timeout_s),
            connector=aiohttp.TCPConnector(limit=1024),
            raise_for_status=False,
        )
        url = yarl.URL(self.base_url)
        # Credentials in the URL (basic auth) stay aiohttp's to send.
        if url.scheme == "http" and url.raw_host and url.port and not url.user:
            self._origin = str(url.origin())
            self._http1 = Http1Pool(
                url.raw_host,
                url.port,
                connect_timeout_s=self._connect_timeout_s,
                headers={**headers, **_JSON},
            )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._http1 is not None:
            await self._http1.close()
            self._http1 = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The open session."""
        if self._session is None:
            raise RuntimeError("UpstreamClient is not open: use `async with`")
        return self._session

    async def list_models(self, *, timeout_s: float) -> list[str]:
        """The model ids of GET <base>/models."""
        async with asyncio.timeout(timeout_s), self.session.get(self.base_url + "/models") as resp:
            body = await resp.read()
            if resp.status != 200:
                raise error_for_status(
                    resp.status,
                    body,
                    resp.headers,
                    url=self.base_url + "/models",
                    key_var=self.key_var,
                )
        data = orjson.loads(body).get("data") or []
        return [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]

    @contextlib.asynccontextmanager
    async def post_chat(
        self, body: bytes, *, deadline: float, url: str | None = None
    ) -> AsyncIterator[Response]:
        """POSTs to /chat/completions (or `url`); yields a 200 response, closed on exit."""
        url = url or self.chat_url
        response: Response
        try:
            # The turn's traceparent goes on: an engine that traces (vLLM with
            # --otlp-traces-endpoint) joins the client's trace.
            if self._http1 is not None and url.startswith(self._origin + "/"):
                # Its own timer keeps the deadline, for the head and the body.
                response = await self._http1.request(
                    "POST",
                    url[len(self._origin) :],
                    body,
                    tracing.http_headers(),
                    deadline=deadline,
                )
            else:
                async with asyncio.timeout_at(deadline):
                    response = await self.session.post(
                        url, data=body, headers={**_JSON, **tracing.http_headers()}
                    )
        except TimeoutError:
            log.warning("upstream_timeout", url=url)
            raise UpstreamTimeout("the upstream did not answer in time") from None
        except (aiohttp.ClientConnectorError, ConnectError) as err:
            # Addresses and OS errors go to the worker's log; the client hears the cause.
            log.warning("upstream_unreachable", url=url, error=str(err.os_error))
            refused = isinstance(err.os_error, ConnectionRefusedError)
            raise Unavailable(
                "the upstream refused the connection; retry shortly"
                if refused
                else "the upstream could not be reached; retry shortly",
                code="upstream_unavailable",
                retry_after_s=1.0,
            ) from None
        except _READ_ERRORS as err:
            log.warning("upstream_call_failed", url=url, error=type(err).__name__, detail=str(err))
            raise UpstreamError("the upstream call failed; see the worker's log") from None
        try:
            if response.status != 200:
                error_body = await self._read_error_body(response, deadline=deadline)
                raise error_for_status(
                    response.status, error_body, response.headers, url=url, key_var=self.key_var
                )
            yield response
        finally:
            # Closing (not releasing) drops the connection, which stops the generation upstream
            # when the turn ends early (cancelled, failed mid-stream).
            if not response.content.at_eof():
                response.close()
            response.release()

    async def _read_error_body(self, response: Response, *, deadline: float) -> bytes:
        try:
            async with asyncio.timeout_at(deadline):
                return await response.content.read(_ERROR_BODY_LIMIT)
        except (TimeoutError, *_READ_ERRORS):
            return b""

    async def read_body(self, response: Response, *, deadline: float) -> bytes:
        """The whole body of a non-streaming answer."""
        with _mid_response_errors():
            if isinstance(response, Http1Response):
                return await response.read()  # the request's timer keeps its deadline
            async with asyncio.timeout_at(deadline):
                body: bytes = await response.read()
                return body

    async def read_events(
        self, response: Response, *, deadline: float
    ) -> AsyncIterator[list[bytes]]:
        """SSE payloads in batches: each batch is what had arrived when it was read.

        One timer for the whole answer (not one per read: a long answer is hundreds of
        reads): at the deadline it closes the response, which ends the pending read, and the
        stream fails as timed out. An http1 response has that timer already (its request's)."""
        parser = SseParser()
        content = response.content
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            response.close()

        timer = (
            None
            if isinstance(response, Http1Response)
            else asyncio.get_running_loop().call_at(deadline, expire)
        )
        try:
            while True:
                try:
                    data = await content.readany()
                except TimeoutError:  # http1's own timer for the request's deadline
                    raise _timed_out() from None
                except _READ_ERRORS as err:
                    if expired:
                        raise _timed_out() from None
                    raise _broken_off(err) from None
                if expired:
                    raise _timed_out()
                if not data:
                    tail = parser.close()
                    if tail:
                        yield tail
                    return
                events = parser.feed(data)
                if events:
                    yield events
        finally:
            if timer is not None:
                timer.cancel()


def body_failure(err: HttpError) -> RollgateError:
    """What a streamed answer's body failing on the HTTP/1.1 client means for the turn: its
    deadline passed (the request's timer), or the answer broke off."""
    if isinstance(err, TimeoutError):
        return _timed_out()
    return _broken_off(err)


def _timed_out() -> UpstreamTimeout:
    return UpstreamTimeout("the upstream did not finish its answer in time")


def _broken_off(err: Exception) -> UpstreamError:
    log.warning("upstream_broken_stream", error=type(err).__name__, detail=str(err))
    return UpstreamError(
        "the upstream broke off its answer mid-response", code="upstream_broken_stream"
    )


@contextlib.contextmanager
def _mid_response_errors() -> Iterator[None]:
    try:
        yield
    except TimeoutError:
        raise _timed_out() from None
    except _READ_ERRORS as err:
        raise _broken_off(err) from None
