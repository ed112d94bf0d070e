"""`onnxgen serve` as a process: it listens, loads, serves, and stops cleanly on SIGTERM and SIGINT
while streams run (each stream ends complete or with an error event, then [DONE]; exit status 0; no
traceback). In-process: /health and requests say 503 while the model loads, a load failure ends
the server with status 2, and a port in use is one error line before anything loads."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.server_helpers import HOST, post, request, running_server, sse_events, tiny_package

ONNXGEN = [sys.executable, "-m", "onnxgen"]


def start(*extra: str, session: bool = False, model: Path | None = None) -> tuple[subprocess.Popen, int, list[str]]:
    """`onnxgen serve` on ``model`` (default: the tiny package) and a free port; returns once it says
    it is ready (its stderr lines are collected by a thread). ``session``: in a process group of its
    own, as a shell runs a foreground job (a terminal's Ctrl-C reaches every process of the group)."""
    process = subprocess.Popen(
        [*ONNXGEN, "serve", "--model", str(model or tiny_package()), "--port", "0", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=session,
    )  # fmt: skip
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(process.stderr.readline, "")), daemon=True).start()
    deadline = time.monotonic() + 90
    port = None
    while time.monotonic() < deadline and process.poll() is None:
        text = "".join(lines)
        match = re.search(r"listening on http://127\.0\.0\.1:(\d+)", text)
        if match and "ready:" in text:
            port = int(match.group(1))
            break
        time.sleep(0.05)
    if port is None:
        process.kill()
        pytest.fail(f"onnxgen serve did not get ready: {''.join(lines)[-2000:]}")
    return process, port, lines


def streams_during(process: subprocess.Popen, port: int, sig: int, batched: bool = False) -> list[tuple[int, bytes]]:
    """Three long streams: the first until it has sent a token, then two more until /metrics shows
    them queued behind it (``batched``: until each has sent a token), then the signal. Returns each
    stream's status and whole body, in the order the streams were sent."""
    body = json.dumps({"prompt": "a", "max_tokens": 250, "ignore_eos": True, "temperature": 0, "stream": True})
    bodies: dict[int, tuple[int, bytes]] = {}
    first_token = threading.Event()
    started: set[int] = set()

    def client(index: int) -> None:
        connection = http.client.HTTPConnection(HOST, port, timeout=60)
        try:
            connection.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
            response = connection.getresponse()
            data = b""
            while chunk := response.read1(65536):
                data += chunk
                if b"data: {" in data:  # a completion's first chunk carries its first token
                    first_token.set()
                    started.add(index)
            bodies[index] = (response.status, data)
        finally:
            connection.close()

    def queued() -> int:
        _, _, text = request(port, "GET", "/metrics")
        match = re.search(rb"^onnxgen_queue_depth (\d+)", text, re.M)
        return int(match.group(1)) if match else 0

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    threads[0].start()
    assert first_token.wait(60), "the first stream sent no token"
    for thread in threads[1:]:
        thread.start()
    deadline = time.monotonic() + 30
    while (len(started) < 3 if batched else queued() < 2) and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(sig)
    for thread in threads:
        thread.join(60)
    return [bodies[i] for i in sorted(bodies)]


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        if re.search(rf"^PPid:\s+{pid}$", text, re.M):
            found.append(int(status.parent.name))
    return found


def _ends(pid: int, within_s: float) -> bool:
    """Whether process ``pid`` is gone (or a zombie) within ``within_s``: multiprocessing's resource
    tracker notices its parent's exit through a closed pipe, a moment after the parent has ended."""
    deadline = time.monotonic() + within_s
    while True:
        status = Path(f"/proc/{pid}/status")
        try:
            if "State:\tZ" in status.read_text():
                return True
        except FileNotFoundError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


@pytest.mark.parametrize(
    "sig,batch,engine",
    [(signal.SIGTERM, 1, "off"), (signal.SIGINT, 1, "off"), (signal.SIGTERM, 8, "off"), (signal.SIGINT, 8, "on")],
)
def test_a_signal_during_streams_stops_cleanly(sig: int, batch: int, engine: str) -> None:
    """With the engine in a process of its own, SIGINT goes to the whole process group, as a
    terminal's Ctrl-C does: the engine process ignores it, the server drains and closes it."""
    in_process = engine == "on"
    process, port, lines = start(
        "--shutdown-grace", "0.2", "--max-num-seqs", str(batch), "--engine-process", engine, session=in_process
    )
    engines = children(process.pid) if in_process else []
    try:
        if in_process:
            assert engines, "no engine process"  # (and multiprocessing's resource tracker)
            signal_group = process.send_signal
            process.send_signal = lambda s: os.killpg(process.pid, s)  # type: ignore[method-assign]
        bodies = streams_during(process, port, sig, batched=batch > 1)
        if in_process:
            process.send_signal = signal_group  # type: ignore[method-assign]
        code = process.wait(30)
    finally:
        if process.poll() is None:
            process.kill()
    log = "".join(lines)
    assert code == 0, log[-2000:]
    assert "Traceback" not in log and "stopped" in log
    for pid in engines:  # the engine process (and the tracker) end with the server
        assert _ends(pid, within_s=5.0), Path(f"/proc/{pid}/cmdline").read_bytes()
    assert len(bodies) == 3
    outcomes = []
    for status, data in bodies:  # every stream is whole: finished, or cut with an error event
        if status == 503:  # cut before its first token: a plain error answer
            assert json.loads(data)["error"]["code"] == "server_shutting_down"
            outcomes.append("refused")
            continue
        assert status == 200
        events = [json.loads(p) for p in sse_events(data)[:-1]]
        last = events[-1]
        if "error" in last:
            assert "shutting down" in last["error"]["message"]
            outcomes.append("cut")
        else:
            assert last["choices"][0]["finish_reason"] == "length"
            outcomes.append("done")
    if batch > 1:  # all three had begun together: each is streamed whole (cut, or done on a fast machine)
        assert set(outcomes) <= {"cut", "done"}, outcomes
        return
    # the first had begun, so it is streamed (cut or, on a fast machine, done); 0.2 s of grace cannot
    # also finish the two queued 250-token streams
    assert outcomes[0] in ("cut", "done") and len(set(outcomes)) > 1, outcomes


def test_a_port_in_use_is_one_error_line() -> None:
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [*ONNXGEN, "serve", "--model", str(tiny_package()), "--port", str(port)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"onnxgen: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]


def test_loading_answers_503_then_ready() -> None:
    from onnxgen.genai.generator import Generator
    from onnxgen.server.options import ServeOptions
    from onnxgen.server.serve import Server

    gate = threading.Event()

    def slow() -> Generator:
        assert gate.wait(30)
        return Generator(tiny_package(), device="cpu")

    server = Server(ServeOptions(model_name="tiny", port=0), slow, announce=False)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert server.started.wait(30)
        status, headers, body = request(server.port, "GET", "/health")
        assert status == 503 and json.loads(body) == {"status": "loading"} and headers["retry-after"]
        status, body = post(server.port, "/v1/completions", {"prompt": "a", "max_tokens": 1})
        assert status == 503 and body["error"]["code"] == "model_loading"
        gate.set()
        for _ in range(600):
            if request(server.port, "GET", "/health")[0] == 200:
                break
            time.sleep(0.05)
        assert post(server.port, "/v1/completions", {"prompt": "a", "max_tokens": 1})[0] == 200
    finally:
        gate.set()
        server.stop()
        thread.join(30)


def test_a_load_failure_ends_the_server_with_status_2() -> None:
    from onnxgen.errors import ModelLoadError
    from onnxgen.server.options import ServeOptions
    from onnxgen.server.serve import Server

    def broken():
        raise ModelLoadError("model.onnx is damaged")

    server = Server(ServeOptions(model_name="x", port=0), broken, announce=False)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(server.run()), daemon=True)
    thread.start()
    thread.join(30)
    assert result == [2] and server.fatal == "the model could not be loaded: model.onnx is damaged"


def test_the_served_name_and_options_come_from_the_flags() -> None:
    """--served-model-name and --api-key reach the server (a subprocess would cost a load: the
    parser and ServeOptions are checked instead, and bad values are one error line)."""
    from onnxgen.cli import build_parser, main

    args = build_parser().parse_args(
        ["serve", "--model", str(tiny_package()), "--served-model-name", "mine", "--api-key", "k", "--max-queue", "3"]
    )
    assert (args.served_model_name, args.api_key, args.max_queue, args.host, args.port) == ("mine", "k", 3, HOST, 8000)
    assert main(["serve", "--model", str(tiny_package()), "--max-queue", "0"]) == 2
    assert Path(tiny_package()).name == "tiny"


def test_served_in_process_with_a_served_name() -> None:
    from onnxgen.genai.generator import Generator
    from onnxgen.server.options import ServeOptions

    with running_server(ServeOptions(model_name="mine", port=0), lambda: Generator(tiny_package())) as server:
        assert json.loads(request(server.port, "GET", "/v1/models")[2])["data"][0]["id"] == "mine"
        assert post(server.port, "/v1/completions", {"model": "tiny", "prompt": "a"})[0] == 404
