"""The engine in a process of its own: ``ProcessScheduler`` is the scheduler protocol
(scheduler.py) for a runner that lives in a child process, as vLLM and SGLang run theirs.

Why: a runner's engine thread and the server's event loop in one process share the interpreter
lock, so every piece of HTTP work (parsing, JSON, SSE framing, socket writes) is time the engine
thread waits to launch its next step. In two processes they run side by side; what crosses between
them is small: a request's checked prompt ids and sampling parameters one way, its outputs (a
token's event, a few bytes of text) the other.

The child (spawned, never forked: a forked CUDA context is unusable) builds the Generator the
``EngineSpec`` describes and the runner its ``RunnerOptions`` choose, and runs it as the
in-process server would, with one difference: its request handles send their outputs to a writer
thread, which pickles whatever has accumulated into one message (a token's output as a plain
tuple), instead of waking an event loop.
The child's main thread reads the commands (submit, cancel, cancel all, close). The parent keeps
the text side of the package (prompt_text.PromptText: tokenizer, chat template, prompt checks),
the requests' handles, and a reader thread that hands each output to its handle as the in-process
engine thread would.

Failure: the child ignores SIGINT (a terminal's Ctrl-C reaches the whole process group; the parent
decides when the engine stops), exits when its command pipe closes (the parent has gone), and when
it ends unexpectedly the parent's state becomes FAILED with its exit code, and every admitted
request ends with an error. An error that cannot be pickled crosses as an OnnxgenError (a user
error) or a RuntimeError (an internal one) with the same message.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from onnxgen.errors import OnnxgenError
from onnxgen.genai.batch_scheduler import RunnerOptions
from onnxgen.genai.events import GenerationEvent
from onnxgen.genai.prompt_text import PromptText
from onnxgen.genai.scheduler import (
    CLOSED,
    FAILED,
    LOADING,
    READY,
    EngineThreadScheduler,
    Job,
    Output,
    QueueFullError,
    RequestCancelledError,
    RequestHandle,
    SchedulerStates,
    SchedulerUnavailableError,
)
from onnxgen.threads import ThreadOptions

if TYPE_CHECKING:
    from onnxgen.genai.generator import Generator

_UNBOUNDED_QUEUE = 1 << 30  # the child's own queue: the parent bounds it (max_queue)


@dataclass(frozen=True)
class EngineSpec:
    """The Generator the engine process builds: one for ``package`` with ``device``, ``kv``,
    ``capture`` and ``threads`` (Generator's arguments). Its runner is the ``RunnerOptions``
    handed to ProcessScheduler beside it."""

    package: str
    device: str = "cpu"
    kv: str = "auto"
    capture: str | None = None
    threads: ThreadOptions | None = None

    def make_generator(self) -> Generator:
        from onnxgen.genai.generator import Generator

        return Generator(self.package, device=self.device, kv=self.kv, capture=self.capture, threads=self.threads)


# -- the child ---------------------------------------------------------------------------------


def _encoded(item: Output | None) -> tuple | Output | None:
    """A token's or a final output as a plain tuple (a frozen dataclass pickles and unpickles
    several times slower, and at 64 streams that was a share of every step's host work); an error
    output as itself, made portable."""
    if item is None or item.error is not None:
        return _portable(item)
    event = item.event
    return (item.index, event.token_id, event.text, event.logprob, event.finish_reason, item.at,
            item.completion_tokens, item.cached_tokens, item.snapshot_hits, item.snapshot_takes)  # fmt: skip


def _decoded(item: tuple | Output | None) -> Output | None:
    if not isinstance(item, tuple):
        return item
    index, token_id, text, logprob, finish, at, completion, cached, hits, takes = item
    return Output(index, GenerationEvent(token_id, text, logprob, finish), at, None, completion, cached, hits, takes)


def _portable(item: Output | None) -> Output | None:
    """``item`` with an error that survives pickling (module docstring)."""
    if item is None or item.error is None:
        return item
    try:
        pickle.loads(pickle.dumps(item.error))
        return item
    except Exception:  # noqa: BLE001 - any error class that does not round-trip is replaced
        error = item.error
        kind = OnnxgenError if isinstance(error, OnnxgenError) else RuntimeError
        return Output(item.index, None, item.at, error=kind(f"{type(error).__name__}: {error}"))


class _Outbox:
    """Outputs of the child's handles, sent by one writer thread: each message carries every
    output pushed since the last one, and the runner's queue depth and running count."""

    LOAD_REFRESH_S = 0.05

    def __init__(self, conn: Connection, runner: EngineThreadScheduler) -> None:
        self._conn = conn
        self._runner = runner
        self._items: list[tuple[int, Output | None]] = []
        self._ready = threading.Condition()
        self._closing = False
        self._sending = threading.Lock()  # one message at a time on the pipe
        self._per_step = runner.delivers_per_step
        runner.after_step = self.flush
        self._thread = threading.Thread(target=self._write, name="onnxgen-engine-writer", daemon=True)
        self._thread.start()

    def put(self, rid: int, item: Output | None) -> None:
        """Queue ``item`` for the parent. A token's output waits for the step's ``flush`` where the
        runner calls one after each step (one message, one wake-up of the writer per step); a final
        output, an error or an end goes at once."""
        encoded = _encoded(item)
        with self._ready:
            self._items.append((rid, encoded))
            if not (self._per_step and isinstance(encoded, tuple) and encoded[1] is not None):
                self._ready.notify()

    def flush(self) -> None:
        with self._ready:
            if self._items:
                self._ready.notify()

    def send(self, message: tuple) -> None:
        with self._sending:
            self._conn.send(message)

    def close(self) -> None:
        """Send what is left, then stop the writer."""
        with self._ready:
            self._closing = True
            self._ready.notify()
        self._thread.join()

    def _write(self) -> None:
        runner = self._runner
        sent = (0, 0)  # the queue depth and running count the parent has
        while True:
            with self._ready:
                if not self._items and not self._closing:
                    # the counts change without an output too (a request taken off the queue, or
                    # ended after its last output was sent): while the parent's are not zero, look
                    # again now and then
                    self._ready.wait(self.LOAD_REFRESH_S if sent != (0, 0) else None)
                items, self._items = self._items, []
                closing = self._closing
            load = (runner.queue_depth, runner.running)
            try:
                if items or load != sent:
                    # the runner's failure, once it has one (an internal error whose probe failed too)
                    failure = runner.failure if runner.state == FAILED else None
                    self.send(("out", items, *load, failure))
                    sent = load
            except (BrokenPipeError, OSError):
                return  # the parent has gone
            if closing and not items:
                return


class _RelayedHandle(RequestHandle):
    """A request in the child: its outputs go to the outbox, tagged with the parent's id."""

    def __init__(self, jobs: Sequence[Job], rid: int, outbox: _Outbox, handles: dict[int, RequestHandle]) -> None:
        super().__init__(jobs, None)  # type: ignore[arg-type] - no loop: _push sends to the outbox
        self.rid = rid
        self._outbox = outbox
        self._handles = handles

    def _push(self, item: Output | None) -> None:
        if item is None:
            self._handles.pop(self.rid, None)
        self._outbox.put(self.rid, item)


def engine_main(spec: EngineSpec, runner_options: RunnerOptions, commands: Connection, results: Connection) -> None:
    """The engine process's body (module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        runner = runner_options.make(spec.make_generator, max_queue=_UNBOUNDED_QUEUE)
    except Exception as exc:  # noqa: BLE001 - reported as the engine's failure, not a bare exit code
        traceback.print_exc(file=sys.stderr)
        results.send(("state", FAILED, f"{type(exc).__name__}: {exc}", None, ""))
        return
    outbox = _Outbox(results, runner)
    runner.start()
    runner.wait_loaded()
    outbox.send(("state", runner.state, runner.failure, runner.sequence_limit, runner.describe()))
    handles: dict[int, RequestHandle] = {}
    timeout = 10.0
    while runner.state == READY:
        try:
            message = commands.recv()
        except (EOFError, OSError):
            break  # the parent has gone
        kind = message[0]
        if kind == "submit":
            _, rid, jobs = message
            handle = _RelayedHandle(jobs, rid, outbox, handles)
            handles[rid] = handle
            try:
                runner.enqueue(handle)
            except Exception as exc:  # noqa: BLE001 - refused (unavailable, full): the request's error
                handles.pop(rid, None)
                outbox.put(rid, Output(0, None, time.perf_counter(), error=exc))
                outbox.put(rid, None)
        elif kind == "cancel":
            handle = handles.get(message[1])
            if handle is not None:
                handle.cancel(message[2])
        elif kind == "cancel_all":
            runner.cancel_all(message[1])
        elif kind == "close":
            timeout = message[1]
            break
    runner.close(timeout)
    outbox.close()


# -- the parent --------------------------------------------------------------------------------


class ProcessScheduler(SchedulerStates):
    """The scheduler protocol over an engine process (module docstring) that runs ``runner`` over
    the Generator of the EngineSpec ``make_spec`` returns (called by ``start()``: the CLI resolves
    the package between making the server and starting it); ``max_queue``: requests that may wait,
    as in EngineThreadScheduler."""

    def __init__(
        self, make_spec: Callable[[], EngineSpec], runner: RunnerOptions | None = None, *, max_queue: int = 64
    ) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.max_queue = max_queue
        self._make_spec = make_spec
        self._runner = runner or RunnerOptions()
        self._state = LOADING
        self._failure: str | None = None
        self._text: PromptText | None = None
        self._sequence_limit: int | None = None
        self._description = "engine process"
        self._queue_depth = 0
        self._running = 0
        self._handles: dict[int, RequestHandle] = {}
        self._next_id = 0
        self._lock = threading.Lock()  # state, handles and ids
        self._sending = threading.Lock()  # one command at a time on the pipe (loop, main and reader threads)
        self._ready = threading.Event()
        self._process: Any = None
        self._commands: Connection | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> ProcessScheduler:
        spec = self._make_spec()
        context = multiprocessing.get_context("spawn")
        commands_in, commands_out = context.Pipe(duplex=False)
        results_in, results_out = context.Pipe(duplex=False)
        self._process = context.Process(
            target=engine_main, args=(spec, self._runner, commands_in, results_out), name="onnxgen-engine", daemon=True
        )
        self._process.start()
        commands_in.close()
        results_out.close()
        self._commands = commands_out
        self._reader = threading.Thread(
            target=self._read, args=(results_in, spec), name="onnxgen-engine-reader", daemon=True
        )
        self._reader.start()
        return self

    # -- the protocol ------------------------------------------------------------------------

    @property
    def generator(self) -> PromptText | None:
        """The package's text side (the engine's Generator lives in the engine process)."""
        return self._text if self._state == READY else None

    @property
    def queue_depth(self) -> int:
        return self._queue_depth

    @property
    def running(self) -> int:
        return self._running

    @property
    def sequence_limit(self) -> int | None:
        return self._sequence_limit

    def describe(self) -> str:
        return f"{self._description}, in an engine process"

    def submit(self, jobs: Sequence[Job], loop: asyncio.AbstractEventLoop) -> RequestHandle:
        if not jobs:
            raise ValueError("a request needs at least one job")
        handle = RequestHandle(jobs, loop)
        with self._lock:
            if self._state != READY:
                raise SchedulerUnavailableError(self._unavailable())
            waiting = len(self._handles) - self._running
            if waiting >= self.max_queue:
                raise QueueFullError(f"{waiting} requests are waiting already (--max-queue {self.max_queue})")
            rid = self._next_id
            self._next_id += 1
            self._handles[rid] = handle
            handle._on_cancel = lambda h: self._send(("cancel", rid, h.cancel_reason))
            self._send(("submit", rid, list(jobs)))
        return handle

    def cancel_all(self, reason: str) -> None:
        self._send(("cancel_all", reason))

    def close(self, timeout: float = 10.0) -> None:
        with self._lock:
            loading = self._state == LOADING
            if self._state in (LOADING, READY):
                self._state = CLOSED
        process = self._process
        if process is not None and process.is_alive():
            if loading:
                process.terminate()  # nothing admitted yet: no drain to wait for
            else:
                self._send(("close", timeout))
            process.join(timeout + 5.0)
            if process.is_alive():
                process.kill()
                process.join(5.0)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(5.0)
        self._end_all(RequestCancelledError("the server is shutting down"))
        self._ready.set()

    # -- internals ---------------------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        commands = self._commands
        if commands is None:
            return
        try:
            with self._sending:
                commands.send(message)
        except (BrokenPipeError, OSError):
            pass  # the engine process has ended: the reader reports it

    def _read(self, results: Connection, spec: EngineSpec) -> None:
        try:
            self._relay(results, spec)
        except Exception as exc:  # noqa: BLE001 - a bug here must not leave requests waiting forever
            traceback.print_exc(file=sys.stderr)
            self._engine_failed(f"internal error relaying the engine's outputs: {type(exc).__name__}: {exc}")
            self._end_all(SchedulerUnavailableError(self._unavailable()))
            self._process.terminate()
        self._engine_ended()

    def _relay(self, results: Connection, spec: EngineSpec) -> None:
        """Hands each message of the engine process to its handles, until the pipe closes."""
        while True:
            try:
                message = results.recv()
            except (EOFError, OSError):
                return
            if message[0] == "out":
                _, items, self._queue_depth, self._running, failure = message
                if failure is not None:
                    self._engine_failed(failure)
                for rid, item in items:
                    handle = self._handles.get(rid) if item is not None else self._handles.pop(rid, None)
                    if handle is not None:
                        handle._push(_decoded(item))
            elif message[0] == "state":
                self._loaded(spec, *message[1:])

    def _loaded(self, spec: EngineSpec, state: str, failure: str | None, limit: int | None, description: str) -> None:
        text = None
        if state == READY:
            try:
                text = PromptText(spec.package)
            except Exception as exc:  # noqa: BLE001 - the text side could not be read: the server cannot serve
                traceback.print_exc(file=sys.stderr)
                state, failure = FAILED, f"the package's text side could not be loaded: {type(exc).__name__}: {exc}"
        with self._lock:
            self._text, self._sequence_limit, self._description = text, limit, description
            if self._state == LOADING:
                self._state, self._failure = state, failure
        self._ready.set()

    def _engine_failed(self, failure: str) -> None:
        """The engine process's runner has failed (it refuses every request from now on)."""
        with self._lock:
            if self._state != READY:
                return
            self._state, self._failure = FAILED, failure
        print(f"onnxgen: the engine has failed: {failure}", file=sys.stderr, flush=True)

    def _engine_ended(self) -> None:
        process = self._process
        process.join(10.0)
        code = process.exitcode
        with self._lock:
            unexpected = self._state in (LOADING, READY)
            if unexpected:
                self._state = FAILED
                self._failure = self._failure or f"the engine process ended unexpectedly (exit code {code})"
        if unexpected:
            print(f"onnxgen: {self._failure}", file=sys.stderr, flush=True)
            self._end_all(SchedulerUnavailableError(self._unavailable()))
        self._ready.set()

    def _end_all(self, error: BaseException) -> None:
        """Every request still open ends with ``error`` (the engine will send nothing more)."""
        with self._lock:
            handles, self._handles = list(self._handles.values()), {}
        for handle in handles:
            handle._push(Output(0, None, time.perf_counter(), error=error))
            handle._push(None)
