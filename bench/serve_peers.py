"""onnxgen's server beside llama.cpp's, in one run, on one random checkpoint, driven by one client
(bench/serve_load.py: streamed completions at fixed concurrency levels, vLLM's metric definitions).

    python3 -m bench.serve_peers --shape qwen2.5-coder-0.5b-instruct --precision fp16,int4 --workdir /tmp/w \\
        --llamacpp /tmp/lc --tokenizer-from .gpu/qwen-tok --concurrency 1,8,32,64,128

Per precision: the bench's random checkpoint of --shape (bench/peers_decode.py writes it), onnxgen's
package of it, and llama.cpp's own converter's GGUF of it (F16 for fp16, Q4_0 from llama-quantize for
int4, the forms of llama.cpp's own recommendation; bench/llamacpp_peer.py). Each server then gets the
same requests: --prompt-tokens random prompt ids, --output-tokens with ``ignore_eos``, greedy.

- ``onnxgen serve --model PKG --device cuda --max-num-seqs C --max-model-len L`` (C = the largest
  level, L = prompt + output + 16), plus --onnxgen-args.
- ``llama-server -m GGUF -ngl 999 -np C -c C*L`` (as many parallel slots, each of L tokens; continuous
  batching is on by default there; flash attention on its default, auto; a KV buffer per slot, its
  default: with ``--kv-unified`` it was slower at every level on the H200, docs/benchmarks), plus
  --llama-args.

One uncounted request first (one-time costs); each level runs --waves requests per concurrent slot,
at least --min-requests (at most --duration-s). Prints a markdown table: output tok/s, TTFT / TPOT /
ITL median and p99, and the ratio of onnxgen's output tok/s to llama.cpp's at each level.
llama.cpp's server streams a chunk per token and reports the tokens in ``timings.predicted_n``
where it sends no usage (serve_load counts that).
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import time
import urllib.request
from datetime import datetime
from pathlib import Path

from bench import serve_load
from bench.llamacpp_peer import ensure_gguf, tree_problem
from bench.peers_decode import ensure_checkpoint, ensure_package
from onnxgen.models.random_source import MODEL_SHAPES


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, process: subprocess.Popen, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{what} exited with {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    process.kill()
    raise SystemExit(f"{what} was not ready within {timeout_s:.0f} s")


def load_args(args: argparse.Namespace, concurrency: int) -> argparse.Namespace:
    """What serve_load's levels read: --waves requests per slot (at least --min-requests)."""
    return argparse.Namespace(
        seed=args.seed, requests=max(args.min_requests, args.waves * concurrency), duration_s=args.duration_s,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens, text_prompt=None, id_low=100, id_high=10000, served_model=None,
        shared_prefix_tokens=0,
    )  # fmt: skip


def drive(port: int, args: argparse.Namespace, name: str) -> list[tuple[int, dict]]:
    target = serve_load.Target("127.0.0.1", port, None)
    level_args = load_args(args, 1)
    probe = serve_load.stream_completion(
        target, serve_load.request_body(level_args, random.Random(args.seed + 1)), args.duration_s
    )
    if not probe.ok:
        say(f"{name}: the first request failed: {probe.error}")
    rows = []
    for concurrency in args.concurrency:
        level_args = load_args(args, concurrency)
        say(f"{name}: concurrency {concurrency}, {level_args.requests} requests")
        metrics = serve_load.run_level(target, level_args, concurrency, None)
        for error in metrics["errors"]:
            say(f"  failed: {error}")
        say(f"  {metrics['output_throughput']:.1f} tok/s")
        rows.append((concurrency, metrics))
    return rows


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()


def run_onnxgen(package: Path, args: argparse.Namespace, log: Path) -> list[tuple[int, dict]]:
    port = free_port()
    slots, length = max(args.concurrency), args.prompt_tokens + args.output_tokens + 16
    command = [sys.executable, "-m", "onnxgen", "serve", "--model", str(package), "--device", args.device,
               "--port", str(port), "--max-num-seqs", str(slots), "--max-model-len", str(length),
               "--max-queue", str(max(64, 2 * slots)), *args.onnxgen_args]  # fmt: skip
    return serve_and_drive(command, port, args, log, "onnxgen")


def run_llamacpp(gguf: Path, args: argparse.Namespace, log: Path) -> list[tuple[int, dict]]:
    binary = args.llamacpp / "build/bin/llama-server"
    port = free_port()
    slots, length = max(args.concurrency), args.prompt_tokens + args.output_tokens + 16
    command = [str(binary), "-m", str(gguf), "-ngl", "999", "-np", str(slots), "-c", str(slots * length),
               "--host", "127.0.0.1", "--port", str(port), *args.llama_args]  # fmt: skip
    return serve_and_drive(command, port, args, log, "llama.cpp")


def serve_and_drive(
    command: list[str], port: int, args: argparse.Namespace, log: Path, name: str
) -> list[tuple[int, dict]]:
    """Starts the server (its output into ``log``), drives every level once it is healthy, stops it."""
    say(f"{name}: " + " ".join(command))
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_healthy(port, process, args.load_timeout_s, name)
            return drive(port, args, name)
        finally:
            stop(process)


def table(results: dict[tuple[str, str], list[tuple[int, dict]]]) -> list[str]:
    lines = [
        "| precision | server | concurrency | output tok/s | onnxgen / llama.cpp | TTFT ms median / p99 "
        "| TPOT ms median / p99 | ITL ms median / p99 | failed |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (precision, server), rows in results.items():
        peer = dict(results.get((precision, "llama.cpp"), []))
        for concurrency, m in rows:
            ratio = ""
            if server == "onnxgen" and concurrency in peer and peer[concurrency]["output_throughput"] > 0:
                ratio = f"{m['output_throughput'] / peer[concurrency]['output_throughput']:.2f}x"
            lines.append(
                f"| {precision} | {server} | {concurrency} | {m['output_throughput']:.1f} | {ratio} "
                f"| {m['ttft_median_ms']:.1f} / {m['ttft_p99_ms']:.1f} | {m['tpot_median_ms']:.2f} / "
                f"{m['tpot_p99_ms']:.2f} | {m['itl_median_ms']:.2f} / {m['itl_p99_ms']:.2f} | {m['failed']} |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-coder-0.5b-instruct", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--precision", default="fp16,int4", help="comma list of fp16, int4")
    parser.add_argument("--workdir", type=Path, required=True, help="the checkpoint, packages and GGUFs")
    parser.add_argument("--llamacpp", type=Path, help="a built llama.cpp tree (llama-server)")
    parser.add_argument("--tokenizer-from", type=Path, help="a directory with a real tokenizer.json for the converter")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run of onnxgen only")
    parser.add_argument("--concurrency", type=serve_load.positive_ints, default=[1, 8, 32, 64, 128])
    parser.add_argument("--waves", type=int, default=2, help="requests per level: this many per concurrent slot")
    parser.add_argument("--min-requests", type=int, default=16, help="requests per level at least")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--duration-s", type=float, default=120.0, help="at most this long per level")
    parser.add_argument("--load-timeout-s", type=float, default=300.0)
    parser.add_argument("--servers", default="llama.cpp,onnxgen", help="comma list of llama.cpp, onnxgen")
    parser.add_argument("--onnxgen-args", type=str.split, default=[], help="more `onnxgen serve` arguments")
    parser.add_argument("--llama-args", type=str.split, default=[], help="more llama-server arguments")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write every level's metrics here")
    args = parser.parse_args(argv)
    precisions = [p for p in args.precision.split(",") if p]
    servers = [s for s in args.servers.split(",") if s]
    if not set(precisions) <= {"fp16", "int4"} or not set(servers) <= {"llama.cpp", "onnxgen"}:
        parser.error("--precision takes fp16,int4 and --servers llama.cpp,onnxgen")
    if "llama.cpp" in servers:
        if args.llamacpp is None or args.tokenizer_from is None:
            parser.error("llama.cpp's server needs --llamacpp and --tokenizer-from (or --servers onnxgen)")
        if problem := tree_problem(args.llamacpp):
            parser.error(problem)
    args.workdir.mkdir(parents=True, exist_ok=True)
    results: dict[tuple[str, str], list[tuple[int, dict]]] = {}
    for precision in precisions:
        build = argparse.Namespace(precision=precision, label=args.shape, seed=args.seed, device=args.device,
                                   config=MODEL_SHAPES[args.shape])  # fmt: skip
        hf_dir = ensure_checkpoint(build, args.workdir)
        for server in servers:
            log = args.workdir / f"{server}-{precision}.log"
            if server == "onnxgen":
                package = ensure_package(build, hf_dir, args.workdir)
                results[(precision, server)] = run_onnxgen(package, args, log)
            else:
                gguf = ensure_gguf(args.llamacpp, hf_dir, args.tokenizer_from, args.workdir, precision)
                results[(precision, server)] = run_llamacpp(gguf, args, log)
    print(f"{args.shape}, random weights; {args.prompt_tokens} prompt ids + {args.output_tokens} output tokens "
          f"(ignore_eos), greedy, streamed; {args.waves} requests per concurrent slot (at least "
          f"{args.min_requests}) per level\n")  # fmt: skip
    print("\n".join(table(results)))
    print(f"\ndate: {datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}")
    print("command: python3 -m bench.serve_peers " + " ".join(argv if argv is not None else sys.argv[1:]))
    if args.json:
        rows = [{"precision": p, "server": s, "concurrency": c, **m} for (p, s), r in results.items() for c, m in r]
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
