"""Running the server: the listening socket, uvicorn, the engine thread, and a clean stop.

``Server(options, make_generator)`` binds its socket first (a port in use is one error line, before
any model is loaded), starts the scheduler (the model loads on the engine thread while the server
already answers /health with 503), and serves until ``stop()`` or SIGINT/SIGTERM.

Stopping: the first signal (or ``stop()``) stops accepting connections and starts the drain: new
requests get 503, admitted ones run on for ``shutdown_grace_s``, then the scheduler cuts whatever
is left (a stream ends with an error event and ``[DONE]``, a waiting request gets a 503). uvicorn
waits for the connections to finish, the scheduler is closed, and ``run()`` returns 0; a second
SIGINT stops at once. uvicorn re-raises the signal it caught once it is done; the handlers
installed around ``run()`` take that re-raise, so the process ends with its own status and no
traceback.

Threads: uvicorn's event loop runs on the caller's thread (the main thread for the CLI, so it can
take the signals; tests run it on another), the Generator on the scheduler's engine thread, or, with
``engine_spec`` given and ``ServeOptions.in_engine_process``, in an engine process of its own
(genai/engine_process.py), which the Server starts and stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import uvicorn

from onnxgen.errors import OnnxgenError
from onnxgen.genai.engine_process import EngineSpec, ProcessScheduler
from onnxgen.genai.scheduler import FAILED, LOADING, EngineThreadScheduler
from onnxgen.server.app import ServerState, create_app
from onnxgen.server.options import ServeOptions

if TYPE_CHECKING:
    from onnxgen.genai.generator import Generator


def _eprint(line: str) -> None:
    print(f"onnxgen serve: {line}", file=sys.stderr, flush=True)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket. Made with proto IPPROTO_TCP, not 0: asyncio turns Nagle's algorithm off
    (TCP_NODELAY) only on sockets that say they are TCP, and with Nagle on, each small write after
    the first (a response's body after its headers, every SSE chunk) waits for the client's
    delayed ACK."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OnnxgenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, whose signal handler also starts the drain."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame) -> None:  # noqa: ANN001
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first:
            self._on_exit()


class Server:
    def __init__(
        self,
        options: ServeOptions,
        make_generator: Callable[[], Generator] | None,
        *,
        announce: bool = True,
        engine_spec: Callable[[], EngineSpec] | None = None,
        listening: socket.socket | None = None,
    ) -> None:
        """``make_generator`` builds the Generator on the engine thread; ``engine_spec`` says what an
        engine process builds instead, where ``options.in_engine_process`` (one of the two may be
        None where the options leave no choice). ``listening``: a socket already bound (``bind``),
        for a caller that must hold its port before it knows its options."""
        in_process = engine_spec is not None and options.in_engine_process
        if options.engine_process is True and engine_spec is None:
            raise ValueError("engine_process=True needs an engine_spec (what the engine process builds)")
        if not in_process and make_generator is None:
            raise ValueError("the engine runs on a thread here (engine_process off), which needs make_generator")
        self.options = options
        self.announce = announce
        self.socket = listening if listening is not None else bind(options.host, options.port)
        self.port = self.socket.getsockname()[1]
        self.scheduler: EngineThreadScheduler | ProcessScheduler
        if in_process:
            self.scheduler = ProcessScheduler(engine_spec, options.runner, max_queue=options.max_queue)
        else:
            self.scheduler = options.runner.make(make_generator, max_queue=options.max_queue)
        self.state = ServerState(options, self.scheduler)
        self.fatal: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.started = threading.Event()  # the loop runs and the socket accepts
        app = create_app(self.state, lifespan=self._lifespan)
        config = uvicorn.Config(
            app,
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="on",
            server_header=False,
            timeout_graceful_shutdown=int(options.shutdown_grace_s) + 5,
        )
        self.uvicorn = _Uvicorn(config, self.stop)

    @property
    def url(self) -> str:
        host = f"[{self.options.host}]" if ":" in self.options.host else self.options.host
        return f"http://{host}:{self.port}"

    @contextlib.asynccontextmanager
    async def _lifespan(self, app) -> AsyncIterator[None]:  # noqa: ANN001
        self._loop = asyncio.get_running_loop()
        watch = asyncio.ensure_future(self._watch_load())
        self.started.set()
        try:
            yield
        finally:
            watch.cancel()

    async def _watch_load(self) -> None:
        if self.announce:
            _eprint(f"listening on {self.url} (model {self.options.model_name!r} loading; GET /health says when ready)")
        while self.scheduler.state == LOADING:
            await asyncio.sleep(0.05)
        if self.scheduler.state == FAILED:
            self.fatal = f"the model could not be loaded: {self.scheduler.failure}"
            _eprint(f"error: {self.fatal}")
            self.uvicorn.should_exit = True
        elif self.announce:
            where = f"{self.options.device} at {self.url}/v1"
            _eprint(f"ready: {self.options.model_name!r} on {where} ({self._batching()})")

    def _batching(self) -> str:
        return self.scheduler.describe()

    def stop(self) -> None:
        """Start the drain (any thread, a signal handler too); uvicorn stops as its signal does."""
        self.uvicorn.should_exit = True
        loop = self._loop
        if loop is not None and not self.state.draining:
            with contextlib.suppress(RuntimeError):  # the loop has closed already
                loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        if self.state.draining:
            return
        self.state.draining = True
        busy = self.scheduler.running + self.scheduler.queue_depth
        grace = self.options.shutdown_grace_s
        if self.announce:
            _eprint(f"stopping: {busy} request(s) admitted; those still running in {grace:g} s are cut")
        asyncio.get_running_loop().call_later(grace, self.scheduler.cancel_all, "the server is shutting down")

    def run(self) -> int:
        """Serve until stopped; 0, or 2 when the model could not be loaded."""
        self.scheduler.start()
        previous = {}
        on_main = threading.current_thread() is threading.main_thread()
        if on_main:  # take uvicorn's re-raise of the signal it handled (module docstring)
            previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.uvicorn.run(sockets=[self.socket])
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.scheduler.close(timeout=10.0)
            self.socket.close()
        if self.announce:
            _eprint("stopped")
        return 2 if self.fatal else 0
