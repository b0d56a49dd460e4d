"""Runs turns against the upstream: streaming (chunks as they arrive, then the record) or not."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from chatml.template import render_chatml
from chatml.tokenizer import LocalTokenizer
from services.runtime.errors import UpstreamError
from services.runtime.logs import get_logger
from services.worker.adapters import UpstreamAdapter
from services.worker.http1 import Http1Response, HttpError
from services.worker.openai_compat import OpenAICompatAdapter, PassThrough, Translator
from services.worker.prompt_ids import PromptIdsCache, read_with_prompt_ids
from services.worker.turn import (
    AnswerDelta,
    TurnAccumulator,
    TurnResult,
    TurnTiming,
    client_chunk,
    client_completion,
    split_choices,
)
from services.worker.upstream import (
    DONE,
    ClientRequest,
    RequestPolicy,
    Response,
    SseParser,
    UpstreamClient,
    UpstreamRequest,
    body_failure,
    build_upstream_request,
    upstream_text,
)

log = get_logger(__name__)


@dataclass(slots=True, kw_only=True)
class StreamBatch:
    """Client chunks that arrived together, and the sampled output tokens they carry."""

    chunks: list[bytes]
    # Tokens of sample 0 (the recorded one) in these chunks: ids when the upstream gives
    # them, else logprob entries. The gateway stamps them with the current weight version.
    output_tokens: int
    # With deltas_only: what the chunks added to sample 0's answer (instead of `chunks`).
    delta: AnswerDelta | None = None
    # True for the batch that ended the answer: the record follows at once.
    final: bool = False
    # The prompt's length in tokens once the upstream has told it (its prompt ids), else 0.
    prompt_tokens: int = 0


@dataclass(slots=True, kw_only=True)  # not frozen: built every turn (half the cost)
class CompletedTurn:
    """A non-streaming turn: the body for the client and the record."""

    body_json: bytes
    record: TurnResult


def _parse_chunk(payload: bytes) -> dict[str, Any]:
    try:
        chunk = orjson.loads(payload)
    except orjson.JSONDecodeError:
        raise UpstreamError("the upstream streamed a chunk that is not JSON") from None
    return _checked_chunk(chunk)


def _json_body(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise UpstreamError("the upstream answered with a body that is not JSON") from None


def _checked_chunk(chunk: Any) -> dict[str, Any]:
    if not isinstance(chunk, dict):
        raise UpstreamError("the upstream streamed a chunk that is not a JSON object")
    if isinstance(chunk.get("error"), dict):
        # vLLM reports errors raised after the stream started as one `data: {"error": ...}` event.
        message = chunk["error"].get("message", "")
        log.warning("upstream_failed_mid_stream", message=str(message))
        raise UpstreamError(f"the upstream failed mid-stream: {upstream_text(str(message))}")
    return chunk


class _Clock:
    """Wall and monotonic start of one upstream call, and its first token."""

    def __init__(self) -> None:
        self.started_at_unix_s = time.time()
        self.started = time.perf_counter()
        self.first_token: float | None = None

    def mark_first_token(self) -> None:
        if self.first_token is None:
            self.first_token = time.perf_counter()

    def timing(self) -> TurnTiming:
        now = time.perf_counter()
        first = self.first_token if self.first_token is not None else now
        return TurnTiming(
            started_at_unix_s=self.started_at_unix_s,
            latency_s=now - self.started,
            ttft_s=first - self.started,
        )


class _Group:
    """The accumulators of one call: sample 0 (what the client sees) and the extra samples."""

    def __init__(self, adapter: UpstreamAdapter) -> None:
        self._adapter = adapter
        # Sample 0's accumulator, and the adapter's reading of one chunk (looked up once).
        self.main = TurnAccumulator()
        self.samples: dict[int, TurnAccumulator] = {0: self.main}
        self._read_chunk = adapter.read_chunk

    def _acc(self, index: int) -> TurnAccumulator:
        return self.samples.setdefault(index, TurnAccumulator())

    def read_chunk(self, chunk: dict[str, Any]) -> None:
        choices = chunk.get("choices")
        if not isinstance(choices, list) or (len(choices) <= 1 and _index_zero(choices)):
            self._read_chunk(chunk, self.main)
            return
        for index, part in split_choices(chunk).items():
            self._adapter.read_chunk(part, self._acc(index))

    def read_completion(self, body: dict[str, Any]) -> None:
        for index, part in split_choices(body).items():
            self._adapter.read_completion(part, self._acc(index))

    def sampled_tokens(self) -> int:
        """Output tokens of sample 0 so far: its token ids if the upstream gives them, else
        its logprob entries (the record's `output_token_ids` / `output_logprobs`)."""
        main = self.main
        if main.output_token_ids is not None:
            return len(main.output_token_ids)
        return len(main.logprobs)

    def prompt_tokens(self) -> int:
        """The prompt's length in tokens, once the upstream has sent its ids (else 0)."""
        return len(self.main.prompt_token_ids or ())

    def finished(self) -> bool:
        return all(acc.finish_reason for acc in self.samples.values())

    def abort(self) -> None:
        """Marks every unfinished sample as stopped by an abort."""
        for acc in self.samples.values():
            if not acc.finish_reason:
                acc.finish_reason = ABORT


ABORT = "abort"


class _Abort:
    """One streaming turn's abort switch: tripping it closes the upstream response."""

    def __init__(self) -> None:
        self.tripped = False
        self.response: Any = None

    def trip(self) -> None:
        self.tripped = True
        if self.response is not None:
            # Ends the pending read and stops the generation upstream.
            self.response.close()


def _abort_chunk(acc: TurnAccumulator) -> dict[str, Any]:
    """The last chunk the client gets from an aborted stream: finish_reason "abort"."""
    return {
        "id": acc.interaction_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": acc.model,
        "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": ABORT}],
    }


def _index_zero(choices: list[Any]) -> bool:
    return not choices or (isinstance(choices[0], dict) and choices[0].get("index", 0) == 0)


class EventSink(Protocol):
    """Takes a streamed turn's events as they come (`TurnRunner.push`)."""

    def put(self, event: StreamBatch | TurnResult) -> bool:
        """Takes `event`; False when the turn's window is used up: nothing more is read (the
        upstream is held back) until `flush` returned."""

    async def flush(self) -> None:
        """Waits for the window to open and hands on what `put` held back."""


class _StreamedAnswer:
    """One streamed turn's answer as it is read, the same for both ways of reading it: each
    read's SSE payloads into the accumulators, the client's chunks and one StreamBatch
    (`read`); then its end (`end`: an abort's last chunk, the record)."""

    __slots__ = (
        "_clock",
        "_common",
        "_deltas_only",
        "_group",
        "_prompt_ids",
        "_runner",
        "_token_ids",
        "_translator",
        "aborted",
        "deadline",
        "done",
        "request",
    )

    def __init__(
        self,
        runner: TurnRunner,
        request: UpstreamRequest,
        *,
        translator: Translator,
        deadline: float,
        deltas_only: bool,
    ) -> None:
        self._runner = runner
        self.request = request
        self._translator = translator
        # The request's deadline (loop time): the upstream's answer is whole by then.
        self.deadline = deadline
        self._deltas_only = deltas_only
        adapter = runner.adapter
        self._group = _Group(adapter)
        # The kind reads chunks the standard way: the common chunk is read in one pass.
        self._common = type(adapter).read_chunk is OpenAICompatAdapter.read_chunk
        self._token_ids = adapter.reads_token_ids
        self._clock = _Clock()
        # Until the first payload is read: the cache its prompt ids are read through.
        self._prompt_ids = runner.prompt_ids_for(request, translator)
        # The upstream said [DONE] (or an abort ended the answer); an abort closed the answer.
        self.done = False
        self.aborted = False

    def read(self, payloads: list[bytes]) -> StreamBatch | None:
        """The batch of what one read brought (None when it brought nothing to hand on)."""
        group = self._group
        batch: list[bytes] = []
        sampled_before = group.sampled_tokens()
        mark = group.main.mark() if self._deltas_only else None
        ask = self.request.ask
        main = group.main
        common = self._common
        token_ids = self._token_ids
        for payload in payloads:
            if payload == DONE:
                self.done = True
                break
            if self._prompt_ids is not None:
                parsed = self._first_chunk(payload, self._prompt_ids)
            else:
                parsed = _parse_chunk(payload)
            for chunk in self._translator.events(parsed):
                if common and main.take_common(chunk, ask, token_ids=token_ids):
                    if main.output_seen:
                        self._clock.mark_first_token()
                    if mark is None:
                        batch.append(orjson.dumps(chunk))
                    continue
                group.read_chunk(chunk)
                if main.output_seen:
                    self._clock.mark_first_token()
                if mark is not None:
                    continue
                view = client_chunk(chunk, ask)
                if view is not None:
                    batch.append(orjson.dumps(view))
        tokens = group.sampled_tokens() - sampled_before
        delta = group.main.delta_since(mark) if mark is not None else None
        if batch or tokens or (delta is not None and delta) or self.done:
            return StreamBatch(
                chunks=batch,
                output_tokens=tokens,
                delta=delta,
                final=self.done,
                prompt_tokens=group.prompt_tokens(),
            )
        return None

    def _first_chunk(self, payload: bytes, prompt_ids: PromptIdsCache) -> dict[str, Any]:
        """The first chunk, its prompt ids (vLLM's, a whole prompt's) read through the cache
        (`read_with_prompt_ids`); a chunk they cannot be cut from is parsed whole."""
        self._prompt_ids = None
        read = read_with_prompt_ids(payload, prompt_ids)
        if read is None:
            return _parse_chunk(payload)
        chunk, self._group.main.prompt_token_ids = read
        return _checked_chunk(chunk)

    def end(self) -> Iterator[StreamBatch | TurnResult]:
        """Once the answer was read: an aborted answer's last batch, then the record; raises
        UpstreamError when the answer broke off before its end."""
        group = self._group
        if self.aborted and not self.done and not group.finished():
            group.abort()
            yield StreamBatch(
                chunks=[] if self._deltas_only else [orjson.dumps(_abort_chunk(group.main))],
                output_tokens=0,
                final=True,
            )
            self.done = True
        if not self.done and not group.finished():
            raise UpstreamError(
                "the upstream ended its stream before the answer was complete",
                code="upstream_broken_stream",
            )
        yield self._runner.record(group, self.request, self._clock)


class _Pushed:
    """An http:// upstream's answer read by its connection's read callback all the way to the
    sink (`BodySink`): SSE, the answer's reading, `sink.put` — no task wakes per read. The
    turn's task waits on one future, woken when the answer ended, failed, or when the turn's
    window is used up (reading pauses until the task has flushed the sink). A failure in the
    callback fails the turn and closes the response; it never reaches the event loop."""

    __slots__ = ("_answer", "_error", "_held", "_over", "_parser", "_response", "_sink", "_waiter")

    def __init__(self, response: Http1Response, answer: _StreamedAnswer, sink: EventSink) -> None:
        self._response = response
        self._answer = answer
        self._sink = sink
        self._parser = SseParser()
        self._waiter: asyncio.Future[None] | None = None
        # The sink held an event back (reading is paused); the answer is over (read to its
        # end, failed, or closed): nothing more is taken; why it failed.
        self._held = False
        self._over = False
        self._error: Exception | None = None

    async def run(self) -> None:
        """Returns once the answer was read to its end (and every event is with the sink)."""
        response = self._response
        loop = asyncio.get_running_loop()
        response.consume(self)
        try:
            while True:
                if self._held:
                    self._held = False
                    await self._sink.flush()
                    if not self._over:
                        response.resume_reading()
                    continue
                if self._error is not None:
                    raise self._error
                if self._over:
                    return
                waiter = self._waiter = loop.create_future()
                await waiter
        finally:
            self._over = True  # cancelled: closing the response tells nothing more
            response.consume(None)

    # BodySink: called from the connection's read callback

    def body(self, data: bytes) -> None:
        if self._over:
            return
        try:
            events = self._parser.feed(data)
            if events:
                self._take(events)
        except Exception as err:
            self._fail(err)

    def ended(self, error: HttpError | None) -> None:
        if self._over:
            return
        try:
            if error is not None:
                raise body_failure(error)
            tail = self._parser.close()
            if tail:
                self._take(tail)
            self._over = True
            self._wake()
        except Exception as err:
            self._fail(err)

    def _take(self, events: list[bytes]) -> None:
        answer = self._answer
        batch = answer.read(events)
        if batch is not None and not self._sink.put(batch):
            self._held = True
            self._response.pause_reading()
            self._wake()
        if answer.done:
            self._over = True
            self._wake()

    def _fail(self, error: Exception) -> None:
        self._over = True
        self._error = error
        self._response.close()  # the upstream stops generating
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class TurnRunner:
    """Calls the upstream for one turn at a time per call, and counts the turns in flight."""

    def __init__(
        self,
        *,
        upstream: UpstreamClient,
        adapter: UpstreamAdapter,
        policy: RequestPolicy | None = None,
        tokenizer: LocalTokenizer | None = None,
    ) -> None:
        self._upstream = upstream
        self._adapter = adapter
        self._policy = policy or RequestPolicy()
        # Ids for upstreams that give none (exact_tokens stays false).
        self._tokenizer = tokenizer
        self._url = adapter.endpoint(upstream.base_url)
        self._in_flight = 0
        # The prompt ids of streamed answers, read once per shared prefix (prompt_ids.py).
        self.prompt_ids = PromptIdsCache()
        # request_id → the abort switches of the streaming turns running under it.
        self._aborts: dict[str, set[_Abort]] = {}
        # Turns whose logprob count differed from their id count (flagged, never padded).
        self.length_mismatches = 0

    def prompt_ids_for(
        self, request: UpstreamRequest, translator: Translator
    ) -> PromptIdsCache | None:
        """The cache a turn's prompt ids are read through (`read_with_prompt_ids`), when the kind
        records ids, its JSON is the upstream's own chat JSON and the client asked for neither
        the ids (they stay in its answer, read as they come) nor several samples; else None."""
        ask = request.ask
        if (
            self._adapter.reads_token_ids
            and type(translator) is PassThrough
            and not ask.token_ids
            and not ask.only_choice_zero
        ):
            return self.prompt_ids
        return None

    @property
    def adapter(self) -> UpstreamAdapter:
        """The upstream kind's adapter."""
        return self._adapter

    @property
    def policy(self) -> RequestPolicy:
        """The aliases and defaults applied to every request."""
        return self._policy

    @property
    def in_flight(self) -> int:
        """Turns running now (reported on heartbeats)."""
        return self._in_flight

    def abort(self, request_id: str) -> bool:
        """Stops the streaming turns of `request_id`: each ends with its tokens so far."""
        signals = self._aborts.get(request_id, set()) if request_id else set()
        for signal in signals:
            signal.trip()
        log.info("turn_abort_requested", request_id=request_id, found=bool(signals))
        return bool(signals)

    @contextlib.contextmanager
    def _abortable(self, request_id: str) -> Iterator[_Abort]:
        signal = _Abort()
        if request_id:
            self._aborts.setdefault(request_id, set()).add(signal)
        try:
            yield signal
        finally:
            signals = self._aborts.get(request_id)
            if signals is not None:
                signals.discard(signal)
                if not signals:
                    del self._aborts[request_id]

    def _request(self, client: ClientRequest, *, stream: bool) -> UpstreamRequest:
        return build_upstream_request(
            client,
            stream=stream,
            prepare=self._adapter.prepare,
            policy=self._policy,
            encode=self._adapter.encode,
        )

    def record(self, group: _Group, request: UpstreamRequest, clock: _Clock) -> TurnResult:
        """The turn's record from its accumulators (retokenized when the upstream gave no ids)."""
        kind, timing = self._adapter.kind, clock.timing()
        results = {
            index: self._retokenized(
                acc,
                acc.result(kind=kind, timing=timing),
                request,
            )
            for index, acc in sorted(group.samples.items())
        }
        main = results.pop(0)
        record = (
            dataclasses.replace(main, extra_samples=tuple(r.sample() for r in results.values()))
            if results
            else main
        )
        mismatched = [s for s in (record.sample(), *record.extra_samples) if s.length_mismatch]
        if mismatched:
            self.length_mismatches += len(mismatched)
            log.warning(
                "length_mismatch",
                interaction_id=record.interaction_id,
                logprobs=len(record.output_logprobs),
                output_ids=len(record.output_token_ids),
                total=self.length_mismatches,
            )
        return record

    def _retokenized(
        self, acc: TurnAccumulator, result: TurnResult, request: UpstreamRequest
    ) -> TurnResult:
        if result.exact_tokens or self._tokenizer is None:
            return result
        ids = self._tokenizer.encode(acc.sampled_text())
        prompt = self._tokenizer.encode(render_chatml(*request.conversation()))
        return dataclasses.replace(
            result,
            prompt_token_ids=result.prompt_token_ids or prompt,
            output_token_ids=ids,
            exact_tokens=False,
            length_mismatch=len(ids) != len(result.output_logprobs),
        )

    def _answer(
        self, client: ClientRequest, *, budget_s: float, deltas_only: bool
    ) -> _StreamedAnswer:
        request = self._request(client, stream=True)
        return _StreamedAnswer(
            self,
            request,
            translator=self._adapter.translator(request.body, request.model),
            deadline=asyncio.get_running_loop().time() + budget_s,
            deltas_only=deltas_only,
        )

    @contextlib.asynccontextmanager
    async def _answering(self, answer: _StreamedAnswer, request_id: str) -> AsyncIterator[Response]:
        """The upstream's answer to `answer`'s request, abortable under `request_id`: after an
        abort (it closes the response) the read's failure ends the answer, which then says so."""
        with self._abortable(request_id) as aborted:
            async with self._upstream.post_chat(
                answer.request.body, deadline=answer.deadline, url=self._url
            ) as response:
                # An abort closes the response: the pending read ends, no task per read.
                aborted.response = response
                try:
                    yield response
                except UpstreamError:
                    if not aborted.tripped:
                        raise
            answer.aborted = aborted.tripped

    async def stream(
        self,
        client: ClientRequest,
        *,
        budget_s: float,
        request_id: str = "",
        deltas_only: bool = False,
    ) -> AsyncGenerator[StreamBatch | TurnResult, None]:
        """Batches of client chunks as they arrive, then the turn's record; raises RollgateError.

        Each batch says how many sampled tokens it carries (also when no chunk of it is for
        the client), so the gateway can stamp every token with the version it ran under.
        With `deltas_only` a batch carries what it added to the answer instead of chunks.

        `abort(request_id)` ends the upstream call early: the last chunk then says
        finish_reason "abort" and the record holds the tokens sampled so far.
        """
        answer = self._answer(client, budget_s=budget_s, deltas_only=deltas_only)
        self._in_flight += 1
        try:
            async with self._answering(answer, request_id) as response:
                events = self._upstream.read_events(response, deadline=answer.deadline)
                async for payloads in events:
                    batch = answer.read(payloads)
                    if batch is not None:
                        yield batch
                    if answer.done:
                        break
            for event in answer.end():
                yield event
        finally:
            self._in_flight -= 1

    async def push(
        self,
        client: ClientRequest,
        *,
        budget_s: float,
        sink: EventSink,
        request_id: str = "",
        deltas_only: bool = False,
    ) -> None:
        """The events `stream` yields, handed to `sink` as they come; raises RollgateError.

        An `http://` upstream's answer is read by its connection's read callback all the way
        to `sink.put` (no task wakes per read, no generator per read: the turn's task waits
        for the answer's end, a failure, or the turn's window to open); an answer on aiohttp
        (an `https://` upstream, a base URL with credentials) is read as `stream` reads it.
        """
        answer = self._answer(client, budget_s=budget_s, deltas_only=deltas_only)
        self._in_flight += 1
        try:
            async with self._answering(answer, request_id) as response:
                if isinstance(response, Http1Response):
                    await _Pushed(response, answer, sink).run()
                else:
                    events = self._upstream.read_events(response, deadline=answer.deadline)
                    async for payloads in events:
                        batch = answer.read(payloads)
                        if batch is not None and not sink.put(batch):
                            await sink.flush()
                        if answer.done:
                            break
            for event in answer.end():
                if not sink.put(event):
                    await sink.flush()
        finally:
            self._in_flight -= 1

    async def complete(self, client: ClientRequest, *, budget_s: float) -> CompletedTurn:
        """One non-streaming upstream call: the client's body and the record."""
        request = self._request(client, stream=False)
        translator = self._adapter.translator(request.body, request.model)
        deadline = asyncio.get_running_loop().time() + budget_s
        group = _Group(self._adapter)
        clock = _Clock()
        self._in_flight += 1
        try:
            async with self._upstream.post_chat(
                request.body, deadline=deadline, url=self._url
            ) as response:
                raw = await self._upstream.read_body(response, deadline=deadline)
            prompt_ids = self.prompt_ids_for(request, translator)
            read = read_with_prompt_ids(raw, prompt_ids) if prompt_ids is not None else None
            if read is not None:
                answer, group.main.prompt_token_ids = read
            else:
                answer = _json_body(raw)
            if not isinstance(answer, dict):
                raise UpstreamError("the upstream answered with JSON that is not an object")
            body = translator.completion(answer)
            group.read_completion(body)
            clock.mark_first_token()
            record = self.record(group, request, clock)
            return CompletedTurn(
                body_json=orjson.dumps(client_completion(body, request.ask)), record=record
            )
        finally:
            self._in_flight -= 1
