"""The request runner between a surface (the HTTP server) and the Generator: requests go in with
their prompt ids and sampling parameters, events come out on the caller's asyncio loop.

``Scheduler`` is the protocol a surface codes against; ``SerialScheduler`` runs the requests one
at a time, in arrival order, on one engine thread that owns the Generator. Issue 20's batching
scheduler is meant to replace it behind the same protocol, so the protocol says only what any
runner can promise:

- ``submit(jobs, loop)`` admits a request (one or more jobs: the n choices of an OpenAI request,
  or one per prompt) all or nothing, and raises ``QueueFullError`` when ``max_queue`` requests
  already wait; a ``RequestHandle`` comes back at once.
- The handle yields ``Output``s in batches: per job, its events in order, then one final output;
  jobs of one request may interleave (a batching runner runs them together), told apart by
  ``Output.index``. The handle ends after every job's final output, or after an error output.
- ``cancel()`` stops the request at its next token (or takes it off the queue at once): nothing
  keeps decoding for a client that has gone.

Threads: the Generator is built, warmed up and driven on the engine thread only, so torch and CUDA
state (streams, captured graphs) never cross threads. Outputs cross to the asyncio loop through a
per-handle deque; the engine schedules a wake-up with ``loop.call_soon_threadsafe`` only when the
reader waits for one and none is pending, so a loop that is behind (or paces itself with
``batches(min_interval_s)``) drains many tokens per wake-up, and the engine never waits on the loop.
Each wake-up costs the engine thread a share of the interpreter lock while the loop runs, so fewer
wake-ups are what keeps HTTP work from slowing a fast stream. Reading ``generator`` from the loop
thread (tokenizer, chat template, config) is safe: those are read-only after load.
"""

from __future__ import annotations

import asyncio
import collections
import math
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from onnxgen.errors import OnnxgenError
from onnxgen.genai.events import GenerationEvent
from onnxgen.genai.sampling import SamplingParams

if TYPE_CHECKING:
    from onnxgen.genai.generator import Generator

# Scheduler states
LOADING, READY, FAILED, CLOSED = "loading", "ready", "failed", "closed"


class QueueFullError(OnnxgenError):
    """``max_queue`` requests already wait: the caller should retry later (HTTP 503)."""


class SchedulerUnavailableError(OnnxgenError):
    """The scheduler takes no requests: still loading, failed, or closed (``state`` says which)."""


class RequestCancelledError(OnnxgenError):
    """The request was cut before its end: ``cancel(reason)`` with a reason, e.g. at shutdown."""


@dataclass(frozen=True)
class Job:
    """One generation: checked prompt ids and checked sampling parameters."""

    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Output:
    """One item of a handle. ``event``: a token or a final event of job ``index`` (None when
    ``error`` is set: the request ended with that exception). ``at``: time.perf_counter() when the
    engine produced it. ``completion_tokens``: on final events, every token the model produced for
    the job, a stop id included (Generator.last_stats.new_tokens); ``cached_tokens``: of its prompt
    tokens, those whose KV was reused rather than computed (batching's prefix reuse);
    ``snapshot_hits`` and ``snapshot_takes``: a hybrid decoder's state snapshots restored for the
    job's reused prefix and taken of its prompt (genai/state_snapshots.py)."""

    index: int
    event: GenerationEvent | None
    at: float
    error: BaseException | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    snapshot_hits: int = 0
    snapshot_takes: int = 0


class RequestHandle:
    """A submitted request, as its caller's asyncio loop sees it. Iterate ``batches()`` for the
    outputs; ``cancel()`` from the loop thread at any time (idempotent)."""

    def __init__(self, jobs: Sequence[Job], loop: asyncio.AbstractEventLoop) -> None:
        self.jobs = list(jobs)
        self.submitted_at = time.perf_counter()
        self._loop = loop
        self._items: collections.deque[Output | None] = collections.deque()  # None: the end
        self._wake = asyncio.Event()
        self._wake_pending = False
        self._reader_waiting = False  # the loop side awaits _wake (else it reads the deque by itself)
        self.cancelled = False  # read by the engine thread after every token
        self.cancel_reason: str | None = None
        self._on_cancel: Callable[[RequestHandle], None] | None = None
        self.finished = False  # the end was delivered
        self.jobs_done = 0  # jobs whose final event was pushed (engine thread)
        self.jobs_started = 0  # jobs handed to the engine (a batching runner starts them one by one)

    # -- the engine side (any thread) ------------------------------------------------------

    def _push(self, item: Output | None) -> None:
        self._items.append(item)
        if self._reader_waiting and not self._wake_pending:
            self._wake_pending = True
            try:
                self._loop.call_soon_threadsafe(self._woken)
            except RuntimeError:  # the loop has closed: nobody will read; stop generating
                self.cancelled = True

    def _woken(self) -> None:
        self._wake_pending = False
        self._wake.set()

    # -- the loop side ---------------------------------------------------------------------

    async def batches(self, min_interval_s: float | Callable[[], float] = 0.0) -> AsyncIterator[list[Output]]:
        """Lists of outputs in order, as many as arrived since the last one; ends after the last.

        ``min_interval_s``: after a batch, the next one comes no sooner than this (the first at
        once): a fast stream is handed over in fewer, larger batches, and the engine schedules no
        wake-up while the reader sleeps out its interval (module docstring: why that matters). A
        callable is asked before each batch (the server widens the interval with the streams open)."""
        interval = min_interval_s if callable(min_interval_s) else (lambda: min_interval_s)
        last = -math.inf
        while True:
            if not self._items:
                self._wake.clear()
                self._reader_waiting = True
                if not self._items:  # looked at after the flag is up: an item pushed before it is seen here
                    await self._wake.wait()
                self._reader_waiting = False
                continue
            wait = last + interval() - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            last = time.perf_counter()
            batch: list[Output] = []
            while self._items:
                item = self._items.popleft()
                if item is None:
                    self.finished = True
                    if batch:
                        yield batch
                    return
                batch.append(item)
            yield batch

    def cancel(self, reason: str | None = None) -> None:
        """Stop at the next token. With a ``reason`` the request's outputs end with a
        RequestCancelledError(reason) (a server cutting streams at shutdown); without one the caller
        has gone and the outputs just end."""
        if self.cancelled:
            return
        self.cancel_reason = reason
        self.cancelled = True
        if self._on_cancel is not None:
            self._on_cancel(self)


class Scheduler(Protocol):
    """What a surface needs of a request runner (see the module docstring)."""

    @property
    def state(self) -> str:
        """LOADING, READY (loaded and one step has run), FAILED or CLOSED."""
        ...

    @property
    def failure(self) -> str | None:
        """Why the state is FAILED (one line), else None."""
        ...

    @property
    def generator(self) -> Generator | None:
        """The loaded Generator, for its text side only (tokenizer, chat template, config,
        ``encode``): None until READY. Generation goes through ``submit``."""
        ...

    @property
    def queue_depth(self) -> int:
        """Requests admitted and not yet started."""
        ...

    @property
    def running(self) -> int:
        """Requests being decoded now."""
        ...

    @property
    def sequence_limit(self) -> int | None:
        """Tokens one job may hold, where below the model's context (None: the context)."""
        ...

    def submit(self, jobs: Sequence[Job], loop: asyncio.AbstractEventLoop) -> RequestHandle: ...

    def cancel_all(self, reason: str) -> None:
        """Cut every admitted request with ``reason`` (a shutdown's grace has run out)."""
        ...

    def close(self, timeout: float = 10.0) -> None:
        """Take no more requests, cut the admitted ones, and stop the engine thread."""
        ...


def warm_up(generator: Generator) -> None:
    """One short greedy generation, so that /health's "a step has run" holds (on CUDA it records
    the greedy graphs too)."""
    ids = generator.encode("Hello")
    for _ in generator.events(ids, SamplingParams(max_new_tokens=2)):
        pass


class SchedulerStates:
    """The state part of the protocol every runner shares: ``state``, ``failure``, ``wait_loaded``
    and the message a request refused for the state gets. A subclass sets ``_state``, ``_failure``
    and ``_ready`` (an Event set on READY or FAILED)."""

    _state: str
    _failure: str | None
    _ready: threading.Event

    @property
    def state(self) -> str:
        return self._state

    @property
    def failure(self) -> str | None:
        return self._failure

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Blocks until READY or FAILED (True), or ``timeout`` passes (False)."""
        return self._ready.wait(timeout)

    def _unavailable(self) -> str:
        if self._state == LOADING:
            return "the model is still loading"
        if self._state == FAILED:
            return f"the engine has failed: {self._failure}"
        return "the server is shutting down"


class EngineThreadScheduler(SchedulerStates):
    """What every runner here shares: one engine thread that owns the Generator, a bounded queue of
    requests in arrival order, the states, cancellation of queued requests, and the probe after an
    internal error. A subclass's ``_serve(generator)`` runs the requests (it returns when closed).

    ``make_generator`` is called on the engine thread (so is ``warm``); a failure there makes
    the state FAILED with the error as ``failure``. An exception while a request runs ends that
    request with the exception as its error output (the caller tells a user error, an
    OnnxgenError, from an internal one, which is also printed with its traceback on stderr here);
    the engine thread goes on with the next request. ``max_queue``: requests that may wait (the
    running ones not counted)."""

    # True where the runner calls ``after_step`` once it has handed out a step's outputs (its
    # outputs of one step may then be passed on together)
    delivers_per_step = False

    def __init__(
        self,
        make_generator: Callable[[], Generator],
        *,
        max_queue: int = 64,
        warm: Callable[[Generator], None] = warm_up,
    ) -> None:
        self.after_step: Callable[[], None] | None = None
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.max_queue = max_queue
        self._make_generator = make_generator
        self._warm = warm
        self._lock = threading.Condition()
        self._queue: collections.deque[RequestHandle] = collections.deque()
        self._state = LOADING
        self._failure: str | None = None
        self._generator: Generator | None = None
        self._ready = threading.Event()  # set on READY or FAILED
        self._thread = threading.Thread(target=self._main, name="onnxgen-engine", daemon=True)

    def start(self) -> EngineThreadScheduler:
        self._thread.start()
        return self

    # -- the protocol ------------------------------------------------------------------------

    @property
    def generator(self) -> Generator | None:
        return self._generator if self._state == READY else None

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        raise NotImplementedError

    @property
    def sequence_limit(self) -> int | None:
        """Tokens (prompt and new ones) one job may hold when the runner sets a limit below the
        model's context (a batching runner's KV slots); None: the context."""
        return None

    def describe(self) -> str:
        """How this runner decodes, in a few words (the server's ready line)."""
        return "one request at a time"

    def submit(self, jobs: Sequence[Job], loop: asyncio.AbstractEventLoop) -> RequestHandle:
        if not jobs:
            raise ValueError("a request needs at least one job")
        return self.enqueue(RequestHandle(jobs, loop))

    def enqueue(self, handle: RequestHandle) -> RequestHandle:
        """``submit`` for a handle made by the caller (an engine process's relayed one)."""
        with self._lock:
            if self._state != READY:
                raise SchedulerUnavailableError(self._unavailable())
            if len(self._queue) >= self.max_queue:
                raise QueueFullError(f"{len(self._queue)} requests are waiting already (--max-queue {self.max_queue})")
            handle._on_cancel = self._dequeue
            self._queue.append(handle)
            self._lock.notify()
        return handle

    def cancel_all(self, reason: str) -> None:
        with self._lock:
            handles = list(self._queue) + self._started()
        for handle in handles:
            handle.cancel(reason)

    def close(self, timeout: float = 10.0) -> None:
        with self._lock:
            if self._state in (LOADING, READY):
                self._state = CLOSED
            self._lock.notify_all()
        self.cancel_all("the server is shutting down")
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # -- the engine thread -------------------------------------------------------------------

    def _dequeue(self, handle: RequestHandle) -> None:
        """A queued request cancelled: off the queue now (its place is free), its end delivered."""
        with self._lock:
            try:
                self._queue.remove(handle)
            except ValueError:
                return  # running (the engine sees the flag) or already over
        self._end(handle)

    @staticmethod
    def _end(handle: RequestHandle) -> None:
        if handle.cancel_reason is not None and handle.jobs_done < len(handle.jobs):
            error = RequestCancelledError(handle.cancel_reason)
            handle._push(Output(0, None, time.perf_counter(), error=error))
        handle._push(None)

    def _main(self) -> None:
        try:
            generator = self._make_generator()
            self._warm(generator)
        except BaseException as exc:  # noqa: BLE001 - any load failure is reported, not raised in a thread
            self._failure = str(exc) if isinstance(exc, OnnxgenError) else f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, OnnxgenError):
                traceback.print_exc(file=sys.stderr)
            with self._lock:
                self._state = FAILED
            self._ready.set()
            return
        with self._lock:
            self._generator = generator
            if self._state == LOADING:
                self._state = READY
        self._ready.set()
        self._serve(generator)

    def _serve(self, generator: Generator) -> None:
        raise NotImplementedError

    def _started(self) -> list[RequestHandle]:
        """The requests taken off the queue and not over (engine thread's view; read under the lock)."""
        raise NotImplementedError

    def _still_works(self, generator: Generator) -> bool:
        """After an internal error, the warm-up generation again: where it fails too the engine is
        broken (e.g. a sticky CUDA error), the state becomes FAILED and the queued requests end with
        SchedulerUnavailableError."""
        try:
            self._warm(generator)
            return True
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc(file=sys.stderr)
            with self._lock:
                self._state = FAILED
                self._failure = f"after an internal error, a probe generation failed too: {type(exc).__name__}: {exc}"
                queued, self._queue = list(self._queue), collections.deque()
            for handle in queued:
                handle._push(Output(0, None, time.perf_counter(), error=SchedulerUnavailableError(self._unavailable())))
                handle._push(None)
            return False


class SerialScheduler(EngineThreadScheduler):
    """Runs requests one at a time, in arrival order: a request's jobs one after another, each
    through ``Generator.events``."""

    def __init__(self, make_generator: Callable[[], Generator], **kwargs) -> None:
        super().__init__(make_generator, **kwargs)
        self._current: RequestHandle | None = None

    @property
    def running(self) -> int:
        return 0 if self._current is None else 1

    def _started(self) -> list[RequestHandle]:
        return [self._current] if self._current is not None else []

    def _serve(self, generator: Generator) -> None:
        while True:
            with self._lock:
                while not self._queue and self._state == READY:
                    self._lock.wait()
                if not self._queue:
                    return  # closed
                handle = self._current = self._queue.popleft()
            try:
                internal = self._run(generator, handle)
            finally:
                with self._lock:
                    self._current = None
            self._end(handle)
            if internal and not self._still_works(generator):
                return

    @staticmethod
    def _run(generator: Generator, handle: RequestHandle) -> bool:
        """The request's jobs one after another; stops at the first error or at a cancel. True when
        it ended with an internal error (not an OnnxgenError)."""
        for index, job in enumerate(handle.jobs):
            if handle.cancelled:
                return False
            try:
                events = generator.events(job.prompt_ids, job.params)
                try:
                    for event in events:
                        final = event.finish_reason is not None
                        used = generator.last_stats.new_tokens if final else 0
                        handle._push(Output(index, event, time.perf_counter(), completion_tokens=used))
                        if final:
                            handle.jobs_done += 1
                        if handle.cancelled:
                            break
                finally:
                    events.close()  # a cancel stops the decode loop here, and frees the sequence
            except Exception as exc:  # noqa: BLE001 - the request's error, handed to its caller
                if not isinstance(exc, OnnxgenError):
                    print(f"onnxgen serve: internal error in a request (job {index}):", file=sys.stderr)
                    traceback.print_exc(file=sys.stderr)
                handle._push(Output(index, None, time.perf_counter(), error=exc))
                handle.cancelled = True  # the request is over; no further job runs
                return not isinstance(exc, OnnxgenError)
        return False
