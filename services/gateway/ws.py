"""`GET /ws`: the OpenClaw gateway WebSocket protocol (reference/openclaw_wire/).

The token in `connect.params.auth.token` is the rollgate session key. There is no agent
behind the gateway: `chat.send` and `agent` runs are single upstream calls over the
conversation's stored history (see ws_runs.py); an OpenClaw `sessionKey` names a conversation
under the connection's key.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import AsyncIterator
from typing import Any

import grpc
import orjson
from aiohttp import WebSocketError, WSCloseCode, WSMsgType, web

from protos import dataproxy_pb2, router_pb2, worker_pb2, worker_pb2_grpc
from services.gateway.backends import BACKENDS, SETTINGS
from services.gateway.http_errors import json_response
from services.gateway.responses_store import CONVERSATIONS, conversations_ctx
from services.gateway.settings import GatewaySettings
from services.gateway.ws_protocol import (
    AGENT_TIMEOUT,
    CLOSE_POLICY,
    CLOSE_PROTOCOL,
    INVALID_REQUEST,
    TOKEN_MISMATCH_DETAILS,
    TOKEN_MISMATCH_MESSAGE,
    FrameError,
    Request,
    WsConfig,
    error,
    error_for,
    event,
    hello_ok,
    list_answer,
    negotiate,
    new_id,
    now_ms,
    ok,
    parse_request,
    session_key,
)
from services.gateway.ws_runs import QUEUE_MODES, Message, RunResult, Runs
from services.runtime.errors import (
    InvalidRequest,
    RollgateError,
    Unauthenticated,
    Unavailable,
    check_identifier,
    from_rpc_error,
)
from services.runtime.keys import key_digest, looks_like_session_key
from services.runtime.logs import get_logger
from stackconfig import DEFAULT_MODEL_ALIAS

log = get_logger(__name__)

# The dataproxy's code for a key revoked by the admin (services/dataproxy/revocation.py).
KEY_REVOKED_CODE = "key_revoked"
# Methods whose own dataproxy call refuses an unknown or revoked key.
KEY_CHECKED_METHODS = frozenset({"chat.send", "agent", "chat.history", "sessions.reset"})

WS_CONFIG = web.AppKey("ws_config", WsConfig)
WS_RUNS = web.AppKey("ws_runs", Runs)


class OpenSockets:
    """The open sockets of the app, closed on shutdown."""

    def __init__(self) -> None:
        self.sockets: weakref.WeakSet[web.WebSocketResponse] = weakref.WeakSet()


WS_CONNECTIONS = web.AppKey("ws_connections", OpenSockets)

UPGRADE_HINT = (
    "this is rollgate's OpenClaw gateway WebSocket endpoint: connect with ws://<host>:<port>/ws "
    "(wss:// behind TLS), not http://; send the sk-sess-… session key as the gateway token"
)
BETWEEN_EPISODES = (
    "no active episode on this key: the last one ended or is being refreshed; retry after "
    "/rl/start_session with this key starts the next one"
)
MODEL_CACHE_S = 30.0
_LINGER_POLL_S = 0.02


class ModelPicker:
    """The model runs use: the configured one, else `default`, else the first one served."""

    def __init__(self, app: web.Application, config: WsConfig) -> None:
        self._app = app
        self._config = config
        self._cached: tuple[float, str] | None = None

    async def __call__(self) -> str:
        if self._config.model:
            return str(self._config.model)
        if self._cached is not None and self._cached[0] > time.monotonic():
            return self._cached[1]
        try:
            listed = await self._app[BACKENDS].router.ListWorkers(
                router_pb2.ListWorkersRequest(), timeout=self._app[SETTINGS].rpc_timeout_s
            )
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, hop="router") from None
        models = sorted({m for w in listed.workers if w.live for m in w.models})
        if not models:
            raise Unavailable("no live worker serves a model yet", retry_after_s=1.0)
        # `default` is the configured default model (a worker's alias), when one serves it.
        model = DEFAULT_MODEL_ALIAS if DEFAULT_MODEL_ALIAS in models else str(models[0])
        self._cached = (time.monotonic() + MODEL_CACHE_S, model)
        return model


class TurnAborter:
    """Stops a run's upstream generation: `Worker.Abort` on the worker streaming it, which
    ends the stream normally, so the partial turn is recorded like any other."""

    def __init__(self, app: web.Application) -> None:
        self._app = app

    async def __call__(self, digest: str, worker_address: str, request_id: str) -> bool:
        stub = worker_pb2_grpc.WorkerStub(self._app[BACKENDS].workers.get(worker_address))
        try:
            answer = await stub.Abort(
                worker_pb2.AbortRequest(request_id=request_id),
                timeout=self._app[SETTINGS].rpc_timeout_s,
            )
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, hop="worker") from None
        log.info("turn_abort_forwarded", request_id=request_id, found=answer.found)
        return bool(answer.found)


def config_from(settings: GatewaySettings) -> WsConfig:
    """The bridge's configuration from the gateway settings (`ROLLGATE_WS_*`)."""
    return WsConfig(
        model=settings.ws_model,
        system_prompt=settings.ws_system_prompt,
        tick_interval_ms=settings.ws_tick_interval_ms,
        max_payload_bytes=settings.ws_max_payload_bytes,
        max_buffered_bytes=settings.ws_max_buffered_bytes,
        run_timeout_s=settings.ws_run_timeout_s,
    )


def mount(app: web.Application, config: WsConfig | None = None) -> None:
    """Adds `GET /ws`, the run registry and the shutdown of open sockets to `app`."""
    app[WS_CONFIG] = config or WsConfig()
    app[WS_CONNECTIONS] = OpenSockets()
    if conversations_ctx not in app.cleanup_ctx:
        app.cleanup_ctx.append(conversations_ctx)
    app.cleanup_ctx.append(_runs_ctx)
    app.on_shutdown.append(_close_sockets)
    app.router.add_get("/ws", websocket, allow_head=False)


async def _runs_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[WS_CONFIG]
    runs = Runs(
        store=app[CONVERSATIONS],
        config=config,
        pick_model=ModelPicker(app, config),
        abort_turn=TurnAborter(app),
    )
    app[WS_RUNS] = runs
    yield
    await runs.close()


async def _close_sockets(app: web.Application) -> None:
    for ws in list(app[WS_CONNECTIONS].sockets):
        with contextlib.suppress(ConnectionError, RuntimeError):
            await ws.send_str(event("shutdown", {"reason": "gateway stopping"}))
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"gateway stopping")


def _oversized(ws: web.WebSocketResponse) -> bool:
    exc = ws.exception()
    return isinstance(exc, WebSocketError) and exc.code == WSCloseCode.MESSAGE_TOO_BIG


class _Socket(web.WebSocketResponse):
    """aiohttp's socket, except that after a frame over `max_msg_size` (close 1009 sent) it
    leaves the transport open: closing it with the frame's rest unread would reset the
    connection, and the client would see 1006 instead of the close frame."""

    def _close_transport(self) -> None:
        if not _oversized(self):
            super()._close_transport()


async def _linger(request: web.Request, ws: web.WebSocketResponse, limit_s: float) -> None:
    """After close 1009: the rest of the oversized frame is read and dropped until the client
    closes (at most `limit_s`), then the transport is closed."""
    if not _oversized(ws):
        return
    log.info("ws_frame_too_large", message=str(ws.exception()))
    deadline = time.monotonic() + limit_s
    # aiohttp's connection drops every byte after the parser's error; wait for the client to
    # hang up. aiohttp offers no event for a lost connection, hence the poll.
    while request.transport is not None and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(_LINGER_POLL_S)
    if request.transport is not None:
        request.transport.close()


async def websocket(request: web.Request) -> web.StreamResponse:
    """GET /ws: the upgrade, or 426 with the hint for a plain HTTP client."""
    config = request.app[WS_CONFIG]
    ws = _Socket(max_msg_size=config.max_payload_bytes, autoping=True)
    if not ws.can_prepare(request).ok:
        body = {
            "error": {
                "message": UPGRADE_HINT,
                "type": "invalid_request_error",
                "code": "upgrade_required",
            }
        }
        response = json_response(body, status=426)
        response.headers["Upgrade"] = "websocket"
        response.headers["Connection"] = "Upgrade"
        return response
    await ws.prepare(request)
    request.app[WS_CONNECTIONS].sockets.add(ws)
    connection = Connection(request, ws, config)
    try:
        await connection.serve()
    finally:
        await connection.stop()
    await _linger(request, ws, config.oversize_linger_s)
    return ws


class Connection:
    """One client connection: handshake, ticks, and its requests."""

    def __init__(self, request: web.Request, ws: web.WebSocketResponse, config: WsConfig) -> None:
        self.request = request
        self.ws = ws
        self.config = config
        self.conn_id = new_id()
        self.digest = ""
        self.seq = 0
        self.sessions: list[str] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._send_lock = asyncio.Lock()

    @property
    def runs(self) -> Runs:
        """The process's runs."""
        return self.request.app[WS_RUNS]

    async def _send(self, text: str) -> None:
        async with self._send_lock:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.ws.send_str(text)

    async def emit(self, name: str, payload: dict[str, Any]) -> None:
        """An event frame with the connection's next `seq`."""
        self.seq += 1
        await self._send(event(name, payload, seq=self.seq))

    async def serve(self) -> None:
        """Handshake, then requests until the client leaves."""
        nonce = new_id()
        await self._send(event("connect.challenge", {"nonce": nonce, "ts": now_ms()}))
        if not await self._handshake():
            return
        self._spawn(self._tick())
        async for msg in self.ws:
            if msg.type == WSMsgType.TEXT:
                await self._on_text(msg.data)
            elif msg.type == WSMsgType.BINARY:
                await self._send(error("", INVALID_REQUEST, "binary frames are not supported"))
            else:
                break

    async def stop(self) -> None:
        """Cancels the connection's own tasks (runs it queued keep going)."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_interval_ms / 1000)
            await self.emit("tick", {"ts": now_ms()})

    async def _close(self, code: int, reason: str) -> bool:
        await self.ws.close(code=code, message=reason.encode()[:120])
        return False

    async def _handshake(self) -> bool:
        try:
            msg = await self.ws.receive(timeout=self.config.handshake_timeout_s)
        except TimeoutError:
            return await self._close(CLOSE_POLICY, "connect timeout")
        if msg.type != WSMsgType.TEXT:
            return await self._close(CLOSE_POLICY, "invalid handshake: expected a connect request")
        if len(msg.data) > self.config.preconnect_max_bytes:
            return await self._close(WSCloseCode.MESSAGE_TOO_BIG, "handshake frame too large")
        try:
            req = parse_request(msg.data)
        except FrameError as err:
            if err.frame_id:
                await self._send(error(err.frame_id, INVALID_REQUEST, err.message))
            return await self._close(CLOSE_POLICY, f"invalid handshake: {err.message}")
        if req.method != "connect":
            message = f"invalid handshake: the first request must be connect, not {req.method}"
            await self._send(error(req.id, INVALID_REQUEST, message))
            return await self._close(CLOSE_POLICY, "invalid handshake: first request not connect")
        protocol = negotiate(req.params)
        if protocol is None:
            details = {"expectedProtocol": 4, "supportedProtocols": [3, 4]}
            await self._send(error(req.id, INVALID_REQUEST, "protocol mismatch", details=details))
            return await self._close(CLOSE_PROTOCOL, "protocol mismatch")
        try:
            self.digest = await self._authenticate(req.params)
        except Unauthenticated as err:
            if err.code == KEY_REVOKED_CODE:
                await self._send(error_for(req.id, err))
                return await self._close(CLOSE_POLICY, "key revoked")
            await self._send(
                error(
                    req.id, INVALID_REQUEST, TOKEN_MISMATCH_MESSAGE, details=TOKEN_MISMATCH_DETAILS
                )
            )
            return await self._close(CLOSE_POLICY, "")
        except RollgateError as err:
            await self._send(error_for(req.id, err))
            return await self._close(WSCloseCode.TRY_AGAIN_LATER, "try again later")
        payload = hello_ok(
            protocol=protocol,
            conn_id=self.conn_id,
            params=req.params,
            config=self.config,
            started_ms=now_ms(),
        )
        await self._send(ok(req.id, payload))
        log.info("ws_connected", conn_id=self.conn_id, protocol=protocol)
        return True

    async def _authenticate(self, params: dict[str, Any]) -> str:
        auth = params.get("auth")
        token = auth.get("token") if isinstance(auth, dict) else None
        if not isinstance(token, str) or not looks_like_session_key(token):
            raise Unauthenticated("not a session key")
        digest = key_digest(token)
        await self._resolve(digest)
        return digest

    async def _resolve(self, digest: str) -> str:
        """The key's current session id ("" between episodes); Unauthenticated when unknown."""
        try:
            resolved = await self.request.app[BACKENDS].dataproxy.ResolveKey(
                dataproxy_pb2.ResolveKeyRequest(key_digest=digest),
                timeout=self.request.app[SETTINGS].rpc_timeout_s,
            )
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, hop="dataproxy") from None
        return str(resolved.session_id)

    async def _on_text(self, text: str) -> None:
        try:
            req = parse_request(text)
        except FrameError as err:
            await self._send(error(err.frame_id, INVALID_REQUEST, err.message))
            return
        try:
            await self._dispatch(req)
        except RollgateError as err:
            await self._send(error_for(req.id, err))
            if err.code == KEY_REVOKED_CODE:
                # The key was revoked while connected: nothing on this socket works any more.
                await self._close(CLOSE_POLICY, "key revoked")

    async def _dispatch(self, req: Request) -> None:
        handlers = {
            "chat.send": self._chat_send,
            "agent": self._agent,
            "agent.wait": self._agent_wait,
            "chat.history": self._chat_history,
            "chat.abort": self._chat_abort,
            "sessions.reset": self._sessions_reset,
            "sessions.list": self._sessions_list,
        }
        handler = handlers.get(req.method)
        if req.method not in KEY_CHECKED_METHODS:
            # These answer without asking the dataproxy: check the key is still valid (a key
            # revoked while connected is refused on every method, not only on runs).
            await self._resolve(self.digest)
        if handler is not None:
            await handler(req)
            return
        if req.method == "connect":
            await self._send(error(req.id, INVALID_REQUEST, "already connected"))
            return
        try:
            answer = list_answer(req.method, req.params, model=self.config.model)
        except KeyError:
            await self._send(error(req.id, INVALID_REQUEST, f"unknown method: {req.method}"))
            return
        await self._send(ok(req.id, answer))

    def _remember(self, conversation: str) -> None:
        if conversation not in self.sessions:
            self.sessions.append(conversation)

    async def _require_episode(self) -> None:
        if not await self._resolve(self.digest):
            raise Unavailable(BETWEEN_EPISODES, code="episode_not_active", retry_after_s=1.0)

    def _message(self, req: Request, run_id: str, text: str, agent_id: str) -> Message:
        mode = req.params.get("queueMode")
        return Message(
            run_id=run_id,
            text=text,
            mode=mode if mode in QUEUE_MODES else "collect",
            sink=self,
            done=asyncio.get_running_loop().create_future(),
            request=self.request,
            agent_id=agent_id,
        )

    async def _chat_send(self, req: Request) -> None:
        conversation = session_key(_required_str(req.params, "sessionKey"))
        text = _required_str(req.params, "message")
        run_id = _required_id(req.params, "idempotencyKey")
        self._remember(conversation)
        if text.strip() == "/stop":
            aborted = await self.runs.abort(self.digest, conversation)
            await self._send(ok(req.id, {"ok": True, "aborted": bool(aborted), "runIds": aborted}))
            return
        known = self.runs.known_run(self.digest, run_id)
        if known is not None:
            status = "in_flight" if not known.done() else "ok"
            await self._send(ok(req.id, {"runId": run_id, "status": status}))
            return
        await self._require_episode()
        first = await self.runs.claim(self.digest, conversation, run_id)
        if first:
            # Another replica (or a concurrent request here) started the run first.
            known = self.runs.known_run(self.digest, first)
            status = "ok" if known is not None and known.done() else "in_flight"
            await self._send(ok(req.id, {"runId": first, "status": status}))
            return
        message = self._message(req, run_id, text, "main")
        await self._send(ok(req.id, {"runId": run_id, "status": "started"}))
        self.runs.submit(self.digest, conversation, message)

    async def _agent(self, req: Request) -> None:
        text = _required_str(req.params, "message")
        run_id = _required_id(req.params, "idempotencyKey")
        agent_id = str(req.params.get("agentId") or "main")
        conversation = session_key(req.params.get("sessionKey"), agent_id=agent_id)
        self._remember(conversation)
        timeout = req.params.get("timeout")
        timeout_s = float(timeout) if isinstance(timeout, (int, float)) and timeout > 0 else 600.0
        done = self.runs.known_run(self.digest, run_id)
        if done is None:
            await self._require_episode()
            first = await self.runs.claim(self.digest, conversation, run_id)
            done = self.runs.known_run(self.digest, first) if first else None
            if first and done is None:
                # The first run lives on another replica: its result cannot be awaited here.
                await self._send(ok(req.id, {"runId": first, "status": "in_flight"}))
                return
        if done is None:
            message = self._message(req, run_id, text, agent_id)
            done = message.done
            self.runs.submit(self.digest, conversation, message)
        accepted = {
            "runId": run_id,
            "sessionKey": conversation,
            "agentId": agent_id,
            "status": "accepted",
            "acceptedAt": now_ms(),
        }
        await self._send(ok(req.id, accepted))
        self._spawn(self._agent_result(req.id, run_id, conversation, done, timeout_s))

    async def _agent_result(
        self,
        frame_id: str,
        run_id: str,
        conversation: str,
        done: asyncio.Future[RunResult],
        timeout_s: float,
    ) -> None:
        started = time.monotonic()
        try:
            result = await asyncio.wait_for(asyncio.shield(done), timeout_s)
        except TimeoutError:
            await self._send(error(frame_id, AGENT_TIMEOUT, f"run {run_id} timed out"))
            return
        if result.status == "error" and result.error is not None:
            await self._send(error_for(frame_id, result.error))
            return
        payload = {
            "runId": run_id,
            "status": "ok" if result.status == "ok" else result.status,
            "summary": "completed" if result.status == "ok" else result.status,
            "result": {
                "payloads": [{"text": result.text, "mediaUrl": None}],
                "meta": {
                    "durationMs": int((time.monotonic() - started) * 1000),
                    "stopReason": result.stop_reason,
                    "agentMeta": {"sessionKey": conversation, "provider": "rollgate"},
                    "interactionId": result.interaction_id,
                },
            },
        }
        await self._send(ok(frame_id, payload))

    async def _agent_wait(self, req: Request) -> None:
        run_id = _required_id(req.params, "runId")
        timeout_ms = req.params.get("timeoutMs")
        timeout_s = timeout_ms / 1000 if isinstance(timeout_ms, int) and timeout_ms > 0 else 30.0
        done = self.runs.known_run(self.digest, run_id)
        if done is None:
            raise InvalidRequest(f"unknown run {run_id}")
        self._spawn(self._wait_answer(req.id, run_id, done, timeout_s))

    async def _wait_answer(
        self, frame_id: str, run_id: str, done: asyncio.Future[RunResult], timeout_s: float
    ) -> None:
        try:
            result = await asyncio.wait_for(asyncio.shield(done), timeout_s)
        except TimeoutError:
            await self._send(ok(frame_id, {"runId": run_id, "status": "timeout"}))
            return
        status = "ok" if result.status in ("ok", "aborted") else "error"
        await self._send(ok(frame_id, {"runId": run_id, "status": status}))

    async def _chat_history(self, req: Request) -> None:
        conversation = session_key(_required_str(req.params, "sessionKey"))
        limit = req.params.get("limit")
        limit = min(limit, 1000) if isinstance(limit, int) and limit > 0 else 200
        entries, total = await self.request.app[CONVERSATIONS].messages(
            self.digest, conversation, limit=limit
        )
        messages = [_history_message(orjson.loads(entry)) for entry in entries]
        payload = {
            "sessionKey": conversation,
            "sessionId": conversation,
            "messages": messages,
            "hasMore": total > len(messages),
            "totalMessages": total,
        }
        await self._send(ok(req.id, payload))

    async def _chat_abort(self, req: Request) -> None:
        conversation = session_key(_required_str(req.params, "sessionKey"))
        run_id = req.params.get("runId")
        aborted = await self.runs.abort(
            self.digest, conversation, run_id if isinstance(run_id, str) else ""
        )
        await self._send(ok(req.id, {"ok": True, "aborted": bool(aborted), "runIds": aborted}))

    async def _sessions_reset(self, req: Request) -> None:
        conversation = session_key(req.params.get("key") or req.params.get("sessionKey"))
        dropped = await self.request.app[CONVERSATIONS].reset(self.digest, conversation)
        payload = {"ok": True, "key": conversation, "droppedMessages": dropped}
        await self._send(ok(req.id, payload))

    async def _sessions_list(self, req: Request) -> None:
        sessions = [{"key": key, "kind": "direct"} for key in self.sessions]
        payload = {
            "ts": now_ms(),
            "count": len(sessions),
            "sessions": sessions,
            "defaults": {"modelProvider": "rollgate", "model": self.config.model or None},
        }
        await self._send(ok(req.id, payload))


def _required_id(params: dict[str, Any], name: str) -> str:
    return check_identifier(_required_str(params, name), f"`{name}`")


def _required_str(params: dict[str, Any], name: str) -> str:
    value = params.get(name)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"`{name}` is required and must be a non-empty string")
    return value


def _history_message(entry: dict[str, Any]) -> dict[str, Any]:
    message = entry.get("message") or {}
    out: dict[str, Any] = {
        "role": message.get("role"),
        "content": [{"type": "text", "text": message.get("content") or ""}],
        "timestamp": entry.get("ts"),
    }
    if entry.get("aborted"):
        out["aborted"] = True
        out["stopReason"] = "aborted"
    return out
