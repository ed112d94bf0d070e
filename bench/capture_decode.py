"""Decode speed with CUDA-graph capture on vs off, in the same run (random weights, real model shape).

    python -m bench.capture_decode --shape qwen2.5-coder-0.5b-instruct --precision fp16 --attention gqa --kv static
    python -m bench.capture_decode --shape smollm2-135m-instruct --attention standard --kv dynamic --capture verify

For each mode it decodes --new-tokens greedy tokens after a --prompt-tokens prompt (median of
--repeats runs, after a warm-up run) and prints decode tok/s (tokens after the first), ms/token,
TTFT, the ratio, and the capture statistics (segments per step, replays, seams and their reasons).
Both modes must produce the same tokens: the script fails loudly if they do not. --capture verify
additionally checks the first --verify-steps steps bit for bit against an eager run of each.
With static KV the captured loop is pipelined (step N+1 enqueued before token N is read, as the
Generator does); --no-pipeline runs it sequentially, to compare the two. Both modes run the decode
engine (onnxgen/genai/engine.py), the Generator's loop: see random_package.py for --tail and
--host-tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

from bench.random_package import (
    GreedyRun,
    add_package_args,
    build_random_package,
    describe,
    greedy_run,
    make_engine,
    open_package,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_package_args(parser)
    parser.add_argument("--capture", default="on", choices=["on", "verify"])
    parser.add_argument("--verify-steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--capture-only", action="store_true", help="skip the eager (capture off) runs")
    parser.add_argument("--replay-recorder", action="store_true", help="CPU stand-in for CUDA graphs (smoke test)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        build_s = build_random_package(args, tmp)
        print(f"{describe(args)}: built in {build_s:.1f} s", flush=True)
        session, config = open_package(args)
        recorder = None
        if args.replay_recorder:
            from onnxgen.runtime.capture.recorder import ReplayRecorder

            recorder = ReplayRecorder()
        t0 = time.perf_counter()
        captured = make_engine(session, config, args, capture=args.capture, recorder=recorder,
                               verify_steps=args.verify_steps)  # fmt: skip
        captured.capture_runtime()
        plan_s = time.perf_counter() - t0
        results: dict[str, GreedyRun] = {}
        modes = [captured] if args.capture_only else [make_engine(session, config, args), captured]
        for engine in modes:
            mode = engine.capture
            t0 = time.perf_counter()
            greedy_run(engine, args)  # warm-up (for capture: warm-up steps, recording, replays)
            warm_s = time.perf_counter() - t0
            runs = [greedy_run(engine, args) for _ in range(args.repeats)]
            decode_s = statistics.median(r.decode_s for r in runs)
            ttft = statistics.median(r.ttft_s for r in runs)
            results[mode] = GreedyRun(ttft, decode_s, runs[0].tokens)
            n = args.new_tokens - 1
            loop_kind = "pipelined" if engine.pipelined else "sequential"
            print(
                f"{describe(args)} capture {mode:6s} ({loop_kind}): "
                f"{n / decode_s:8.1f} tok/s  ({1000 * decode_s / n:.3f} ms/token, TTFT {1000 * ttft:.1f} ms, "
                f"median of {args.repeats}; first run {warm_s:.1f} s)",
                flush=True,
            )
        print(captured.capture_stats.summary())
        if args.capture_only:
            return 0
        (_, off_s, off_tokens), (_, on_s, on_tokens) = results["off"], results[args.capture]
        print(f"ratio on/off: {off_s / on_s:.2f}x   (runtime construction {plan_s:.1f} s)")
        if on_tokens != off_tokens:
            first = next(i for i, (a, b) in enumerate(zip(on_tokens, off_tokens)) if a != b)
            print(f"FAIL: greedy tokens differ at position {first}", file=sys.stderr)
            return 1
        print(f"greedy tokens identical ({len(on_tokens)} tokens)")
        return 0


if __name__ == "__main__":
    sys.exit(main())
