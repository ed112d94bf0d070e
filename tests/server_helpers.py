"""Shared by the server tests: a tiny random-weights package with SmolLM2's real tokenizer, an
in-process server on a free loopback port, and raw HTTP on loopback (every call has a timeout)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import http.client
import json
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

HOST = "127.0.0.1"
TIMEOUT_S = 30.0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def smollm2_int4() -> Path:
    """The real SmolLM2 int4 package (pulled once, then cached under $ONNXGEN_HOME)."""
    from onnxgen.models.pull import ensure_package

    return ensure_package("smollm2-135m-instruct", precision="int4", device="cpu", attention="gqa")


def build_tiny_package(directory: Path, tokenizer_from: Path, context: int = 256) -> Path:
    """A 3-layer random-weights llama with SmolLM2's vocabulary size (49152) and its tokenizer files,
    so text goes in and out as with the real model, at a fraction of the cost; ``context`` tokens."""
    from onnxgen.models.builder import build_package
    from onnxgen.models.random_source import TINY_CONFIGS, RandomSource

    config = replace(
        TINY_CONFIGS["tiny-llama"], vocab_size=49152, max_position_embeddings=context, eos_token_id=[2],
        name="tiny-llama-smollm2-vocab",
    )  # fmt: skip
    package = build_package(RandomSource(config), directory)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, package / name)
    return package


@functools.cache
def tiny_package() -> Path:
    """``build_tiny_package`` once per test process, in a directory removed at exit."""
    import pytest

    from onnxgen.errors import RegistryUnreachableError

    try:
        tokenizer_from = smollm2_int4()
    except RegistryUnreachableError as exc:  # the only acceptable reason to skip (as conftest's fixture)
        pytest.skip(f"cannot pull the default model for its tokenizer: {exc}")
    directory = Path(tempfile.mkdtemp(prefix="onnxgen-tiny-server-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return build_tiny_package(directory / "tiny", tokenizer_from)


@contextlib.contextmanager
def running_server(
    options, make_generator: Callable | None, ready_timeout_s: float = 120.0, engine_spec: Callable | None = None
) -> Iterator:
    """An ``onnxgen.server.serve.Server`` on its own thread until the block ends; yields it once its
    model is loaded (state READY). With ``engine_spec`` (and options that ask for it) the engine
    runs in a process of its own."""
    from onnxgen.server.serve import Server

    server = Server(options, make_generator, announce=False, engine_spec=engine_spec)
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(server.run()), name="test-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + ready_timeout_s
        while server.scheduler.state == "loading" or not server.started.is_set():
            assert time.monotonic() < deadline, "the server did not load its model in time"
            assert thread.is_alive(), "the server thread ended"
            time.sleep(0.02)
        assert server.scheduler.state == "ready", server.scheduler.failure
        yield server
    finally:
        server.stop()
        thread.join(30)
        assert not thread.is_alive(), "the server did not stop within 30 s"


def request(
    port: int,
    method: str,
    path: str,
    body: bytes | dict | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = TIMEOUT_S,
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request on a fresh connection: (status, headers lower-cased, body)."""
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    connection = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def post(port: int, path: str, body: bytes | dict, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    """POST JSON; (status, decoded JSON body)."""
    status, _, data = request(port, "POST", path, body, {"content-type": "application/json", **(headers or {})})
    return status, json.loads(data)


def sse_events(data: bytes) -> list[bytes]:
    """The payloads of a text/event-stream body, checked for framing: every event is exactly one
    ``data: `` line ended by a blank line, the body ends with ``data: [DONE]``."""
    assert data.endswith(b"data: [DONE]\n\n"), data[-200:]
    events = data.split(b"\n\n")
    assert events[-1] == b""
    payloads = []
    for event in events[:-1]:
        assert event.startswith(b"data: ") and b"\n" not in event, event[:200]
        payloads.append(event[len(b"data: ") :])
    return payloads
