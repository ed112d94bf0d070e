"""Shared by the GPU decode benches: a random-weights package in a real model's shape, and greedy
decoding of a seeded prompt through the decode engine (onnxgen/genai/engine.py), the Generator's own
loop: pipelined with a captured static-KV step, as the Generator's default on CUDA (--no-pipeline for
the sequential loop), the argmax in the step's graph (--tail outside keeps it between the steps),
the token stored in pinned host memory by that tail (--host-tokens copy copies it instead)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from onnxgen.genai.benchmark import prompt_ids
from onnxgen.genai.engine import DecodeEngine, engine_model
from onnxgen.genai.graph_layout import with_graph_layout
from onnxgen.genai.package import PackageConfig, load_package_config
from onnxgen.genai.sampling import SamplingParams
from onnxgen.models.builder import build_package
from onnxgen.models.random_source import MODEL_SHAPES, RandomSource
from onnxgen.runtime import InferenceSession
from onnxgen.runtime.model_io import load_model

# variant settings (step_sweep.py, step_anatomy.py: --variant NAME:ONNXGEN_HOST_TOKENS=0) that are the
# engine's arguments, not environment the runtime reads: the name, the engine argument it sets
ENGINE_SWITCHES = {"ONNXGEN_SAMPLE_IN_GRAPH": "sample_in_graph", "ONNXGEN_HOST_TOKENS": "host_tokens"}


def add_package_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="smollm2-135m-instruct", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--precision", default="fp16", choices=["fp32", "fp16", "int4"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--attention", default="gqa", choices=["gqa", "standard"])
    parser.add_argument("--kv", default="static", choices=["static", "dynamic"])
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--package", default=None, help="an existing package instead of random weights")
    parser.add_argument(
        "--int4-zero-points",
        default="exact",
        choices=["exact", "packed", "none"],
        help="int4's zero points (onnxgen build's option; random weights are on no 4-bit grid, so exact "
        "writes packed ones; none: symmetric blocks, onnxruntime-genai's builder's default form)",
    )
    parser.add_argument(
        "--no-pipeline",
        action="store_true",
        help="captured static-KV decode reads each token before building the next step (the old sequential "
        "loop) instead of enqueuing step N+1 before waiting for token N",
    )
    parser.add_argument(
        "--tail",
        default="graph",
        choices=["graph", "outside"],
        help="where greedy's argmax, next position and mask row run with a captured static-KV step: in the "
        "step's graph (the Generator's default) or as kernels between the steps",
    )
    parser.add_argument(
        "--host-tokens",
        default="pinned",
        choices=["pinned", "copy"],
        help="the in-graph tail stores each token in pinned host memory (default), or the loop copies it",
    )


def build_random_package(args: argparse.Namespace, directory: str | Path) -> float:
    """Builds the random-weights package into ``directory`` (or, with --package, points args at it)."""
    if args.package:
        args.package_dir = Path(args.package)
        return 0.0
    args.package_dir = Path(directory)
    t0 = time.perf_counter()
    build_package(
        RandomSource(MODEL_SHAPES[args.shape]),
        directory,
        precision=args.precision,
        device=args.device,
        attention=args.attention,
        context_length=args.context,
        int4_zero_points=getattr(args, "int4_zero_points", "exact") if args.precision == "int4" else "exact",
    )
    return time.perf_counter() - t0


def engine_switches(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> dict[str, bool]:
    """The engine arguments of --tail and --host-tokens, overridden by a variant's ``env`` where it
    names ONNXGEN_SAMPLE_IN_GRAPH or ONNXGEN_HOST_TOKENS ("0": off, anything else: on)."""
    switches = {
        "sample_in_graph": getattr(args, "tail", "graph") != "outside",
        "host_tokens": getattr(args, "host_tokens", "pinned") != "copy",
    }
    for name, argument in ENGINE_SWITCHES.items():
        if env is not None and name in env:
            switches[argument] = env[name] != "0"
    return switches


def make_engine(
    session: InferenceSession,
    config: PackageConfig,
    args: argparse.Namespace,
    capture: str = "off",
    recorder: Any = None,
    verify_steps: int = 8,
    **switches: bool,
) -> DecodeEngine:
    """The decode engine for the bench's options: one static cache of --context rows, reused across
    runs (reset in place, so a recorded graph keeps its addresses from one run to the next); pipelined
    where the step is captured with static KV, unless --no-pipeline. ``switches``: sample_in_graph
    and host_tokens (default: engine_switches(args))."""
    pipelined = capture != "off" and args.kv == "static" and not getattr(args, "no_pipeline", False)
    return DecodeEngine(
        session,
        config,
        kv=args.kv,
        capture=capture,
        recorder=recorder,
        verify_steps=verify_steps,
        pipeline=pipelined,
        kv_capacity=args.context if args.kv == "static" else None,
        **(switches or engine_switches(args)),
    )


class GreedyRun(NamedTuple):
    ttft_s: float  # prefill + the first token read back
    decode_s: float  # the tokens after the first
    tokens: list[int]


def greedy_run(
    engine: DecodeEngine,
    args: argparse.Namespace,
    new_tokens: int | None = None,
    after_prefill: Callable[[], None] | None = None,
    params: SamplingParams | None = None,
) -> GreedyRun:
    """Greedy decoding (or ``params``' sampling) of the seeded --prompt-tokens prompt for exactly
    ``new_tokens`` (default --new-tokens) tokens, EOS ignored. ``after_prefill()`` is called once the
    first token is read back (a profiler starts there; its time counts in TTFT, not in decode)."""
    ids = prompt_ids(engine.config.vocab_size, args.prompt_tokens)
    n_new = args.new_tokens if new_tokens is None else new_tokens
    params = dataclasses.replace(params or SamplingParams(), max_new_tokens=n_new, ignore_eos=True)
    sequence = engine.new_sequence(ids, params)
    tokens = list(engine.generate([sequence], after_first_read=after_prefill))
    return GreedyRun(sequence.stats.ttft_s, sequence.stats.decode_s, tokens)


def open_package(args: argparse.Namespace) -> tuple[InferenceSession, PackageConfig]:
    config = load_package_config(args.package_dir)
    model, directory = load_model(config.model_file)
    config = with_graph_layout(config, model)  # a hybrid's KV layers and carried states come from its graph
    return InferenceSession(engine_model(model, config), device=args.device, base_dir=directory), config


def describe(args: argparse.Namespace) -> str:
    what = str(args.package) if args.package else f"{args.shape} {args.precision} {args.attention} (random weights)"
    return f"{what} kv={args.kv}"


def main() -> None:
    """``python -m bench.random_package --shape S --precision P --context C --out DIR``: the package alone,
    for benches given --package (bench/tree_ab.sh runs one bench under several code versions on it)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    add_package_args(parser)
    parser.add_argument("--out", required=True, help="the package's folder (created)")
    args = parser.parse_args()
    args.package = None
    seconds = build_random_package(args, args.out)
    print(f"built {args.out} ({describe(args)}) in {seconds:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
