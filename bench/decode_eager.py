"""Eager decode speed of a random-weights package in a real model's shape (no tokenizer needed).

    python -m bench.decode_eager --shape smollm2-135m-instruct --precision fp16 --device cuda --kv static

Prints build time, TTFT and decode tok/s (tokens after the first) for onnxgen's eager executor.
"""

from __future__ import annotations

import argparse
import tempfile

from bench.random_package import add_package_args, build_random_package, describe, greedy_run, make_engine, open_package


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_package_args(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        build_s = build_random_package(args, tmp)
        session, config = open_package(args)
        engine = make_engine(session, config, args)  # capture off: the eager executor
        greedy_run(engine, args, new_tokens=8)  # warm-up
        runs = sorted(greedy_run(engine, args) for _ in range(3))
        ttft, decode_s, _ = sorted(runs, key=lambda r: r[1])[1]
        n = args.new_tokens - 1
        print(
            f"{describe(args)} on {args.device}: build {build_s:.1f} s, "
            f"TTFT {1000 * ttft:.1f} ms, decode {n / decode_s:.1f} tok/s ({1000 * decode_s / n:.2f} ms/token, "
            f"eager, median of 3)"
        )


if __name__ == "__main__":
    main()
