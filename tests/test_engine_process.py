"""The engine in a process of its own (genai/engine_process.py) behind the HTTP server: the text a
request gets is the in-process Generator's (the oracle: the same package decoded in this process),
streamed and not, with one request and several at once; a client that leaves is cut in the engine
process too; an engine process that dies makes the server say so (health, 503) instead of hanging;
closing the server ends the engine process. One spawned engine per server (each loads torch and the
tiny package: a few seconds), so the tests share them."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from tests.conftest import HAS_CUDA
from tests.server_helpers import post, request, running_server, sse_events, tiny_package
from tests.test_gpu_capture_models import qwen_shape_packages  # noqa: F401 - the shared fixture (GPU test)

MODEL = "tiny"
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "Hello"]


def serve(max_num_seqs: int, max_queue: int = 64):
    from onnxgen.genai.engine_process import EngineSpec
    from onnxgen.server.options import ServeOptions

    options = ServeOptions(
        model_name=MODEL, port=0, max_num_seqs=max_num_seqs, max_queue=max_queue, engine_process=True
    )
    spec = EngineSpec(str(tiny_package()), device="cpu")
    return running_server(options, None, engine_spec=lambda: spec)


@pytest.fixture(scope="module")
def oracle() -> dict[str, str]:
    """Each prompt's greedy 12 tokens from a Generator in this process."""
    from onnxgen.genai import Generator, SamplingParams

    generator = Generator(tiny_package(), device="cpu")
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    return {prompt: generator.generate(prompt, params) for prompt in PROMPTS}


@pytest.fixture(scope="module", params=[1, 4], ids=["serial", "batched"])
def served(request):
    with serve(request.param) as server:
        yield server


def completion(port: int, prompt: str, stream: bool = False) -> str:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": stream}
    if not stream:
        status, answer = post(port, "/v1/completions", body)
        assert status == 200, answer
        return answer["choices"][0]["text"]
    status, _, data = request(port, "POST", "/v1/completions", body, {"content-type": "application/json"})
    assert status == 200, data[:300]
    return "".join(json.loads(event)["choices"][0]["text"] for event in sse_events(data)[:-1])


def test_texts_are_the_in_process_generators(served, oracle) -> None:
    assert served.scheduler.describe().endswith("in an engine process")
    assert completion(served.port, PROMPTS[0]) == oracle[PROMPTS[0]]
    assert completion(served.port, PROMPTS[1], stream=True) == oracle[PROMPTS[1]]
    texts: dict[str, str] = {}

    def client(prompt: str) -> None:
        texts[prompt] = completion(served.port, prompt, stream=True)

    threads = [threading.Thread(target=client, args=(p,)) for p in PROMPTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert texts == oracle
    deadline = time.monotonic() + 5
    while served.scheduler.running or served.scheduler.queue_depth:  # the engine's counts reach the server
        assert time.monotonic() < deadline, (served.scheduler.running, served.scheduler.queue_depth)
        time.sleep(0.02)


def test_logprobs_cross_from_the_engine_process(served, oracle) -> None:
    body = {"prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    status, answer = post(served.port, "/v1/completions", body)
    assert status == 200, answer
    choice = answer["choices"][0]
    assert choice["text"] == oracle[PROMPTS[2]]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == 12 and all(len(top) == 2 for top in logprobs["top_logprobs"])
    assert all(value <= 0.0 for value in logprobs["token_logprobs"])


def test_bad_input_is_refused_in_the_server_process(served) -> None:
    status, answer = post(served.port, "/v1/completions", {"prompt": [999999], "max_tokens": 2})
    assert status == 400 and "outside the vocabulary" in answer["error"]["message"], answer
    status, answer = post(served.port, "/v1/completions", {"prompt": "x" * 2000, "max_tokens": 2})
    assert status == 400, answer


def test_a_dead_engine_process_fails_the_server_not_its_clients() -> None:
    with serve(1) as server:
        assert completion(server.port, "Hello")
        os.kill(server.scheduler._process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while server.scheduler.state != "failed":
            assert time.monotonic() < deadline, server.scheduler.state
            time.sleep(0.05)
        assert "ended unexpectedly (exit code -9)" in server.scheduler.failure
        status, _, body = request(server.port, "GET", "/health")
        assert status == 503 and b"ended unexpectedly" in body, body
        status, answer = post(server.port, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
        assert status == 503, answer


def test_closing_the_server_ends_the_engine_process() -> None:
    with serve(2) as server:
        process = server.scheduler._process
        assert completion(server.port, "Hello")
    process.join(10)
    assert process.exitcode == 0


def test_an_error_that_does_not_pickle_crosses_as_its_kind() -> None:
    from onnxgen.errors import OnnxgenError
    from onnxgen.genai.engine_process import _portable
    from onnxgen.genai.scheduler import Output

    class Unpicklable(OnnxgenError):
        def __init__(self, message: str, extra: object) -> None:
            super().__init__(message)
            self.extra = extra

    class Internal(Exception):
        def __init__(self, a: int, b: int) -> None:
            super().__init__(f"{a}/{b}")

    user = _portable(Output(0, None, 0.0, error=Unpicklable("too long", lambda: None)))
    assert type(user.error) is OnnxgenError and "Unpicklable: too long" in str(user.error)
    internal = _portable(Output(0, None, 0.0, error=Internal(1, 2)))
    assert type(internal.error) is RuntimeError and "Internal: 1/2" in str(internal.error)
    plain = Output(0, None, 0.0, error=OnnxgenError("fine"))
    assert _portable(plain) is plain


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_on_cuda_the_engine_process_serves_the_captured_generators_text(qwen_shape_packages) -> None:  # noqa: F811
    """CUDA: a batching server in an engine process (captured batched steps) answers four streamed
    requests at once with the text of a Generator in this process (the captured one-sequence loop)."""
    from onnxgen.genai import Generator, SamplingParams
    from onnxgen.genai.engine_process import EngineSpec
    from onnxgen.server.options import ServeOptions

    package = qwen_shape_packages["fp16"]
    generator = Generator(package, device="cuda")
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ids = [[1000 + 37 * i + j for j in range(20 + 9 * i)] for i in range(4)]
    expected = ["".join(event.text for event in generator.events(p, params)) for p in ids]
    del generator
    options = ServeOptions(model_name=MODEL, port=0, device="cuda", max_num_seqs=4, engine_process=True)
    spec = EngineSpec(str(package), device="cuda")
    with running_server(options, None, engine_spec=lambda: spec) as server:
        texts: dict[int, str] = {}

        def client(index: int) -> None:
            body = {"prompt": ids[index], "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True}
            headers = {"content-type": "application/json"}
            status, _, data = request(server.port, "POST", "/v1/completions", body, headers)
            assert status == 200, data[:300]
            texts[index] = "".join(json.loads(e)["choices"][0]["text"] for e in sse_events(data)[:-1])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    assert [texts.get(i) for i in range(4)] == expected


def test_the_queue_bound_holds_across_the_process() -> None:
    """max_queue counts the requests the engine has not started, as the parent sees them: with one
    slot and a queue of one, six requests at once get 200 or 503 (with Retry-After), some of each."""
    with serve(1, max_queue=1) as server:
        statuses: list[int] = []

        def client() -> None:
            body = {"prompt": "Once", "max_tokens": 60, "ignore_eos": True}
            status, headers, _ = request(
                server.port, "POST", "/v1/completions", body, {"content-type": "application/json"}
            )
            statuses.append(status)
            if status == 503:
                assert "retry-after" in headers

        threads = [threading.Thread(target=client) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert sorted(set(statuses)) == [200, 503], statuses


def test_a_cancel_crosses_to_the_engine_process() -> None:
    """A request cancelled after its first tokens stops in the engine process: its outputs end
    long before its max_tokens, and the engine takes the next request."""
    import asyncio

    from onnxgen.genai.sampling import SamplingParams
    from onnxgen.genai.scheduler import Job

    with serve(1) as server:
        scheduler = server.scheduler
        prompt = scheduler.generator.encode("Once upon a time")

        async def cancelled_after(tokens: int) -> int:
            job = Job(prompt, SamplingParams(max_new_tokens=200, ignore_eos=True))
            handle = scheduler.submit([job], asyncio.get_running_loop())
            seen = 0
            async for batch in handle.batches():
                seen += sum(1 for output in batch if output.event is not None and output.event.token_id is not None)
                if seen >= tokens and not handle.cancelled:
                    handle.cancel()
            return seen

        seen = asyncio.run(cancelled_after(3))
        assert 3 <= seen < 150, seen
        assert completion(server.port, "Hello")


def test_a_package_that_fails_to_load_fails_the_server_with_its_reason(tmp_path) -> None:
    """The engine process's load error reaches the server as its failure (no traceback to read)."""
    from onnxgen.genai.engine_process import EngineSpec, ProcessScheduler

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "genai_config.json").write_text("{ not json")
    scheduler = ProcessScheduler(lambda: EngineSpec(str(broken), device="cpu")).start()
    try:
        assert scheduler.wait_loaded(60)
        assert scheduler.state == "failed"
        assert "genai_config.json" in scheduler.failure, scheduler.failure
    finally:
        scheduler.close(5)
    assert scheduler._process.exitcode == 0


def test_a_bug_relaying_outputs_fails_the_server_instead_of_hanging(monkeypatch: pytest.MonkeyPatch) -> None:
    from onnxgen.genai import engine_process

    with serve(1) as server:
        assert completion(server.port, "Hello")

        def broken(item):
            raise RuntimeError("a relaying bug")

        monkeypatch.setattr(engine_process, "_decoded", broken)
        status, answer = post(server.port, "/v1/completions", {"prompt": "Hello", "max_tokens": 4})
        assert status in (500, 503), answer
        assert server.scheduler.state == "failed"
        assert "internal error relaying the engine's outputs" in server.scheduler.failure
