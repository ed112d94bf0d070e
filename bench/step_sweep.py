"""The captured decode step under several kernel settings, in one process (GPU; random weights).

    python -m bench.step_sweep --shape qwen2.5-coder-0.5b-instruct --precision fp16 --context 512 \\
        --variant "cublas:" --variant "triton:ONNXGEN_TRITON_LINEAR=1" \\
        --variant "triton-nopdl:ONNXGEN_TRITON_LINEAR=1,ONNXGEN_PDL=0" \\
        --variant "gate_up-1k:ONNXGEN_TRITON_LINEAR=1,ONNXGEN_GEMV_DENSE_9728x896=8,1024,8"

The package is built and opened once; each variant puts its settings in force (names not given
go back to the process environment's value, or the default for the swept ones: the variants do not
leak into each other), records a fresh CaptureRuntime, and runs the greedy loop of capture_decode.py
(warm-up, then the median of --repeats). It prints tok/s per variant and whether its tokens match
the first variant's (kernel settings change summation order, so with random weights a late token may
differ; every variant is one real run, nothing is reused).
The settings are onnxgen.options switches (docs/options.md), applied in this process through
options.using, plus the two loop switches random_package.py reads from the environment; a name that
is neither stops the sweep before it starts. Switches read when the session is built (ONNXGEN_FUSE)
keep the process's value.
"""

from __future__ import annotations

import argparse
import contextlib
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
from onnxgen import options

SWEPT_PREFIXES = (
    "ONNXGEN_TRITON_LINEAR",
    "ONNXGEN_TRITON_Q4",
    "ONNXGEN_PDL",
    "ONNXGEN_GEMV_",
    "ONNXGEN_Q4_",
    "ONNXGEN_GQA_",
    "ONNXGEN_CONV_PROMPT",
    "ONNXGEN_GDN_",
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


# the decode engine's arguments (random_package.engine_switches), not onnxgen options
LOOP_SWITCHES = ("ONNXGEN_SAMPLE_IN_GRAPH", "ONNXGEN_HOST_TOKENS")
_IN_FORCE = contextlib.ExitStack()  # the options.using block of the variant applied last


def check_variant(env: dict[str, str]) -> None:
    unknown = [k for k in env if k not in LOOP_SWITCHES and not options.env_names(k)]
    if unknown:
        raise SystemExit(f"unknown switch(es) {', '.join(unknown)}: see docs/options.md")
    options.from_env(env)  # a bad value fails here, before the package is built


def apply_env(env: dict[str, str]) -> None:
    """Put a variant's onnxgen switches in force until the next call, through options.using over the
    process environment's unswept ones (its loop switches go to the engine: engine_switches)."""
    check_variant(env)
    env = {k: v for k, v in env.items() if k not in LOOP_SWITCHES}
    base = {k: v for k, v in os.environ.items() if not k.startswith(SWEPT_PREFIXES)}
    _IN_FORCE.close()
    _IN_FORCE.enter_context(options.using(options.from_env({**base, **env})))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_package_args(parser)
    parser.add_argument("--variant", action="append", required=True, help="NAME:ENV=VALUE,ENV=VALUE")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--replay-recorder", action="store_true", help="CPU stand-in for CUDA graphs (smoke test)")
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variant]
    for _, env in variants:
        check_variant(env)
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
