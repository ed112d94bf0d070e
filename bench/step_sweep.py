"""The captured decode step under several kernel settings, in one process (GPU; random weights).

    python -m bench.step_sweep --shape qwen2.5-coder-0.5b-instruct --precision fp16 --context 512 \\
        --variant "cublas:" --variant "triton:ONNXGEN_TRITON_LINEAR=1" \\
        --variant "triton-nopdl:ONNXGEN_TRITON_LINEAR=1,ONNXGEN_PDL=0" \\
        --variant "gate_up-1k:ONNXGEN_TRITON_LINEAR=1,ONNXGEN_GEMV_DENSE_9728x896=8,1024,8"

The package is built and opened once; each variant sets its environment (names not given are
unset: the variants do not leak into each other), records a fresh CaptureRuntime, and runs the
greedy loop of capture_decode.py (warm-up, then the median of --repeats). It prints tok/s per
variant and whether its tokens match the first variant's (kernel settings change summation order,
so with random weights a late token may differ; every variant is one real run, nothing is reused).
The settings read once per process (ONNXGEN_TRITON_LINEAR, ONNXGEN_TRITON_Q4, ONNXGEN_PDL) are re-read
per variant.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

from bench.random_package import (
    add_package_args,
    build_random_package,
    describe,
    engine_switches,
    greedy_run,
    make_engine,
    open_package,
)
from onnxgen.runtime.kernels import triton_support

SWEPT_PREFIXES = (
    "ONNXGEN_TRITON_LINEAR",
    "ONNXGEN_TRITON_Q4",
    "ONNXGEN_PDL",
    "ONNXGEN_GEMV_",
    "ONNXGEN_GQA_",
    "ONNXGEN_SAMPLE_IN_GRAPH",
    "ONNXGEN_HOST_TOKENS",
)


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, settings = text.partition(":")
    env: dict[str, str] = {}
    # "A=1,B=2,3,4": a value runs until the next NAME= item; a name given again takes the later value
    key = None
    for item in settings.split(","):
        if "=" in item:
            key, _, value = item.partition("=")
            key = key.strip()
            env[key] = value.strip()
        elif item.strip() and key is not None:
            env[key] += "," + item.strip()
    return name, env


def apply_env(env: dict[str, str]) -> None:
    for key in [k for k in os.environ if k.startswith(SWEPT_PREFIXES)]:
        del os.environ[key]
    os.environ.update(env)
    triton_support.linear_row_mode.cache_clear()
    triton_support.q4_row_enabled.cache_clear()
    triton_support._pdl_on_device.cache_clear()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_package_args(parser)
    parser.add_argument("--variant", action="append", required=True, help="NAME:ENV=VALUE,ENV=VALUE")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--replay-recorder", action="store_true", help="CPU stand-in for CUDA graphs (smoke test)")
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variant]
    with tempfile.TemporaryDirectory() as tmp:
        build_s = build_random_package(args, tmp)
        print(f"{describe(args)}: built in {build_s:.1f} s", flush=True)
        session, config = open_package(args)
        first_tokens: list[int] | None = None
        n = args.new_tokens - 1
        for name, env in variants:
            apply_env(env)
            recorder = None
            if args.replay_recorder:
                from onnxgen.runtime.capture.recorder import ReplayRecorder

                recorder = ReplayRecorder()
            # ONNXGEN_SAMPLE_IN_GRAPH / ONNXGEN_HOST_TOKENS in a variant are the engine's arguments
            engine = make_engine(session, config, args, capture="on", recorder=recorder, **engine_switches(args, env))
            greedy_run(engine, args)  # warm-up: warm-up steps, recording, replays
            runs = [greedy_run(engine, args) for _ in range(args.repeats)]
            decode_s = statistics.median(r[1] for r in runs)
            tokens = runs[0][2]
            first_tokens = first_tokens if first_tokens is not None else tokens
            same = "same tokens" if tokens == first_tokens else "tokens differ"
            print(
                f"{name:24s} {n / decode_s:8.1f} tok/s  ({1000 * decode_s / n:.3f} ms/token, median of "
                f"{args.repeats}; {same} as {variants[0][0]})  {env}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
