"""The HTTP routes of `onnxgen serve` (Starlette), over a ``Scheduler``.

Routes: POST /v1/chat/completions, /v1/completions, /tokenize, /detokenize; GET /v1/models,
/v1/models/{id}, /health, /metrics, and the chat page at /. Every answer that is not a success is
OpenAI's error envelope (errors.py), 404 and 405 of unknown routes included; no request can raise
out of a route: an unexpected exception is printed with its traceback on stderr and answered 500.

Per request: the API key (when set) is checked first, then the body is read up to
``max_body_bytes`` (413 past it, checked against Content-Length before reading), parsed and
validated (protocol.py), the model name checked (404), the prompt tokenized and checked against
the context off the event loop (jobs.py), and the request submitted to the scheduler (503 with
Retry-After when its queue is full, while the model loads, or while the server drains at
shutdown). ``AccessLog`` prints one line per request on stderr and counts it in the metrics.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.resources
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from onnxgen.genai.scheduler import (
    FAILED,
    LOADING,
    READY,
    QueueFullError,
    Scheduler,
    SchedulerUnavailableError,
)
from onnxgen.server.errors import AUTHENTICATION, NOT_FOUND, ApiError, internal, invalid, unavailable
from onnxgen.server.jobs import build_plan
from onnxgen.server.metrics import Metrics
from onnxgen.server.options import ServeOptions
from onnxgen.server.pacing import StreamPacing
from onnxgen.server.protocol import parse_chat, parse_completion, parse_detokenize, parse_object, parse_tokenize
from onnxgen.server.relay import EventStream, Relay
from onnxgen.server.responses import Envelope, dumps, model_card
from onnxgen.server.token_text import TokenText

PROTECTED = ("/v1/", "/tokenize", "/detokenize")
ENDPOINTS = {
    "/", "/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize",
}  # fmt: skip


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(body), status, headers=headers, media_type="application/json")


def error_response(error: ApiError) -> Response:
    return Response(error.json_bytes(), error.status, headers=error.headers, media_type="application/json")


class ServerState:
    """What the routes share: the options, the scheduler, the metrics, whether the server drains."""

    def __init__(self, options: ServeOptions, scheduler: Scheduler) -> None:
        self.options = options
        self.scheduler = scheduler
        self.metrics = Metrics(lambda: scheduler.queue_depth, lambda: scheduler.running)
        self.pacing = StreamPacing(options.stream_interval_s, options.max_chunk_rate)
        self.created = int(time.time())
        self.draining = False
        self._token_text: TokenText | None = None
        self._page: bytes | None = None

    def token_text(self) -> TokenText:
        if self._token_text is None:
            self._token_text = TokenText(self.ready_generator().tokenizer.backend)
        return self._token_text

    def ready_generator(self):
        """The loaded Generator, or a 503 that says why there is none."""
        if self.draining:
            raise unavailable("the server is shutting down", code="server_shutting_down")
        generator = self.scheduler.generator
        if generator is None:
            state = self.scheduler.state
            if state == LOADING:
                raise unavailable("the model is still loading; retry shortly", retry_after_s=5, code="model_loading")
            if state == FAILED:
                raise unavailable(f"the engine has failed: {self.scheduler.failure}", code="engine_failed")
            raise unavailable("the server is shutting down", code="server_shutting_down")
        return generator

    def page(self) -> bytes:
        if self._page is None:
            resource = importlib.resources.files("onnxgen.server").joinpath("static/index.html")
            try:
                self._page = resource.read_bytes()
            except FileNotFoundError:
                raise ApiError(404, "the chat page is not installed", type=NOT_FOUND) from None
        return self._page


def _api(handler: Callable[[ServerState, Request], Awaitable[Any]], state: ServerState):
    """A route: ApiError -> its envelope; any other exception -> 500, traceback on stderr only."""

    async def endpoint(request: Request) -> Any:
        try:
            return await handler(state, request)
        except ApiError as error:
            return error_response(error)
        except ClientDisconnect:
            return error_response(invalid("the client disconnected before sending the whole body"))
        except Exception:  # noqa: BLE001 - the next request must be served
            print(f"onnxgen serve: internal error in {request.method} {request.url.path}:", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
            return error_response(internal())

    return endpoint


def authorize(state: ServerState, request: Request) -> None:
    key = state.options.api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "missing API key: send the header 'Authorization: Bearer KEY'", type=AUTHENTICATION,
                       code="invalid_api_key")  # fmt: skip
    if not hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"), key.encode()):
        raise ApiError(401, "incorrect API key", type=AUTHENTICATION, code="invalid_api_key")


def too_large(message: str) -> ApiError:
    """413; the connection is closed after it, as the rest of the body is not read."""
    return ApiError(413, message, code="request_too_large", headers={"connection": "close"})


async def read_body(state: ServerState, request: Request) -> bytes:
    limit = state.options.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise invalid(f"Content-Length must be a number of bytes, got {declared[:32]!r}")
        if int(declared) > limit:
            raise too_large(f"the body is {declared} bytes; this server takes at most {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(f"the body is over {limit} bytes, the most this server takes")
        chunks.append(chunk)
    return b"".join(chunks)


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.options.model_name:
        raise ApiError(
            404,
            f"the model {model!r} does not exist here; this server serves {state.options.model_name!r}",
            type=NOT_FOUND,
            param="model",
            code="model_not_found",
        )


async def _generation(state: ServerState, request: Request, kind: str) -> Any:
    arrival = time.perf_counter()
    authorize(state, request)
    body = parse_object(await read_body(state, request))
    max_choices = state.options.max_choices
    parsed = parse_chat(body, max_choices) if kind == "chat" else parse_completion(body, max_choices)
    check_model(state, parsed.model)
    generator = state.ready_generator()
    tokens = state.token_text()
    plan = await asyncio.to_thread(build_plan, generator, parsed, state.scheduler.sequence_limit)
    try:
        handle = state.scheduler.submit(plan.jobs, asyncio.get_running_loop())
    except QueueFullError as exc:
        raise unavailable(f"the server is busy: {exc}; retry shortly", code="queue_full") from None
    except SchedulerUnavailableError as exc:
        raise unavailable(str(exc)) from None
    info = request.scope.setdefault("onnxgen", {})
    envelope = Envelope(kind, state.options.model_name, parsed.include_usage)
    relay = Relay(handle, plan, parsed, envelope, state.metrics, tokens, info.get("start", arrival), info, state.pacing)
    if parsed.stream:
        return EventStream(relay)
    return json_response(await relay.collect(request.receive))


async def chat_completions(state: ServerState, request: Request) -> Any:
    return await _generation(state, request, "chat")


async def completions(state: ServerState, request: Request) -> Any:
    return await _generation(state, request, "completion")


async def tokenize(state: ServerState, request: Request) -> Any:
    authorize(state, request)
    parsed = parse_tokenize(parse_object(await read_body(state, request)))
    check_model(state, parsed.model)
    generator = state.ready_generator()

    def run() -> list[int]:
        if parsed.messages is not None:
            text = generator.apply_chat_template(parsed.messages)
        else:
            text = parsed.prompt
        return generator.tokenizer.encode(text, add_special_tokens=parsed.add_special_tokens)

    try:
        ids = await asyncio.to_thread(run)
    except Exception as exc:  # noqa: BLE001 - a template that refuses the messages
        from onnxgen.genai.chat import ChatTemplateError

        if isinstance(exc, ChatTemplateError):
            raise invalid(str(exc), "messages") from None
        raise
    context = generator.config.context_length
    return json_response({"count": len(ids), "max_model_len": context, "tokens": ids})


async def detokenize(state: ServerState, request: Request) -> Any:
    authorize(state, request)
    model, ids = parse_detokenize(parse_object(await read_body(state, request)))
    check_model(state, model)
    generator = state.ready_generator()
    vocab = generator.config.vocab_size
    for index, token in enumerate(ids):
        if not 0 <= token < vocab:
            raise invalid(f"tokens[{index}] is {token}, outside the vocabulary [0, {vocab})", "tokens")
    return json_response({"prompt": generator.tokenizer.decode(ids, skip_special_tokens=False)})


async def models(state: ServerState, request: Request) -> Any:
    authorize(state, request)
    return json_response({"object": "list", "data": [model_card(state.options.model_name, state.created)]})


async def model(state: ServerState, request: Request) -> Any:
    authorize(state, request)
    name = request.path_params["model"]
    check_model(state, name)
    return json_response(model_card(name, state.created))


async def health(state: ServerState, request: Request) -> Any:
    scheduler = state.scheduler
    status = "draining" if state.draining else scheduler.state
    body: dict[str, Any] = {"status": status}
    if scheduler.state == FAILED:
        body["error"] = scheduler.failure
    ok = status == READY
    return json_response(body, 200 if ok else 503, None if ok else {"retry-after": "5"})


async def metrics(state: ServerState, request: Request) -> Any:
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def page(state: ServerState, request: Request) -> Any:
    return Response(state.page(), media_type="text/html; charset=utf-8")


class AccessLog:
    """Pure ASGI middleware: one stderr line per request (method, path, status, time; tokens and
    time to first token for generations) and the request counted in the metrics. Paths that are
    not endpoints are counted as "other", so the label's values stay few whatever clients send."""

    def __init__(self, app: Callable, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        info: dict[str, Any] = {"start": start}
        scope["onnxgen"] = info
        status = 0

        async def send_status(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            elapsed = time.perf_counter() - start
            path = scope.get("path", "")
            endpoint = path if path in ENDPOINTS else "/v1/models" if path.startswith("/v1/models/") else "other"
            self.state.metrics.count_request(endpoint, status or 500)
            self.state.metrics.duration.observe(elapsed)
            client = scope.get("client") or ("-", 0)
            shown = path if len(path) <= 80 else path[:77] + "..."
            line = f'onnxgen serve: {client[0]}:{client[1]} "{scope.get("method")} {shown}" {status or "-"} '
            line += f"{elapsed * 1000:.1f} ms"
            if "prompt" in info:
                line += f" prompt={info['prompt']} completion={info.get('completion', 0)}"
            if "ttft" in info:
                line += f" ttft={info['ttft'] * 1000:.1f}ms"
            if "finish" in info:
                line += f" finish={','.join(info['finish'])}"
            print(line.encode("ascii", "backslashreplace").decode(), file=sys.stderr, flush=True)


def create_app(state: ServerState, lifespan: Callable | None = None) -> Starlette:
    def route(path: str, handler: Callable, methods: list[str]) -> Route:
        return Route(path, _api(handler, state), methods=methods)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            error = ApiError(404, f"no route {request.url.path[:80]!r}", type=NOT_FOUND)
        elif exc.status_code == 405:
            error = ApiError(405, f"method {request.method} is not allowed on {request.url.path[:80]!r}")
        else:
            error = ApiError(exc.status_code, str(exc.detail))
        return error_response(error)

    app = Starlette(
        routes=[
            route("/v1/chat/completions", chat_completions, ["POST"]),
            route("/v1/completions", completions, ["POST"]),
            route("/tokenize", tokenize, ["POST"]),
            route("/detokenize", detokenize, ["POST"]),
            route("/v1/models", models, ["GET"]),
            route("/v1/models/{model:path}", model, ["GET"]),
            route("/health", health, ["GET"]),
            route("/metrics", metrics, ["GET"]),
            route("/", page, ["GET"]),
        ],
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
    )
    app.add_middleware(AccessLog, state=state)
    return app
