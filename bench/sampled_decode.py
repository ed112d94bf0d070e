"""Sampled decoding against greedy, in the same run: tok/s per sampling setting, the sampler in the
step's graph (the default) and between the steps, and the same tokens as eager decoding.

    python -m bench.sampled_decode --shape qwen2.5-coder-0.5b-instruct --precision fp16
    python -m bench.sampled_decode --shape smollm2-135m-instruct --device cpu --replay-recorder \\
        --new-tokens 8 --repeats 1   # CPU smoke run of the same logic

For each setting of SETTINGS (greedy first), with seed 0: the captured engine decodes --new-tokens
tokens after a --prompt-tokens prompt (median of --repeats runs after one warm-up run) with the
sampler in the step's tail, then with the sampler between the steps (--tail outside's loop), and
an eager engine (capture off) decodes the same prompt once. All three must give the same tokens
(the draw is a counter-based hash of the seed: captured, eager and replayed draws agree bit for
bit); the script fails loudly if they do not. ``--capture verify`` also compares the first
--verify-steps steps of each captured run with an eager run of the same step, tail state included.
It prints tok/s, the ratio to greedy's tok/s in the graph, and where the tail ran.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile

from bench.random_package import add_package_args, build_random_package, describe, greedy_run, make_engine, open_package
from onnxgen.genai.sampling import SamplingParams

SETTINGS: dict[str, SamplingParams] = {
    "greedy": SamplingParams(),
    "temperature 0.8": SamplingParams(temperature=0.8, seed=0),
    "top-k 50": SamplingParams(temperature=0.8, top_k=50, seed=0),
    "top-p 0.95": SamplingParams(temperature=0.8, top_p=0.95, seed=0),
    "min-p 0.05": SamplingParams(temperature=0.8, min_p=0.05, seed=0),
    "penalties": SamplingParams(
        temperature=0.8, repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.3, seed=0
    ),
    "all": SamplingParams(
        temperature=0.8, top_k=50, top_p=0.95, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.3, seed=0
    ),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_package_args(parser)
    parser.add_argument("--capture", default="on", choices=["on", "verify"])
    parser.add_argument("--verify-steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated names of SETTINGS")
    parser.add_argument("--replay-recorder", action="store_true", help="CPU stand-in for CUDA graphs (smoke test)")
    args = parser.parse_args()
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; known: {', '.join(SETTINGS)}")
    with tempfile.TemporaryDirectory() as tmp:
        build_s = build_random_package(args, tmp)
        print(f"{describe(args)}: built in {build_s:.1f} s", flush=True)
        session, config = open_package(args)
        recorder = None
        if args.replay_recorder:
            from onnxgen.runtime.capture.recorder import ReplayRecorder

            recorder = ReplayRecorder()
        kw = {"capture": args.capture, "recorder": recorder, "verify_steps": args.verify_steps}
        in_graph = make_engine(session, config, args, **kw, sample_in_graph=True, host_tokens=True)
        outside = make_engine(session, config, args, **kw, sample_in_graph=False, host_tokens=True)
        eager = make_engine(session, config, args)
        greedy_tok_s = None
        failed = False
        print(f"{'setting':<16} {'in graph tok/s':>15} {'vs greedy':>10} {'between tok/s':>14}  tail")
        for name in names:
            params = SETTINGS[name]
            rates = {}
            tokens = {}
            for label, engine in (("graph", in_graph), ("between", outside)):
                greedy_run(engine, args, params=params)  # warm-up: plans and records
                runs = [greedy_run(engine, args, params=params) for _ in range(args.repeats)]
                rates[label] = statistics.median((len(r.tokens) - 1) / r.decode_s for r in runs if r.decode_s > 0)
                tokens[label] = {tuple(r.tokens) for r in runs}
            want = tuple(greedy_run(eager, args, params=params).tokens)
            same = tokens["graph"] == tokens["between"] == {want}
            if name == "greedy":
                greedy_tok_s = rates["graph"]
            ratio = rates["graph"] / greedy_tok_s if greedy_tok_s else float("nan")
            tail = in_graph.capture_stats.tail
            print(f"{name:<16} {rates['graph']:>15.1f} {ratio:>9.2f}x {rates['between']:>14.1f}  {tail}", flush=True)
            if not same:
                failed = True
                print(f"  MISMATCH: {name}: in graph {sorted(tokens['graph'])[:1]}, between "
                      f"{sorted(tokens['between'])[:1]}, eager {list(want)}", file=sys.stderr)  # fmt: skip
        stats = in_graph.capture_stats
        print(f"in graph: {stats.summary()}")
        if args.capture == "verify":
            print(f"verified steps: {stats.verified_steps}")
        return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
