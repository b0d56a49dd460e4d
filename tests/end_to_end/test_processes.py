"""Each service process: health service, and graceful SIGTERM with a stream in flight."""

from __future__ import annotations

import json
import signal
import socket
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollgate.stack import GRPC_SERVICES, Stack
from services.runtime.keys import key_digest
from tests.end_to_end.test_walkthrough import MODEL, chat_body, request, run_example, stderr_vars
from tests.harness.poll import eventually_sync
from tests.harness.processes import stack_config


@pytest.fixture(scope="module")
def slow_stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack whose mock streams one token every 40 ms, so streams are in flight for a while."""
    config = stack_config(
        redis_url,
        Path(tmp_path_factory.mktemp("slow-stack")),
        prefix="rge2e",
        mock_token_interval_ms=40.0,
    )
    with Stack(config) as running:
        yield running


class StreamReader(threading.Thread):
    """Reads one streaming chat in the background; `first_chunk` is set when data arrives."""

    def __init__(self, stack: Stack, key: str) -> None:
        super().__init__(daemon=True)
        self.stack, self.key = stack, key
        self.first_chunk = threading.Event()
        self.raw = b""
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            url = urllib.parse.urlsplit(self.stack.gateway_url)
            body = json.dumps(chat_body("please write a long answer", stream=True)).encode()
            with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
                sock.sendall(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                    b"Content-Type: application/json\r\n"
                    + f"Authorization: Bearer {self.key}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                while chunk := sock.recv(65536):
                    self.raw += chunk
                    if b"data: {" in self.raw:
                        self.first_chunk.set()
        except BaseException as err:
            self.error = err
        finally:
            self.first_chunk.set()


def new_key(stack: Stack) -> str:
    started = run_example(stack, "start_session.py")
    assert started.returncode == 0, started.stdout + started.stderr
    return stderr_vars(started)["SESSION_API_KEY"]


def test_every_grpc_service_serves_the_standard_health_check(slow_stack: Stack) -> None:
    for name, service in slow_stack.services.items():
        if service.kind not in GRPC_SERVICES:
            continue
        with grpc.insecure_channel(service.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=GRPC_SERVICES[service.kind]), timeout=5
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, name


@pytest.mark.parametrize("victim", ["gateway", "dataproxy", "worker"])
def test_sigterm_lets_the_stream_in_flight_finish(slow_stack: Stack, victim: str) -> None:
    key = new_key(slow_stack)
    # Warm the route so we know which worker serves this key.
    status, _, raw = request(slow_stack, "POST", "/v1/chat/completions", chat_body("warm"), key)
    assert status == 200, raw
    reader = StreamReader(slow_stack, key)
    reader.start()
    assert reader.first_chunk.wait(30), "no first chunk"
    name = victim
    if victim == "worker":
        name = _worker_of(slow_stack, key)
    code = slow_stack.stop_service(name, timeout_s=30)
    reader.join(30)
    assert reader.error is None, reader.error
    assert b"data: [DONE]" in reader.raw, reader.raw[-500:]
    assert code == 0, f"{name} exited with {code}:\n{slow_stack.services[name].log_tail()}"
    slow_stack.restart_service(name)
    status, _, raw = request(slow_stack, "POST", "/v1/chat/completions", chat_body("after"), key)
    assert status == 200, raw


def _worker_of(stack: Stack, key: str) -> str:
    """The worker the router pinned this key to (its affinity record in Redis)."""
    client = redis.Redis.from_url(stack.redis_url)
    try:
        worker = client.get(f"{stack.config.redis_prefix}aff:{key_digest(key)}:{MODEL}")
    finally:
        client.close()
    assert worker, "the router recorded no affinity for this key"
    return str(worker.decode())


def test_sigusr1_prints_every_task_and_the_service_serves_on(slow_stack: Stack) -> None:
    # What a process that went quiet waits for (docs/operations.md, "A service went quiet").
    for name, service in slow_stack.services.items():
        if service.kind not in (*GRPC_SERVICES, "gateway"):
            continue
        service.signal(signal.SIGUSR1)
        dump = eventually_sync(
            lambda service=service: _task_dump(service.log_path.read_text(errors="replace")),
            timeout_s=20.0,
            what=f"{name}'s task dump",
        )
        # Its main task waits for the stop signal, with the chain of awaits down to it.
        assert "in wait_for_stop_signal" in dump, dump
        assert service.alive and service.healthy(), name


def _task_dump(log: str) -> str | None:
    start = log.rfind("asyncio tasks ---")
    end = log.find("--- end of tasks ---", start)
    return log[start:end] if start >= 0 and end >= 0 else None
