"""onnxgen serve refuses what it must, in OpenAI's error envelope, and keeps serving after each.

A tiny random-weights model with SmolLM2's tokenizer (context 256) serves on loopback with an API
key. Each malformed or refused request gets its status, a message, and (where there is one) the
field at fault as ``param``; after each, a good request is answered. Raw sockets carry what an HTTP
library would not send (a 10 MB body, broken headers, non-UTF-8 bytes).
"""

from __future__ import annotations

import json
import socket

import pytest

from tests.server_helpers import HOST, post, request, running_server, tiny_package

KEY = "sk-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}
MODEL = "tiny"
GOOD = {"model": MODEL, "prompt": "Hello there", "max_tokens": 2, "temperature": 0}
BOOM_IDS = [7, 7, 7, 7]  # the prompt that makes the wrapped generator raise a RuntimeError


@pytest.fixture(scope="module")
def server():
    from onnxgen.genai.generator import Generator
    from onnxgen.server.options import ServeOptions

    def make():
        generator = Generator(tiny_package(), device="cpu")
        new_sequence = generator.engine.new_sequence

        def failing(prompt_ids, params, stop_ids=()):  # a bug inside the engine, for one prompt
            if list(prompt_ids) == BOOM_IDS:
                raise RuntimeError("an internal bug")
            return new_sequence(prompt_ids, params, stop_ids)

        generator.engine.new_sequence = failing  # what both runners call for every job
        return generator

    with running_server(ServeOptions(model_name=MODEL, port=0, api_key=KEY), make) as running:
        yield running


def good(port: int) -> None:
    status, body = post(port, "/v1/completions", GOOD, AUTH)
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length"), body


def envelope(status: int, body: dict) -> dict:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], body
    assert "Traceback" not in error["message"]
    return error


C, P = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
BATTERY = [
    # (path, body (bytes or dict), status, param, a piece of the message)
    (P, b"{", 400, None, "not valid JSON"),
    (P, b"[1, 2]", 400, None, "must be a JSON object"),
    (P, b"", 400, None, "body is empty"),
    (P, b'{"prompt": "caf\xe9"}', 400, None, "not UTF-8"),
    (P, b'{"prompt": "x", "temperature": NaN}', 400, None, "NaN"),
    (P, b'{"prompt": "x", "temperature": -Infinity}', 400, None, "Infinity"),
    (P, b'{"prompt": "x", "temperature": 1e999}', 400, "temperature", "finite"),
    (P, b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400, None, "not valid JSON"),
    (P, b"[" * 100_000 + b"]" * 100_000, 400, None, "JSON"),
    (P, b'{"prompt": "\\ud800"}', 400, "prompt", "surrogate"),
    (P, {"prompt": "x", "max_tokens": 10**30}, 400, "max_tokens", "context"),
    (P, {"prompt": "x", "n": 10**6}, 400, "n", "n must be"),
    (P, {"prompt": "x", "seed": 2**70}, 400, "seed", "seed must be"),
    (P, {"prompt": "x", "seed": -1}, 400, "seed", "seed must be"),
    (P, {"prompt": "x", "temperature": "hot"}, 400, "temperature", "must be a number"),
    (P, {"prompt": "x", "n": True}, 400, "n", "must be an integer"),
    (P, {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens", "must be an integer"),
    (P, {"prompt": "x", "stop": 5}, 400, "stop", "stop must be"),
    (P, {"prompt": "x", "stop": ["a", ""]}, 400, "stop[1]", "empty"),
    (P, {"prompt": "x", "stream": "yes"}, 400, "stream", "boolean"),
    (P, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    (P, {"prompt": {}}, 400, "prompt", "prompt must be"),
    (P, {"prompt": []}, 400, "prompt", "prompt must be"),
    (P, {"prompt": [[]]}, 400, "prompt[0]", "non-empty"),
    (P, {"prompt": [1.5]}, 400, "prompt[0]", "prompt[0] must be"),
    (P, {"prompt": [10**9]}, 400, "prompt", "outside the vocabulary"),
    (P, {"prompt": ""}, 400, "prompt", "empty"),
    (P, {}, 400, "prompt", "prompt is required"),
    (P, {"prompt": "x", "temperature": -1}, 400, "temperature", "temperature must be >= 0"),
    (P, {"prompt": "x", "top_p": 0}, 400, "top_p", "top_p must be"),
    (P, {"prompt": "x", "top_p": 1.5}, 400, "top_p", "top_p must be"),
    (P, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", "[-2, 2]"),
    (P, {"prompt": "x", "min_p": 1.0}, 400, "min_p", "min_p must be"),
    (P, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", "repetition_penalty must be"),
    (P, {"prompt": "x", "top_k": -5}, 400, "top_k", "top_k must be"),
    (P, {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens", "min_tokens"),
    (P, {"prompt": "x", "logprobs": 50}, 400, "logprobs", "logprobs must be"),
    (P, {"prompt": "x", "logprobs": 1, "echo": True}, 400, "echo", "prompt tokens' logprobs"),
    (P, {"prompt": "x", "best_of": 3}, 400, "best_of", "best_of"),
    (P, {"prompt": "x", "suffix": "y"}, 400, "suffix", "not supported"),
    (P, {"prompt": "x", "logit_bias": {"1": 5}}, 400, "logit_bias", "not supported"),
    (P, {"prompt": "x", "temprature": 0.5}, 400, "temprature", "unrecognized"),
    (P, {"prompt": "x " * 300}, 400, "prompt", "context holds 256"),
    (P, {"prompt": "x", "max_tokens": 300}, 400, "max_tokens", "context of 256"),
    (P, {"prompt": "x", "model": "gpt-4"}, 404, "model", "does not exist"),
    (C, {"messages": "hi"}, 400, "messages", "must be an array"),
    (C, {"messages": []}, 400, "messages", "empty"),
    (C, {}, 400, "messages", "required"),
    (C, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "must be one of"),
    (C, {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role", "tool messages"),
    (C, {"messages": [{"content": "x"}]}, 400, "messages[0].role", "role"),
    (C, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "must be a string"),
    (C, {"messages": [{"role": "user"}]}, 400, "messages[0].content", "required"),
    (C, {"messages": ["hi"]}, 400, "messages[0]", "must be an object"),
    (
        C,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages[0].content[0].type",
        "text",
    ),  # fmt: skip
    (C, {"messages": [{"role": "user", "content": "x", "name": "bob"}]}, 400, "messages[0].name", "not supported"),
    (C, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", "tool"),
    (C, {"messages": USER, "response_format": {"type": "json_object"}}, 400, "response_format", "plain text"),
    (C, {"messages": USER, "logprobs": 3}, 400, "logprobs", "boolean"),
    (C, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs", "needs logprobs"),
    (C, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "top_logprobs must be"),
    (C, {"messages": USER, "max_completion_tokens": 0}, 400, "max_completion_tokens", ">= 1"),
    (C, {"messages": [{"role": "user", "content": "x " * 300}]}, 400, "messages", "context holds 256"),
]


def test_each_malformed_request_gets_its_4xx_and_the_server_keeps_serving(server) -> None:
    for path, body, status, param, piece in BATTERY:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        got, headers, raw = request(server.port, "POST", path, data, {"content-type": "application/json", **AUTH})
        assert headers["content-type"] == "application/json"
        error = envelope(got, json.loads(raw))
        assert (got, error["param"]) == (status, param), (body if isinstance(body, dict) else body[:60], error)
        assert piece in error["message"], (piece, error["message"])
        good(server.port)


def test_sampling_params_ok_values_pass(server) -> None:
    """The edges of the ranges are accepted (the battery's refusals are not off by one)."""
    edges = [
        {"top_p": 1.0, "min_p": 0.0},
        {"presence_penalty": -2, "frequency_penalty": 2, "top_k": -1},
        {"logit_bias": {}, "response_format": None, "user": "u1", "tools": []},
        {"max_tokens": 255},
    ]
    for extra in edges:
        status, body = post(server.port, "/v1/completions", {**GOOD, "prompt": [5], **extra}, AUTH)
        assert status == 200, (extra, body)


def test_api_key_routes_and_methods(server) -> None:
    status, body = post(server.port, "/v1/completions", GOOD)
    assert (
        status == 401 and envelope(status, body)["code"] == "invalid_api_key" and "missing" in body["error"]["message"]
    )
    status, body = post(server.port, "/v1/completions", GOOD, {"authorization": "Bearer wrong"})
    assert status == 401 and "incorrect" in body["error"]["message"]
    assert request(server.port, "GET", "/v1/models")[0] == 401
    assert request(server.port, "GET", "/v1/models", headers=AUTH)[0] == 200
    assert request(server.port, "GET", "/health")[0] == 200  # open: for probes
    status, _, raw = request(server.port, "GET", "/nope")
    assert status == 404 and envelope(status, json.loads(raw))["type"] == "not_found_error"
    status, _, raw = request(server.port, "GET", "/v1/completions", headers=AUTH)
    assert status == 405 and envelope(status, json.loads(raw))
    status, _, raw = request(server.port, "GET", "/v1/models/other", headers=AUTH)
    assert status == 404 and json.loads(raw)["error"]["code"] == "model_not_found"
    good(server.port)


def test_an_internal_failure_is_a_500_without_its_traceback(server, capfd) -> None:
    status, body = post(server.port, "/v1/completions", {**GOOD, "prompt": BOOM_IDS}, AUTH)
    assert status == 500 and envelope(status, body)["type"] == "internal_error"
    assert "internal bug" not in json.dumps(body)
    good(server.port)  # the engine probed itself and goes on
    assert "RuntimeError: an internal bug" in capfd.readouterr().err  # the traceback is in the log
    status, _, raw = request(server.port, "GET", "/health")
    assert status == 200


def raw_exchange(port: int, data: bytes, send_all: bool = True) -> bytes:
    """Sends ``data`` (what it can), then reads the answer until the server closes or 10 s pass."""
    with socket.create_connection((HOST, port), timeout=10) as sock:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before taking everything
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
                if b"\r\n\r\n" in b"".join(chunks) and not send_all:
                    break
        except (ConnectionResetError, TimeoutError):
            pass
    return b"".join(chunks)


def status_of(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer[:100]
    return int(answer[9:12])


def test_a_10_mb_body_and_header_abuse_get_4xx(server) -> None:
    port = server.port
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
    big = b"x" * (10 * 1024 * 1024)
    answer = raw_exchange(port, (head + f"Content-Length: {len(big)}\r\n\r\n").encode() + big)
    assert status_of(answer) == 413 and b"at most" in answer
    chunked = (head + "Transfer-Encoding: chunked\r\n\r\n").encode()  # no Content-Length: counted as read
    chunked += b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in [b"y" * 65536] * 48) + b"0\r\n\r\n"
    assert status_of(raw_exchange(port, chunked)) == 413
    good(port)
    for abuse in (
        head + "Content-Length: abc\r\n\r\n",  # not a number
        head + "X-Long: " + "a" * 200_000 + "\r\n\r\n",  # one header of 200 kB
        head + "".join(f"X-{i}: {i}\r\n" for i in range(20_000)) + "\r\n",  # 20,000 headers
        head + "Bad Header\r\n\r\n",  # no colon
        "GARBAGE\r\n\r\n",
        head.replace("HTTP/1.1", "HTTP/9.9") + "\r\n",
    ):
        answer = raw_exchange(port, abuse.encode(), send_all=False)
        assert 400 <= status_of(answer) < 500, answer[:200]
        good(port)
    good(port)


def test_a_batching_servers_sequence_limit_is_a_clear_400() -> None:
    from onnxgen.genai.generator import Generator
    from onnxgen.server.options import ServeOptions

    options = ServeOptions(model_name=MODEL, port=0, max_num_seqs=2, max_model_len=64)
    with running_server(options, lambda: Generator(tiny_package(), device="cpu")) as running:
        status, body = post(running.port, P, {"prompt": list(range(100, 170)), "max_tokens": 2})
        error = envelope(status, body)
        assert status == 400 and error["code"] == "context_length_exceeded" and error["param"] == "prompt"
        assert "70 tokens; this server's --max-model-len of 64 (the model's context is 256) leaves" in error["message"]
        status, body = post(running.port, P, {"prompt": list(range(100, 140)), "max_tokens": 30})
        error = envelope(status, body)
        assert status == 400 and error["param"] == "max_tokens"
        assert "70 tokens, beyond this server's --max-model-len of 64" in error["message"]
        status, body = post(running.port, P, {"prompt": list(range(100, 140)), "max_tokens": 24})
        assert status == 200 and body["usage"]["completion_tokens"] <= 24
