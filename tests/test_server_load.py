"""onnxgen serve under load and faults (tiny random-weights model, loopback, bounded in count and
time): 16 clients at once, clients that disconnect (streamed, collected, still queued), a queue
that overflows (503 + Retry-After), and memory that stays flat over 500 requests.

The generator is wrapped to count the tokens it produces and, where a test needs time to act
mid-generation, to pace them (``pace_s``): a disconnect must stop the engine at its next token.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest

from tests.server_helpers import HOST, post, request, running_server, sse_events, tiny_package

MODEL = "tiny"


class Paced:
    """Counts tokens produced by the wrapped Generator's events; sleeps ``pace_s`` before each."""

    def __init__(self) -> None:
        self.pace_s = 0.0
        self.produced = 0


def make_server(max_queue: int = 64, max_num_seqs: int = 1):
    """A server on the tiny package whose engine counts (and paces) every token it hands out, through
    either runner: one request at a time (1) or continuous batching (more)."""
    from onnxgen.genai.generator import Generator
    from onnxgen.server.options import ServeOptions

    paced = Paced()

    def make():
        generator = Generator(tiny_package(), device="cpu")
        took = generator.engine._took

        def counted(sequence, token_id):  # both runners hand each token out through the engine's _took
            if paced.pace_s:
                time.sleep(paced.pace_s)
            paced.produced += 1
            took(sequence, token_id)

        generator.engine._took = counted
        return generator

    options = ServeOptions(model_name=MODEL, port=0, max_queue=max_queue, max_num_seqs=max_num_seqs)
    return paced, running_server(options, make)


@pytest.fixture(scope="module", params=[1, 2], ids=["serial", "batched"])
def served(request):
    paced, context = make_server(max_num_seqs=request.param)
    with context as server:
        yield server, paced


def wait_idle(server, timeout_s: float = 5.0) -> float:
    start = time.monotonic()
    while server.scheduler.running or server.scheduler.queue_depth:
        assert time.monotonic() - start < timeout_s, "the engine is still busy"
        time.sleep(0.005)
    return time.monotonic() - start


def stream_then_drop(port: int, body: dict, events_before_drop: int) -> None:
    """Opens a streamed request, reads that many SSE events (0: none), and closes the socket."""
    data = json.dumps({**body, "stream": True}).encode()
    sock = socket.create_connection((HOST, port), timeout=10)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
    )
    sock.sendall(head.encode() + b"\r\n" + data)
    seen = b""
    while seen.count(b"data: ") < events_before_drop:
        chunk = sock.recv(4096)
        assert chunk, "the server closed the stream"
        seen += chunk
    sock.close()


def test_sixteen_clients_at_once_all_answered_in_full(served) -> None:
    server, paced = served
    port = server.port
    greedy = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    kinds = [
        ("/v1/completions", {**greedy, "prompt": "one two"}),
        ("/v1/chat/completions", {**greedy, "messages": [{"role": "user", "content": "hi"}]}),
    ]
    expected = {}
    for path, body in kinds:
        expected[path] = post(port, path, body)[1]["choices"][0]
    results: list[tuple] = []
    deadline = time.monotonic() + 4.0

    def client(number: int) -> None:
        for round_ in range(12):
            if time.monotonic() > deadline:
                return
            path, body = kinds[(number + round_) % 2]
            stream = (number + round_) % 3 == 0
            status, headers, data = request(port, "POST", path, {**body, "stream": stream})
            results.append((path, stream, status, data))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads)
    assert len(results) >= 32
    for path, stream, status, data in results:
        assert status == 200, data[:300]
        want = expected[path]
        if stream:
            chunks = [json.loads(p) for p in sse_events(data)[:-1]]
            key = "text" if path == "/v1/completions" else "delta"
            text = "".join(c["choices"][0][key] if key == "text" else c["choices"][0][key].get("content", "")
                           for c in chunks)  # fmt: skip
            assert chunks[-1]["choices"][0]["finish_reason"] == want["finish_reason"]
        else:
            choice = json.loads(data)["choices"][0]
            text = choice.get("text", choice.get("message", {}).get("content"))
            assert choice["finish_reason"] == want["finish_reason"]
        assert text == want.get("text", want.get("message", {}).get("content"))  # greedy: same text for all
    wait_idle(server)


def test_a_client_that_disconnects_stops_its_generation(served) -> None:
    server, paced = served
    port = server.port
    long = {"model": MODEL, "prompt": "a b", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    paced.pace_s = 0.01  # 200 tokens would take 2 s
    try:
        before = paced.produced
        stream_then_drop(port, long, events_before_drop=3)  # streamed: gone after 3 events
        assert wait_idle(server) < 1.0
        assert paced.produced - before < 40, "the engine kept decoding for a client that had gone"

        before = paced.produced
        connection = http.client.HTTPConnection(HOST, port, timeout=10)  # collected: gone while it waits
        connection.request(
            "POST", "/v1/completions", json.dumps({**long, "stream": False}), {"content-type": "application/json"}
        )
        time.sleep(0.15)
        connection.close()
        assert wait_idle(server) < 1.0
        assert paced.produced - before < 50

        # queued: running requests fill the engine; the queued one disconnects and frees its place
        slots = server.options.batch_size
        holders = [
            threading.Thread(target=post, args=(port, "/v1/completions", {**long, "max_tokens": 60}))
            for _ in range(slots)
        ]
        for holder in holders:
            holder.start()
        while server.scheduler.running < slots:
            time.sleep(0.005)
        stream_then_drop(port, long, events_before_drop=0)
        for _ in range(200):
            if server.scheduler.queue_depth == 0:
                break
            time.sleep(0.005)
        assert server.scheduler.queue_depth == 0 and server.scheduler.running == slots
        for holder in holders:
            holder.join(20)
    finally:
        paced.pace_s = 0.0
    before = paced.produced
    status, body = post(port, "/v1/completions", {**long, "max_tokens": 3})
    assert status == 200 and paced.produced - before == 3  # the dropped request never ran


@pytest.mark.parametrize("max_num_seqs", [1, 2])
def test_the_queue_overflows_with_503_and_retry_after(max_num_seqs: int) -> None:
    paced, context = make_server(max_queue=2, max_num_seqs=max_num_seqs)
    with context as server:
        paced.pace_s = 0.01
        body = {"model": MODEL, "prompt": "a", "max_tokens": 20, "ignore_eos": True, "temperature": 0}
        answers: list[tuple] = []

        def client() -> None:
            answers.append(request(server.port, "POST", "/v1/completions", body))

        threads = [threading.Thread(target=client) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        statuses = sorted(status for status, _, _ in answers)
        assert len(answers) == 8 and statuses[0] == 200 and statuses[-1] == 503, statuses
        for status, headers, data in answers:
            if status == 503:
                error = json.loads(data)["error"]
                assert error["code"] == "queue_full" and headers["retry-after"].isdigit(), data
        paced.pace_s = 0.0
        assert post(server.port, "/v1/completions", {**body, "max_tokens": 2})[0] == 200
        _, _, metrics = request(server.port, "GET", "/metrics")
        assert 'onnxgen_requests_total{endpoint="/v1/completions",status="503"}' in metrics.decode()


def rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_memory_stays_flat_over_500_requests(served) -> None:
    server, _ = served
    connection = http.client.HTTPConnection(HOST, server.port, timeout=10)
    bodies = [
        ("/v1/completions", {"model": MODEL, "prompt": "x y", "max_tokens": 2}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True, "logprobs": 2}),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}),  # a 400
    ]
    baseline = 0
    start = time.monotonic()
    try:
        for number in range(500):
            path, body = bodies[number % len(bodies)]
            connection.request("POST", path, json.dumps(body), {"content-type": "application/json"})
            response = connection.getresponse()
            response.read()
            assert response.status in (200, 400)
            if number == 49:
                baseline = rss_kib()
            assert time.monotonic() - start < 60
    finally:
        connection.close()
    after = rss_kib()
    assert after <= baseline * 1.10, f"RSS grew from {baseline} KiB after 50 requests to {after} KiB after 500"


def test_keep_alive_answers_are_not_held_by_nagle(served) -> None:
    """Each small write goes out at once (TCP_NODELAY): on a kept-alive connection a refused request
    is answered in well under the 40 ms a delayed ACK would add to a response's second segment."""
    server, _ = served
    connection = http.client.HTTPConnection(HOST, server.port, timeout=10)
    times = []
    try:
        for _ in range(15):
            start = time.perf_counter()
            connection.request("POST", "/v1/completions", b'{"prompt": 1}', {"content-type": "application/json"})
            response = connection.getresponse()
            response.read()
            assert response.status == 400
            times.append(time.perf_counter() - start)
    finally:
        connection.close()
    assert sorted(times)[len(times) // 2] < 0.02, times
