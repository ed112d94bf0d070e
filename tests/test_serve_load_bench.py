"""bench.serve_load (issue 20's load benchmark, vLLM's metric definitions) against a real onnxgen serve
of the tiny package: every request is counted with the server's own token counts, the percentiles
are numpy's (NaN where no request completed), and a server that cannot be reached makes failed
requests and exit status 1."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench import serve_load
from onnxgen.genai.generator import Generator
from onnxgen.server.options import ServeOptions
from tests.server_helpers import running_server, tiny_package


@pytest.fixture(scope="module")
def server():
    package = tiny_package()
    options = ServeOptions(model_name="tiny", port=0, max_num_seqs=1)  # one request at a time
    with running_server(options, lambda: Generator(package)) as served:
        yield served


def test_a_shared_prefix_is_served_from_the_cache_after_the_first_request(capsys) -> None:
    package = tiny_package()
    with running_server(ServeOptions(model_name="tiny", port=0, max_num_seqs=2), lambda: Generator(package)) as run:
        argv = ["--url", f"http://127.0.0.1:{run.port}", "--requests", "4", "--prompt-tokens", "40",
                "--shared-prefix-tokens", "32", "--output-tokens", "3", "--json"]  # fmt: skip
        assert serve_load.main(argv) == 0
    (level,) = json.loads(capsys.readouterr().out)
    assert level["completed"] == 4
    # the uncounted first request shares nothing; the first counted one computes the prefix, each
    # later one (one at a time) reuses all 32 of it
    assert level["cached_prompt_tokens"] == 3 * 32
    assert level["ttft_first_ms"] > 0 and level["ttft_later_median_ms"] > 0


def test_levels_count_every_request_with_the_servers_usage(server, capsys) -> None:
    argv = ["--url", f"http://127.0.0.1:{server.port}", "--concurrency", "1,3", "--requests", "5",
            "--prompt-tokens", "8", "--output-tokens", "6", "--duration-s", "60", "--json"]  # fmt: skip
    assert serve_load.main(argv) == 0
    levels = json.loads(capsys.readouterr().out)
    assert [level["load"] for level in levels] == ["concurrency 1", "concurrency 3"]
    for level in levels:
        assert level["completed"] == 5 and level["failed"] == 0, level
        assert level["output_tokens"] == 5 * 6  # the usage chunks' completion_tokens, summed
        assert 0 < level["ttft_median_ms"] <= level["ttft_p99_ms"]
        assert 0 < level["tpot_median_ms"] <= level["tpot_p99_ms"]
        assert level["itl_median_ms"] > 0
        assert level["output_throughput"] == pytest.approx(30 / level["duration_s"])
    # one request at a time on the server: of three sent at once two wait for the one before, so the
    # median TTFT is a whole generation longer than alone
    assert levels[1]["ttft_median_ms"] > levels[0]["ttft_median_ms"]


def test_tpot_and_percentiles_follow_vllms_definitions() -> None:
    results = [
        serve_load.RequestResult(True, ttft=0.1, latency=0.5, completion_tokens=5, chunk_gaps=[0.1, 0.1, 0.2]),
        serve_load.RequestResult(True, ttft=0.2, latency=0.2, completion_tokens=1),  # no TPOT: one token
        serve_load.RequestResult(False, "HTTP 503: queue full"),
    ]
    metrics = serve_load.summarize(results, duration=2.0)
    assert metrics["completed"] == 2 and metrics["failed"] == 1 and metrics["errors"] == ["HTTP 503: queue full"]
    assert metrics["tpot_median_ms"] == pytest.approx(1000 * (0.5 - 0.1) / 4)
    assert metrics["output_throughput"] == pytest.approx(6 / 2.0)
    assert np.isnan(serve_load.summarize([results[2]], duration=1.0)["ttft_median_ms"])  # nothing completed


def test_an_unreachable_server_is_failed_requests_and_status_1(capsys) -> None:
    import socket

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = ["--url", f"http://127.0.0.1:{port}", "--requests", "2", "--output-tokens", "2", "--json"]
    assert serve_load.main(argv) == 1
    (level,) = json.loads(capsys.readouterr().out)
    assert level["completed"] == 0 and level["failed"] == 2 and "ConnectionRefusedError" in level["errors"][0]
