"""A serving load test in the manner of ``vllm bench serve``: streamed completions driven through the
OpenAI API at a fixed concurrency (or request rate), with the metrics defined as vLLM defines them.

    python -m bench.serve_load --url http://127.0.0.1:8000 --concurrency 1,8,32 --requests 64
    python -m bench.serve_load --model smollm2-135m-instruct --device cpu --concurrency 1,4 --requests 8
    python -m bench.serve_load --model smollm2-135m-instruct --concurrency 8 --serve-args="--max-num-seqs 1"
    python -m bench.serve_load --model smollm2-135m-instruct --prompt-tokens 1100 --shared-prefix-tokens 1024 \
        --output-tokens 16 --requests 8
    python -m bench.serve_load --url URL --request-rate 4 --requests 100 --duration-s 120

With --model it starts ``onnxgen serve`` (a subprocess on a free port) and stops it at the end;
with --url it drives a running server (onnxgen's, or any OpenAI-compatible one: llama.cpp's
llama-server, vLLM). Every request is ``POST /v1/completions`` with ``stream``,
``stream_options.include_usage``, a prompt of --prompt-tokens random token ids (seeded; a server
that takes only text gets --text-prompt instead), --output-tokens tokens with ``ignore_eos`` and
temperature 0.

One request is sent first and not counted (the server's one-time costs). Metrics (per concurrency
level or rate): completed and failed requests, duration, request
throughput, output tok/s (completion tokens from the usage chunk over the duration; llama.cpp's
server where it sends none: its ``timings.predicted_n``; else its text chunks, one token each), and median /
p99 of TTFT (request sent to first text), TPOT ((latency - TTFT) / (completion tokens - 1), per
request with more than one token) and ITL (the gaps between streamed chunks with text; a chunk may
carry several tokens when the server coalesces them). Bounded: at most --requests per level and
--duration-s per level (requests still running then are counted as failed). Prints a markdown table
on stdout; progress and errors on stderr.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import numpy as np


@dataclass
class RequestResult:
    """One request as the client saw it; times are seconds from when it was sent."""

    ok: bool
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    completion_tokens: int = 0
    chunk_gaps: list[float] = field(default_factory=list)
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens, where the server reports it
    sent: int = -1  # the request's place in its level's sending order


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    api_key: str | None


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def stream_completion(target: Target, body: dict, timeout_s: float) -> RequestResult:
    """One streamed completion: reads the SSE events as they arrive (HTTP/1.1, chunked)."""
    payload = json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    if target.api_key:
        headers["authorization"] = f"Bearer {target.api_key}"
    connection = http.client.HTTPConnection(target.host, target.port, timeout=timeout_s)
    start = time.perf_counter()
    try:
        connection.request("POST", "/v1/completions", body=payload, headers=headers)
        response = connection.getresponse()
        if response.status != 200:
            return RequestResult(False, f"HTTP {response.status}: {response.read()[:300]!r}")
        buffer = b""
        first = last = 0.0
        gaps: list[float] = []
        tokens = cached = 0
        text_chunks = 0  # the token count of a server that sends no usage (one token per chunk)
        done = False
        while chunk := response.read1(65536):
            now = time.perf_counter() - start
            buffer += chunk
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                data = event.removeprefix(b"data: ")
                if data == b"[DONE]":
                    done = True
                    continue
                message = json.loads(data)
                if "error" in message:
                    return RequestResult(False, f"error event: {message['error'].get('message', '')[:300]}")
                if message.get("usage"):
                    tokens = int(message["usage"]["completion_tokens"])
                    cached = int((message["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                elif (message.get("timings") or {}).get("predicted_n"):  # llama.cpp's server, where it sends no usage
                    tokens = int(message["timings"]["predicted_n"])
                if any(choice.get("text") for choice in message.get("choices", [])):
                    text_chunks += 1
                    if first:
                        gaps.append(now - last)
                    else:
                        first = now
                    last = now
        if not done:
            return RequestResult(False, "the stream ended without data: [DONE]")
        if not first:
            return RequestResult(False, "the stream carried no text")
        if not tokens:  # no usage chunk (stream_options.include_usage ignored): a token per text chunk
            tokens = text_chunks
        return RequestResult(True, ttft=first, latency=time.perf_counter() - start, completion_tokens=tokens,
                             chunk_gaps=gaps, cached_tokens=cached)  # fmt: skip
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return RequestResult(False, f"{type(exc).__name__}: {exc}")
    finally:
        connection.close()


def shared_prefix(args: argparse.Namespace) -> list[int]:
    """The --shared-prefix-tokens ids every counted request's prompt starts with (a system prompt)."""
    rng = random.Random(args.seed + 7)
    return [rng.randrange(args.id_low, args.id_high) for _ in range(args.shared_prefix_tokens)]


def request_body(args: argparse.Namespace, rng: random.Random, prefix: list[int] | None = None) -> dict:
    if args.text_prompt is not None:
        prompt: str | list[int] = args.text_prompt
    else:
        prefix = prefix or []
        prompt = prefix + [rng.randrange(args.id_low, args.id_high) for _ in range(args.prompt_tokens - len(prefix))]
    body = {"prompt": prompt, "max_tokens": args.output_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    if args.served_model:
        body["model"] = args.served_model
    return body


def run_level(target: Target, args: argparse.Namespace, concurrency: int | None, rate: float | None) -> dict:
    """Up to --requests requests at ``concurrency`` at once (or sent at ``rate`` per second, Poisson
    arrivals), for at most --duration-s; returns the level's metrics."""
    rng = random.Random(args.seed)
    prefix = shared_prefix(args)
    bodies = [request_body(args, rng, prefix) for _ in range(args.requests)]
    results: list[RequestResult] = []
    lock = threading.Lock()
    deadline = time.perf_counter() + args.duration_s
    workers = concurrency if concurrency is not None else args.requests

    def one(index: int, body: dict) -> None:
        left = deadline - time.perf_counter()
        if left <= 0:
            result = RequestResult(False, "not sent: the level's time was up")
        else:
            result = stream_completion(target, body, timeout_s=left)
        result.sent = index
        with lock:
            results.append(result)
            if len(results) % max(1, args.requests // 10) == 0:
                say(f"  {len(results)}/{args.requests} requests done")

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for index, body in enumerate(bodies):
            if rate is not None:
                time.sleep(rng.expovariate(rate))
                if time.perf_counter() >= deadline:
                    break
            pool.submit(one, index, body)
    duration = time.perf_counter() - start
    return summarize(results, duration)


def percentile(values: list[float], q: float) -> float:
    """numpy's q-th percentile (0-100); NaN for no values (a level where every request failed)."""
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    tpot = [(r.latency - r.ttft) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    itl = [gap for r in ok for gap in r.chunk_gaps]
    ttft = [r.ttft for r in ok]
    errors = sorted({r.error for r in results if not r.ok})
    tokens = sum(r.completion_tokens for r in ok)
    first = [r.ttft for r in ok if r.sent == 0]
    later = [r.ttft for r in ok if r.sent > 0]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_tokens": tokens,
        "output_throughput": tokens / duration if duration > 0 else 0.0,
        **{f"{name}_{stat}_ms": 1000 * fn(values) for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl))
           for stat, fn in (("median", lambda v: percentile(v, 50)), ("p99", lambda v: percentile(v, 99)))},
        "ttft_first_ms": 1000 * first[0] if first else float("nan"),  # the first request sent
        "ttft_later_median_ms": 1000 * percentile(later, 50),
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
    }  # fmt: skip


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, int]:
    """``onnxgen serve`` on a free port (its stderr passed through); returns once it logs that it
    listens and is ready (its model loaded, a warm-up generation run)."""
    command = [sys.executable, "-m", "onnxgen", "serve", "--model", args.model, "--device", args.device, "--port", "0",
               "--max-queue", str(max(64, args.requests)), *args.serve_args]  # fmt: skip
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []

    def relay() -> None:
        for line in iter(process.stderr.readline, ""):
            lines.append(line)
            if not args.quiet_server or "POST" not in line:
                sys.stderr.write(line)

    threading.Thread(target=relay, daemon=True).start()
    deadline = time.monotonic() + args.load_timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        text = "".join(lines)
        match = re.search(r"listening on http://127\.0\.0\.1:(\d+)", text)
        if match and "ready:" in text:
            return process, int(match.group(1))
        time.sleep(0.1)
    process.kill()
    raise SystemExit(f"onnxgen serve did not get ready within {args.load_timeout_s:.0f} s")


def table(rows: list[tuple[str, dict]]) -> str:
    head = ("| load | completed | failed | duration s | req/s | output tok/s | TTFT ms median / p99 "
            "| TPOT ms median / p99 | ITL ms median / p99 |")  # fmt: skip
    lines = [head, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for label, m in rows:
        lines.append(
            f"| {label} | {m['completed']} | {m['failed']} | {m['duration_s']:.1f} | {m['request_throughput']:.2f} "
            f"| {m['output_throughput']:.1f} | {m['ttft_median_ms']:.1f} / {m['ttft_p99_ms']:.1f} "
            f"| {m['tpot_median_ms']:.2f} / {m['tpot_p99_ms']:.2f} | {m['itl_median_ms']:.2f} / {m['itl_p99_ms']:.2f} |"
        )
    return "\n".join(lines)


def positive_ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers >= 1, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    where.add_argument("--model", help="start `onnxgen serve --model MODEL` for the run (registry name or package)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="with --model")
    parser.add_argument(
        "--serve-args", type=str.split, default=[],
        help="with --model: more `onnxgen serve` arguments, one string: --serve-args='--max-num-seqs 1'",
    )  # fmt: skip
    parser.add_argument("--served-model", default=None, help="the `model` field to send (default: none)")
    parser.add_argument("--api-key", default=None)
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=positive_ints, default=[1], help="comma list of levels (default 1)")
    load.add_argument("--request-rate", type=float, default=None, help="requests per second, Poisson arrivals")
    parser.add_argument("--requests", type=int, default=32, help="requests per level")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--text-prompt", default=None, help="send this text instead of random token ids")
    parser.add_argument(
        "--shared-prefix-tokens", type=int, default=0,
        help="every prompt starts with the same this many ids (a shared system prompt; the uncounted first "
        "request does not), and the table adds the first request's TTFT against the later ones'",
    )  # fmt: skip
    parser.add_argument("--id-low", type=int, default=100, help="random prompt ids are drawn from [low, high)")
    parser.add_argument("--id-high", type=int, default=10000)
    parser.add_argument("--duration-s", type=float, default=300.0, help="at most this long per level")
    parser.add_argument("--load-timeout-s", type=float, default=600.0, help="with --model: time to get ready")
    parser.add_argument("--quiet-server", action="store_true", help="with --model: hide its per-request lines")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the metrics as JSON instead of a table")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.prompt_tokens < 1 or args.output_tokens < 1 or args.duration_s <= 0:
        parser.error("--requests, --prompt-tokens and --output-tokens must be >= 1, --duration-s > 0")
    if not 0 <= args.shared_prefix_tokens < args.prompt_tokens:
        parser.error(f"--shared-prefix-tokens must be in [0, --prompt-tokens), got {args.shared_prefix_tokens}")
    if args.request_rate is not None and args.request_rate <= 0:
        parser.error(f"--request-rate must be > 0, got {args.request_rate}")

    process = None
    if args.model:
        process, port = start_server(args)
        target = Target("127.0.0.1", port, args.api_key)
    else:
        url = urlsplit(args.url)
        if url.scheme != "http" or not url.hostname:
            parser.error(f"--url must be http://HOST[:PORT], got {args.url!r}")
        target = Target(url.hostname, url.port or 80, args.api_key)
    levels: list[tuple[str, int | None, float | None]]
    if args.request_rate is not None:
        levels = [(f"rate {args.request_rate:g}/s", None, args.request_rate)]
    else:
        levels = [(f"concurrency {c}", c, None) for c in args.concurrency]
    rows = []
    try:
        # one request before the levels, not counted (as vLLM's initial test run): the server's first
        # request pays one-time costs, and a server that cannot answer fails the run here
        probe = stream_completion(target, request_body(args, random.Random(args.seed + 1)), args.duration_s)
        if not probe.ok:
            say(f"the first request failed: {probe.error}")
        for label, concurrency, rate in levels:
            say(f"{label}: {args.requests} requests, {args.prompt_tokens} prompt + {args.output_tokens} output tokens")
            metrics = run_level(target, args, concurrency, rate)
            for error in metrics["errors"]:
                say(f"  failed: {error}")
            rows.append((label, metrics))
    finally:
        if process is not None:
            process.terminate()
            process.wait(60)
    if args.json:
        print(json.dumps([{"load": label, **m} for label, m in rows], indent=2))
    else:
        print(f"{args.prompt_tokens} prompt tokens, {args.output_tokens} output tokens (ignore_eos), greedy; "
              f"at most {args.requests} requests and {args.duration_s:g} s per level\n")  # fmt: skip
        print(table(rows))
        if args.shared_prefix_tokens:
            for label, m in rows:
                ratio = m["ttft_later_median_ms"] / m["ttft_first_ms"]
                print(f"\n{label}: {args.shared_prefix_tokens} shared prompt tokens; TTFT of the first request "
                      f"{m['ttft_first_ms']:.1f} ms, later ones median {m['ttft_later_median_ms']:.1f} ms "
                      f"({ratio:.2f}x); prompt tokens served from the cache: {m['cached_prompt_tokens']}")  # fmt: skip
    return 0 if all(m["failed"] == 0 for _, m in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
