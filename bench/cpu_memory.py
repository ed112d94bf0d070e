"""CPU memory and long-generation speed: onnxgen and onnxruntime-genai on the same package.

    python -m bench.cpu_memory                          # both parts, default package
    python -m bench.cpu_memory --part peak              # peak RSS of a 64-token run only
    python -m bench.cpu_memory --part long --long-tokens 2000
    python -m bench.cpu_memory --part prefill --prompt-tokens 8000 --engines onnxgen

Every measurement is a fresh process (this script with --worker), so one engine's memory never
counts for the other. Parts:

- peak: load the package, one greedy generation of --new-tokens (64) tokens, EOS ignored; peak
  RSS (VmHWM) at the end, and the RSS after importing the engine (its libraries alone).
- long: one greedy generation of --long-tokens tokens with dynamic KV (onnxgen kv="dynamic";
  onnxruntime-genai with past_present_share_buffer false, as the package says), EOS ignored;
  RSS and the decode rate over the last 50 tokens at tokens 1, 500, 1000, 2000 (the marks reached).
- prefill: a prompt of --prompt-tokens tokens (a text repeated), one new token: prefill seconds and peak RSS.

Each worker has a wall-clock limit (--timeout). Load average before/after is printed: read rates
on a shared machine with it (RSS does not depend on load).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

from bench import ROOT, module_command

DEFAULT_PACKAGE = Path.home() / ".cache/onnxgen/packages/smollm2-135m-instruct-int4-cpu-gqa"
PROMPT = "Once upon a time, in a small village, there lived"
FILLER = "The quick brown fox jumps over the lazy dog while the river runs to the sea. "
MARKS = (1, 500, 1000, 2000, 4000)
WINDOW = 50  # tokens over which a mark's rate is taken


def rss_mib(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Engine:
    """One engine's load and token stream (a generator of token ids), for the worker."""

    def __init__(self, name: str, package: Path):
        self.name = name
        if name == "onnxgen":
            from onnxgen.genai import Generator

            self.imported_mib = rss_mib()
            self.generator = Generator(package, kv="dynamic")
        else:
            import onnxruntime_genai as og

            self.og = og
            self.imported_mib = rss_mib()
            self.model = og.Model(str(package))
            self.tokenizer = og.Tokenizer(self.model)

    def encode(self, text: str) -> list[int]:
        if self.name == "onnxgen":
            return self.generator.tokenizer.encode(text)
        return list(self.tokenizer.encode(text))

    def tokens(self, ids: list[int], new: int):
        if self.name == "onnxgen":
            from onnxgen.genai import SamplingParams

            yield from self.generator.generate_ids(ids, SamplingParams(max_new_tokens=new, ignore_eos=True))
            return
        params = self.og.GeneratorParams(self.model)
        total = len(ids) + new
        params.set_search_options(do_sample=False, max_length=total, min_length=total)
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(ids)
        while not generator.is_done():
            generator.generate_next_token()
            yield int(generator.get_next_tokens()[0])


def worker(args: argparse.Namespace) -> None:
    engine = Engine(args.worker, args.package)
    result: dict = {"imported_mib": engine.imported_mib, "loaded_mib": rss_mib()}
    if args.part == "peak":
        n = sum(1 for _ in engine.tokens(engine.encode(PROMPT), args.new_tokens))
        result.update(tokens=n)
    elif args.part == "prefill":
        ids = (engine.encode(FILLER * (args.prompt_tokens // 10 + 1)))[: args.prompt_tokens]
        start = time.perf_counter()
        next(iter(engine.tokens(ids, 1)))
        result.update(prompt=len(ids), prefill_s=time.perf_counter() - start)
    else:
        marks: dict[str, dict] = {}
        times: list[float] = []
        for i, _ in enumerate(engine.tokens(engine.encode(PROMPT), args.long_tokens), start=1):
            times.append(time.perf_counter())
            if i in MARKS:
                lo = max(0, i - WINDOW)
                rate = (i - 1 - lo) / (times[-1] - times[lo]) if i > 1 else 0.0
                marks[str(i)] = {"rss_mib": rss_mib(), "tok_s": rate}
        result.update(marks=marks)
    result["peak_mib"] = rss_mib("VmHWM")
    print(json.dumps(result), flush=True)


def run_worker(engine: str, part: str, args: argparse.Namespace) -> dict | str:
    cmd = [*module_command("bench.cpu_memory"), "--worker", engine, "--part", part, "--package", str(args.package)]
    cmd += ["--new-tokens", str(args.new_tokens), "--long-tokens", str(args.long_tokens)]
    cmd += ["--prompt-tokens", str(args.prompt_tokens)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return f"timed out after {args.timeout:.0f} s"
    if done.returncode != 0:
        return f"failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--package", type=Path, default=DEFAULT_PACKAGE)
    parser.add_argument("--part", default="peak,long", help="peak, long, prefill (comma-separated)")
    parser.add_argument("--engines", default="onnxgen,genai")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--prompt-tokens", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--worker", choices=["onnxgen", "genai"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"package {args.package}; torch threads: onnxgen's default unless OMP_NUM_THREADS is set")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for part in args.part.split(","):
        for engine in args.engines.split(","):
            r = run_worker(engine, part, args)
            if isinstance(r, str):
                print(f"{part:8s} {engine:8s} {r}", flush=True)
                continue
            head = f"{part:8s} {engine:8s} import {r['imported_mib']:.0f} MiB, loaded {r['loaded_mib']:.0f} MiB"
            if part == "peak":
                print(f"{head}, peak {r['peak_mib']:.0f} MiB after {r['tokens']} tokens", flush=True)
            elif part == "prefill":
                prefill = f"prompt {r['prompt']} tok: prefill+1 {r['prefill_s']:.1f} s"
                print(f"{head}, {prefill}, peak {r['peak_mib']:.0f} MiB", flush=True)
            else:
                marks = "; ".join(f"@{k}: {m['rss_mib']:.0f} MiB {m['tok_s']:.1f} tok/s" for k, m in r["marks"].items())
                print(f"{head}, peak {r['peak_mib']:.0f} MiB | {marks}", flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
