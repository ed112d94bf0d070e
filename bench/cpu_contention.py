"""CPU decode under contention: onnxgen and onnxruntime-genai, alone, two at once, beside a busy core.

    python -m bench.cpu_contention                                   # default package, 64 tokens
    python -m bench.cpu_contention --variant default --variant threads=1 --variant "env:OMP_WAIT_POLICY=ACTIVE"
    python -m bench.cpu_contention --engines onnxgen --conditions alone,busy

Every measurement is a fresh process (a worker: this script with --worker), so one engine's
threads or memory never leak into another's numbers. A worker loads the package, runs one warm-up
generation of 8 tokens, says "ready" and waits for "go" on stdin; the parent starts the timed
generations together, so in "two" both decode at the same time. Conditions:

- alone: one worker;
- two: two workers of the same engine and variant at once (the rate printed is each one's, min/max);
- busy: one worker beside a neighbour process that keeps one core busy (a Python busy loop).

onnxgen variants (--variant, repeatable): "default" (what a user gets), "threads=N" (onnxgen's
--threads option), "env:NAME=VALUE[,NAME=VALUE]" (environment of the worker, e.g. OMP_NUM_THREADS=1
or OMP_WAIT_POLICY=ACTIVE for torch's own spin-waiting). onnxruntime-genai runs with its defaults.
Greedy, EOS ignored, exactly --new-tokens tokens; decode tok/s counts the tokens after the first
(GenerationStats' convention, both engines). Peak RSS is the worker's VmHWM at its end. Every
worker has a wall-clock limit (--timeout); a worker past it is killed and reported as such.
The load average before and after is printed: on a shared machine, read the numbers with it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench import ROOT, module_command

DEFAULT_PACKAGE = Path.home() / ".cache/onnxgen/packages/smollm2-135m-instruct-int4-cpu-gqa"
PROMPT = "Once upon a time, in a small village, there lived"


def peak_rss_mib() -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker(engine: str, package: Path, new_tokens: int, threads: int | None) -> None:
    """Load, warm up, wait for "go", generate once, print one JSON line."""
    from bench.genai_peer import run_genai, run_onnxgen

    if engine == "onnxgen":
        from onnxgen.genai import Generator

        options = {}
        if threads is not None:
            from onnxgen.threads import ThreadOptions

            options["threads"] = ThreadOptions(num_threads=threads)
        generator = Generator(package, **options)
        ids = generator.encode(PROMPT)
        run_onnxgen(generator, ids, 8)

        def once():
            return run_onnxgen(generator, ids, new_tokens)
    else:
        import onnxruntime_genai as og

        model = og.Model(str(package))
        ids = list(og.Tokenizer(model).encode(PROMPT))
        run_genai(model, ids, 8)

        def once():
            return run_genai(model, ids, new_tokens)

    print("ready", flush=True)
    sys.stdin.readline()
    run = once()
    print(json.dumps({"tok_s": run.decode_tok_s, "ttft_ms": run.ttft_s * 1000, "rss_mib": peak_rss_mib()}), flush=True)


def parse_variant(text: str) -> tuple[dict[str, str], int | None]:
    if text == "default":
        return {}, None
    if text.startswith("threads="):
        return {}, int(text.split("=", 1)[1])
    if text.startswith("env:"):
        return dict(item.split("=", 1) for item in text[4:].split(",")), None
    raise SystemExit(f"unknown variant {text!r} (default, threads=N or env:NAME=VALUE,...)")


def spawn(engine: str, args: argparse.Namespace, env_extra: dict[str, str], threads: int | None) -> subprocess.Popen:
    cmd = [*module_command("bench.cpu_contention"), "--worker", engine, "--package", str(args.package)]
    cmd += ["--new-tokens", str(args.new_tokens)] + (["--threads", str(threads)] if threads else [])
    env = dict(os.environ, **env_extra)
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def measure(engine: str, count: int, busy: bool, args, env_extra, threads) -> list[dict] | str:
    """``count`` workers decoding at once (with a busy neighbour if asked); their JSON results."""
    procs = [spawn(engine, args, env_extra, threads) for _ in range(count)]
    neighbour = None
    deadline = time.monotonic() + args.timeout
    try:
        for p in procs:  # loading and warm-up happen before the neighbour starts, one at a time is fine
            if p.stdout.readline().strip() != "ready":
                return "worker failed"
        if busy:
            neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            time.sleep(0.5)
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return f"timed out after {args.timeout:.0f} s (killed)"
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--package", type=Path, default=DEFAULT_PACKAGE)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--variant", action="append", help="onnxgen variant (repeatable; default: 'default')")
    parser.add_argument("--engines", default="onnxgen,genai")
    parser.add_argument("--conditions", default="alone,two,busy")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds per measurement")
    parser.add_argument("--worker", choices=["onnxgen", "genai"], help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.package, args.new_tokens, args.threads)
        return
    conditions = {"alone": (1, False), "two": (2, False), "busy": (1, True)}
    print(f"package {args.package}, {args.new_tokens} new tokens, greedy, nproc {os.cpu_count()}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"| engine | variant | condition | decode tok/s | TTFT ms | peak RSS MiB |\n|{' --- |' * 6}")
    runs = []
    for engine in args.engines.split(","):
        for variant in (args.variant or ["default"]) if engine == "onnxgen" else ["default"]:
            env_extra, threads = parse_variant(variant)
            for name in args.conditions.split(","):
                count, busy = conditions[name]
                result = measure(engine, count, busy, args, env_extra, threads)
                if isinstance(result, str):
                    print(f"| {engine} | {variant} | {name} | {result} | | |", flush=True)
                    continue
                rates = [r["tok_s"] for r in result]
                rate = f"{rates[0]:.1f}" if count == 1 else f"{min(rates):.1f} / {max(rates):.1f}"
                ttft = max(r["ttft_ms"] for r in result)
                rss = max(r["rss_mib"] for r in result)
                print(f"| {engine} | {variant} | {name} | {rate} | {ttft:.0f} | {rss:.0f} |", flush=True)
                runs.append((engine, variant, name, rates, rss))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
