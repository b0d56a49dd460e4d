"""Worker.Abort: a running Generate call stops the upstream and ends normally with the tokens
sampled so far (real worker gRPC server, real mock LLM)."""

from __future__ import annotations

import grpc
import orjson

from protos import worker_pb2
from tests.harness.poll import eventually
from tests.worker.harness import mock_and_worker, unpacked
from tests.worker.test_worker_grpc import LONG_TEXT, body

DEADLINE_S = 10.0


async def test_abort_ends_the_stream_with_an_abort_chunk_and_the_partial_record() -> None:
    async with mock_and_worker(token_interval_ms=50) as (mock, worker):
        call = worker.stub.Generate(
            worker_pb2.GenerateRequest(
                body_json=body(LONG_TEXT, stream=True, max_tokens=200), request_id="run-1"
            ),
            timeout=DEADLINE_S,
        )
        first = await call.read()
        assert first.HasField("chunks")
        assert worker.runner.in_flight == 1

        answer = await worker.stub.Abort(
            worker_pb2.AbortRequest(request_id="run-1"), timeout=DEADLINE_S
        )
        rest = []
        while (message := await call.read()) is not grpc.aio.EOF:
            rest.append(message)

        assert answer.found is True
        assert await call.code() == grpc.StatusCode.OK
        record = unpacked(rest[-1].record)
        chunks = [orjson.loads(c) for m in [first, *rest] for c in m.chunks.chunks]
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
        assert record.finish_reason == "abort"
        assert 0 < len(record.output_token_ids) < 200
        assert len(record.output_logprobs) == len(record.output_token_ids)
        assert record.exact_tokens is True
        assert record.interaction_id == chunks[0]["id"]
        await eventually(
            lambda: mock.stats.disconnects, timeout_s=DEADLINE_S, what="the upstream call closed"
        )
        assert mock.stats.streams_finished == 0
        assert worker.runner.in_flight == 0


async def test_abort_of_an_unknown_or_finished_request_finds_nothing() -> None:
    async with mock_and_worker() as (_, worker):
        messages = [
            m
            async for m in worker.stub.Generate(
                worker_pb2.GenerateRequest(body_json=body(stream=True), request_id="done-1"),
                timeout=DEADLINE_S,
            )
        ]
        assert messages[-1].record.finish_reason == "stop"

        for request_id in ("done-1", "never-seen", ""):
            answer = await worker.stub.Abort(
                worker_pb2.AbortRequest(request_id=request_id), timeout=DEADLINE_S
            )
            assert answer.found is False
