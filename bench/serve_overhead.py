"""What `onnxgen serve` adds per streamed token: the same greedy workload through the Python API
(``Generator.events``) and through HTTP (POST /v1/completions, stream, read by a raw SSE client in
another process, so the client's own work does not share the server's interpreter), in one run.

    python -m bench.serve_overhead --model smollm2-135m-instruct --device cpu
    python -m bench.serve_overhead --tiny                     # a 3-layer random model: the overhead shows
    python -m bench.serve_overhead --model qwen2.5-coder-0.5b-instruct --device cuda --engine thread,process
    python -m bench.serve_overhead --model PKG --device cuda --prompt-tokens 128 --max-num-seqs 64 --engine process

Workload: a seeded prompt of --prompt-tokens ids, --new-tokens tokens greedy with EOS ignored; one
warm-up, then --repeats runs per path, the two paths alternating (a server is started for each HTTP
run and stopped before the next API run), the median reported. TTFT: request sent (or ``events``
called) to the first token's text; decode tok/s: the tokens after the first over the time from the
first to the last. Over HTTP a chunk may carry several tokens when the client is behind: the
times are when the text reached the client. HTTP rows: the engine on the server's engine thread
(--engine thread: the Generator measured through the API, served) and/or in an engine process
(--engine process: one server for all its runs, its own Generator on the same package), the runner
one request at a time or batching (--max-num-seqs). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path


def api_run(generator, ids: list[int], new_tokens: int) -> tuple[float, float]:
    """(TTFT s, decode tok/s) of one generation through Generator.events."""
    from onnxgen.genai.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    first = last = 0.0
    count = 0
    for event in generator.events(ids, params):
        if event.token_id is None:
            break
        count += 1
        last = time.perf_counter()
        if count == 1:
            first = last
    return first - start, (count - 1) / (last - first)


def sse_run(port: int, ids: list[int], new_tokens: int) -> tuple[float, float]:
    """(TTFT s, decode tok/s) of one streamed completion over a raw socket. HTTP/1.0, so the body
    is the bare event stream (no chunked transfer coding) and ends when the server closes."""
    body = json.dumps({"prompt": ids, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()  # fmt: skip
    head = f"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    first = last = 0.0
    with socket.create_connection(("127.0.0.1", port), timeout=600) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.perf_counter()
        sock.sendall(head.encode() + body)
        buffer = b""
        while True:
            data = sock.recv(65536)
            if not data:
                break
            now = time.perf_counter()
            buffer += data
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                payload = event.rpartition(b"data: ")[2]  # the first one follows the headers
                if payload == b"[DONE]" or not payload.startswith(b"{"):
                    continue
                choices = json.loads(payload)["choices"]
                if choices and choices[0]["text"]:
                    first = first or now
                    last = now
    if not first:
        raise SystemExit("the stream carried no text")
    return first - start, (new_tokens - 1) / (last - first)


def client_main(args: argparse.Namespace) -> int:
    ids = json.loads(args.ids)
    sse_run(args.client, ids, 8)  # warm-up: the connection path, the server's first chunks
    runs = [sse_run(args.client, ids, args.new_tokens) for _ in range(args.repeats)]
    print(json.dumps(runs))
    return 0


def client_runs(port: int, ids: list[int], new_tokens: int, repeats: int) -> list[tuple[float, float]]:
    """The SSE client process against the server on ``port``."""
    command = [sys.executable, "-m", "bench.serve_overhead", "--client", str(port), "--ids", json.dumps(ids),
               "--new-tokens", str(new_tokens), "--repeats", str(repeats)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        raise SystemExit(f"the SSE client failed:\n{result.stderr}")
    return [tuple(run) for run in json.loads(result.stdout)]


def start_server(options, make_generator, engine_spec=None):  # noqa: ANN001, ANN201
    """A Server on its own thread, once loaded: (server, thread)."""
    from onnxgen.server.serve import Server

    server = Server(options, make_generator, announce=False, engine_spec=engine_spec)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while server.scheduler.state == "loading":
        time.sleep(0.01)
    if server.scheduler.state != "ready":
        raise SystemExit(f"the server did not load: {server.scheduler.failure}")
    return server, thread


def stop_server(server, thread) -> None:  # noqa: ANN001
    server.stop()
    thread.join(60)


def http_runs(generator, options, ids: list[int], new_tokens: int, repeats: int) -> list[tuple[float, float]]:
    """Serves ``generator`` on an engine thread (which owns it until the server stops) and runs
    the SSE client process against it."""
    server, thread = start_server(replace(options, engine_process=False), lambda: generator)
    try:
        return client_runs(server.port, ids, new_tokens, repeats)
    finally:
        stop_server(server, thread)


def tiny_package(directory: Path) -> Path:
    """A 3-layer random-weights llama with SmolLM2's tokenizer (as tests/server_helpers.py builds)."""
    from onnxgen.models.builder import build_package
    from onnxgen.models.pull import ensure_package
    from onnxgen.models.random_source import TINY_CONFIGS, RandomSource

    tokenizer = ensure_package("smollm2-135m-instruct", precision="int4", device="cpu", attention="gqa")
    config = replace(TINY_CONFIGS["tiny-llama"], vocab_size=49152, max_position_embeddings=2048, name="tiny")
    package = build_package(RandomSource(config), directory / "tiny")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, package / name)
    return package


def row(name: str, runs: list[tuple[float, float]]) -> tuple[str, float, float]:
    ttft = statistics.median(r[0] for r in runs) * 1000
    rate = statistics.median(r[1] for r in runs)
    return name, ttft, rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="registry name or package directory")
    parser.add_argument("--tiny", action="store_true", help="a 3-layer random model with a real tokenizer instead")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", default=None, help="for a registry name (default: int4 cpu, fp16 cuda)")
    parser.add_argument("--threads", type=int, default=None, help="CPU: torch threads (default onnxgen's)")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-num-seqs", type=int, default=1, help="the servers' runner: 1 serial, more batching")
    parser.add_argument("--engine", default="thread", help="comma list of thread, process: where the engine runs")
    parser.add_argument("--client", type=int, default=None, help=argparse.SUPPRESS)  # the SSE client process
    parser.add_argument("--ids", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client is not None:
        return client_main(args)

    from onnxgen.cli import resolve_model
    from onnxgen.genai.benchmark import prompt_ids
    from onnxgen.genai.engine_process import EngineSpec
    from onnxgen.genai.generator import Generator
    from onnxgen.server.options import ServeOptions
    from onnxgen.threads import ThreadOptions

    workdir = Path(tempfile.mkdtemp(prefix="onnxgen-serve-bench-"))
    try:
        package = tiny_package(workdir) if args.tiny else resolve_model(args.model, args.device, args.precision, "gqa")
        generator = Generator(package, device=args.device, threads=ThreadOptions(num_threads=args.threads))
        ids = prompt_ids(generator.config.vocab_size, args.prompt_tokens)
        api_run(generator, ids, args.new_tokens)  # warm-up (on CUDA: the recordings)
        engines = args.engine.split(",")
        options = ServeOptions(model_name="bench", port=0, device=args.device, max_num_seqs=args.max_num_seqs)
        spec = EngineSpec(str(package), device=args.device, threads=ThreadOptions(num_threads=args.threads))
        process = None
        if "process" in engines:
            process = start_server(replace(options, engine_process=True), None, lambda: spec)
        runs: dict[str, list[tuple[float, float]]] = {"api": [], "thread": [], "process": []}
        try:
            for _ in range(args.repeats):  # interleaved, so a neighbour's load falls on every path alike
                runs["api"].append(api_run(generator, ids, args.new_tokens))
                if "thread" in engines:
                    runs["thread"] += http_runs(generator, options, ids, args.new_tokens, 1)
                if process is not None:
                    runs["process"] += client_runs(process[0].port, ids, args.new_tokens, 1)
        finally:
            if process is not None:
                stop_server(*process)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    labels = {"thread": "HTTP SSE, engine thread", "process": "HTTP SSE, engine process"}
    runner = "one request at a time" if args.max_num_seqs == 1 else f"batching, --max-num-seqs {args.max_num_seqs}"
    rows = [row("Python API (`Generator.events`)", runs["api"])]
    rows += [row(f"{labels[e]} ({runner})", runs[e]) for e in ("thread", "process") if runs[e]]
    name = "tiny random (3 layers)" if args.tiny else str(args.model)
    print(f"model {name}, device {args.device}, threads {generator.threads}, prompt {args.prompt_tokens} tokens, "
          f"{args.new_tokens} new (greedy), median of {args.repeats}\n")  # fmt: skip
    print("| path | TTFT ms | decode tok/s | ms/token |")
    print("| --- | ---: | ---: | ---: |")
    for label, ttft, rate in rows:
        print(f"| {label} | {ttft:.2f} | {rate:.1f} | {1000 / rate:.3f} |")
    _, api_ttft, api_rate = rows[0]
    for label, http_ttft, http_rate in rows[1:]:
        per_token_us = (1 / http_rate - 1 / api_rate) * 1e6
        print(f"| {label.split(' (')[0]} - API | {http_ttft - api_ttft:+.2f} | {http_rate - api_rate:+.1f} "
              f"({http_rate / api_rate - 1:+.1%}) | {per_token_us / 1000:+.3f} ({per_token_us:+.0f} us) |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
