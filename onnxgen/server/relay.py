"""From a running request's outputs to its HTTP answer: one JSON body, or a stream of SSE chunks.

A ``Relay`` reads the ``RequestHandle``'s batches on the event loop. It counts the metrics as the
outputs pass (time to first token from the request's arrival, the time between a choice's tokens
from the engine's own timestamps, so batching outputs on the way does not blur them), and turns
engine errors into API errors: a user error (OnnxgenError) is a 400, a cut at shutdown or an engine
that stopped is a 503, anything else a 500 whose traceback the scheduler already printed.

``EventStream`` is the ASGI response of a streamed request. It sends the status line only with
the first chunk, so that a request refused before its first token still gets its real status and
error body; after that an error is a last ``data: {"error": ...}`` event before ``data: [DONE]``.
Both the streamed and the collected paths watch the connection while they wait: a client that
disconnects cancels its request at once (taken off the queue, or stopped at its next token).
"""

from __future__ import annotations

import asyncio
import sys
import traceback
from collections.abc import AsyncIterator, Callable
from typing import Any

from onnxgen.errors import OnnxgenError
from onnxgen.genai.sampling import NonFiniteLogitsError
from onnxgen.genai.scheduler import Output, RequestCancelledError, RequestHandle, SchedulerUnavailableError
from onnxgen.server.errors import INTERNAL, ApiError, internal, invalid, unavailable
from onnxgen.server.jobs import Plan
from onnxgen.server.metrics import Metrics
from onnxgen.server.pacing import StreamPacing
from onnxgen.server.protocol import GenerationRequest
from onnxgen.server.responses import DONE, ChoiceResult, Envelope, chat_logprobs, completion_logprobs, dumps, sse
from onnxgen.server.token_text import TokenText


def api_error_of(error: BaseException) -> ApiError:
    if isinstance(error, ApiError):
        return error
    if isinstance(error, (RequestCancelledError, SchedulerUnavailableError)):
        return unavailable(str(error), code="server_shutting_down" if "shutting" in str(error) else None)
    if isinstance(error, NonFiniteLogitsError):
        return ApiError(500, str(error), type=INTERNAL, code="non_finite_logits")
    if isinstance(error, OnnxgenError):
        return invalid(str(error))
    return internal()


async def watch_disconnect(receive: Callable, on_gone: Callable[[], None]) -> None:
    """Waits for the client's ``http.disconnect`` (the body has been read), then calls ``on_gone``."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_gone()
            return


class Relay:
    def __init__(
        self,
        handle: RequestHandle,
        plan: Plan,
        request: GenerationRequest,
        envelope: Envelope,
        metrics: Metrics,
        tokens: TokenText,
        arrival: float,
        info: dict[str, Any],
        pacing: StreamPacing | None = None,
    ) -> None:
        self.handle = handle
        self.pacing = pacing or StreamPacing(0.0, 0.0)  # the least time between two batches read (pacing.py)
        self.plan = plan
        self.request = request
        self.envelope = envelope
        self.metrics = metrics
        self.tokens = tokens
        self.arrival = arrival
        self.info = info  # what the access log line shows
        self.first_at: float | None = None
        self.last_at: dict[int, float] = {}
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens reused; a prompt's n jobs count it once (as its tokens)
        info["prompt"] = plan.total_prompt_tokens
        metrics.prompt_tokens += plan.total_prompt_tokens

    def _observe(self, out: Output) -> None:
        event = out.event
        assert event is not None
        if event.token_id is not None:
            self.metrics.generation_tokens += 1
            if self.first_at is None:
                self.first_at = out.at
                self.metrics.ttft.observe(out.at - self.arrival)
                self.info["ttft"] = out.at - self.arrival
            last = self.last_at.get(out.index)
            if last is not None:
                self.metrics.per_token.observe(out.at - last)
            self.last_at[out.index] = out.at
        if event.finish_reason is not None:
            self.completion_tokens += out.completion_tokens
            self.info["completion"] = self.completion_tokens
            if out.index % self.plan.n == 0:  # the first job of its prompt (total_prompt_tokens' count)
                self.cached_tokens += out.cached_tokens
                self.metrics.cached_prompt_tokens += out.cached_tokens
            self.metrics.state_snapshot_hits += out.snapshot_hits
            self.metrics.state_snapshot_takes += out.snapshot_takes
            self.info.setdefault("finish", []).append(event.finish_reason)

    # -- one JSON body ---------------------------------------------------------------------------

    async def collect(self, receive: Callable) -> dict[str, Any]:
        """The whole response; an ApiError where the request failed."""
        choices = [ChoiceResult(index, prefix=prefix) for index, prefix in enumerate(self.plan.prefixes)]
        watcher = asyncio.ensure_future(watch_disconnect(receive, self.handle.cancel))
        self.pacing.open_readers += 1
        try:
            async for batch in self.handle.batches(self.pacing.interval):
                for out in batch:
                    if out.error is not None:
                        raise api_error_of(out.error)
                    self._observe(out)
                    event = out.event
                    choice = choices[out.index]
                    choice.parts.append(event.text)
                    if event.logprob is not None:
                        choice.logprobs.append(event.logprob)
                    if event.finish_reason is not None:
                        choice.finish_reason = event.finish_reason
                        choice.completion_tokens = out.completion_tokens
        finally:
            self.pacing.open_readers -= 1
            watcher.cancel()
            self.handle.cancel()  # a no-op when it has ended; else (cancelled, failed) stop the engine
        if any(c.finish_reason is None for c in choices):  # the client went away: nobody reads this
            raise invalid("the request was cancelled (the client disconnected)")
        with_logprobs = self.request.logprobs is not None
        return self.envelope.response(
            choices, self.plan.total_prompt_tokens, self.tokens, with_logprobs, self.cached_tokens
        )

    # -- a stream of events ----------------------------------------------------------------------

    def _flush(self, index: int, text: str, logprobs: list, offsets: dict[int, int]) -> bytes:
        if not text and not logprobs:
            return b""
        formatted = None
        if self.request.logprobs is not None:
            if self.request.kind == "chat":
                formatted = chat_logprobs(logprobs, self.tokens)
            else:
                start = offsets.get(index, len(self.plan.prefixes[index]))
                formatted = completion_logprobs(logprobs, self.tokens, start)
                offsets[index] = start + sum(len(t) for t in formatted["tokens"])
        if formatted is None:
            return self.envelope.text_chunk(index, text)
        return self.envelope.chunk(index, text=text, logprobs=formatted)

    async def chunks(self) -> AsyncIterator[bytes]:
        """SSE bytes, one item per batch of outputs (several chunks when the engine was ahead)."""
        self.pacing.open_readers += 1
        try:
            async for piece in self._chunks():
                yield piece
        finally:
            self.pacing.open_readers -= 1

    async def _chunks(self) -> AsyncIterator[bytes]:
        started: set[int] = set()
        offsets: dict[int, int] = {}
        sent = False
        async for batch in self.handle.batches(self.pacing.interval):
            pieces: list[bytes] = []
            pending: dict[int, tuple[list[str], list]] = {}
            for out in batch:
                if out.error is not None:
                    for index, (texts, logprobs) in pending.items():
                        pieces.append(self._flush(index, "".join(texts), logprobs, offsets))
                    error = api_error_of(out.error)
                    if not sent and not any(pieces):
                        raise error
                    yield b"".join(pieces) + sse(error.body()) + DONE
                    return
                self._observe(out)
                index, event = out.index, out.event
                if index not in started:
                    started.add(index)
                    if self.request.kind == "chat":
                        pieces.append(self.envelope.chunk(index, role=True))
                    elif self.plan.prefixes[index]:
                        pieces.append(self.envelope.chunk(index, text=self.plan.prefixes[index]))
                texts, logprobs = pending.setdefault(index, ([], []))
                texts.append(event.text)
                if event.logprob is not None:
                    logprobs.append(event.logprob)
                if event.finish_reason is not None:
                    pieces.append(self._flush(index, "".join(texts), logprobs, offsets))
                    del pending[index]
                    pieces.append(self.envelope.chunk(index, finish_reason=event.finish_reason))
            for index, (texts, logprobs) in pending.items():
                pieces.append(self._flush(index, "".join(texts), logprobs, offsets))
            data = b"".join(pieces)
            if data:
                sent = True
                yield data
        if self.handle.cancelled and len(self.info.get("finish", ())) < len(self.plan.jobs):
            return  # the client went away (a cut with a reason ends with an error output instead)
        tail = b""
        if self.request.include_usage:
            tail = self.envelope.usage_chunk(self.plan.total_prompt_tokens, self.completion_tokens, self.cached_tokens)
        yield tail + DONE


class EventStream:
    """The ASGI response of a streamed request (see the module docstring)."""

    headers = [
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),
    ]

    def __init__(self, relay: Relay) -> None:
        self.relay = relay

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        handle = self.relay.handle
        watcher = asyncio.ensure_future(watch_disconnect(receive, handle.cancel))
        pieces = self.relay.chunks()
        started = False
        try:
            async for piece in pieces:
                if not started:
                    await send({"type": "http.response.start", "status": 200, "headers": self.headers})
                    started = True
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            if not started:  # the client went away before the first token: close quietly
                await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except ApiError as error:  # before the first chunk: a real status
            await send_error(send, error)
        except Exception:  # noqa: BLE001 - a bug here must not take the server down
            print("onnxgen serve: internal error while streaming:", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
            error = internal()
            if not started:
                await send_error(send, error)
            else:
                body = sse(error.body()) + DONE
                await send({"type": "http.response.body", "body": body, "more_body": False})
        finally:
            watcher.cancel()
            handle.cancel()
            await pieces.aclose()


async def send_error(send: Callable, error: ApiError) -> None:
    headers = [(b"content-type", b"application/json")]
    headers += [(k.encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": dumps(error.body()), "more_body": False})
