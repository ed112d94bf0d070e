"""Where a TTFT difference between two measuring paths comes from, in one process on one package.

bench.peers_decode times onnxgen's TTFT through the Generator, at the start of generations of
--new-tokens tokens; bench.prefill times it through the decode engine alone, over one-token
generations on a cache of --context rows. Where the two disagree across processes, this runs four
paths over the same package (two sessions) in one process, interleaved round by round so that
clocks and caches drift alike for all, and prints each one's median TTFT per prompt length
(docs/benchmarks/2026-12-06-h100-ttft-paths.md):

  engine-1     the decode engine as bench.prefill makes it (one static cache of --context rows), 1 new token
  engine-N     the same engine, --new-tokens new tokens (each TTFT follows a whole generation)
  generator-1  onnxgen.genai.Generator on the same package (its own session and cache sizing), 1 new token
  generator-N  the Generator, --new-tokens new tokens (as bench.peers_decode times it)

    python -m bench.ttft_paths --shape qwen3.5-0.8b --precision fp16 --lengths 16,64 --repeats 7
    python -m bench.ttft_paths --package /tmp/ttftgap/pkg-qwen3.5-0.8b-fp16-cuda-gqa-seed0 --lengths 16,64

engine-1 against engine-N isolates what a preceding generation leaves behind; engine against
generator at the same token count isolates the Generator's configuration (cache capacity, switches).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable

import torch

from bench.genai_peer import run_onnxgen
from bench.peers_decode import write_tokenizer
from bench.random_package import add_package_args, build_random_package, describe, greedy_run, make_engine, open_package
from onnxgen.genai import Generator
from onnxgen.genai.benchmark import prompt_ids
from onnxgen.models.random_source import MODEL_SHAPES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_package_args(parser)
    parser.add_argument("--lengths", default="16,64", help="prompt lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds after --warmup ones")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds (recordings happen here)")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if max(lengths) + args.new_tokens > args.context:
        parser.error(f"--context {args.context} is too small for {max(lengths)} + {args.new_tokens} tokens")
    capture = "on" if args.device == "cuda" else "off"
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        build_random_package(args, tmp)
        if not (args.package_dir / "tokenizer.json").exists():  # a random package: the Generator wants one
            write_tokenizer(MODEL_SHAPES[args.shape], args.package_dir)
        session, config = open_package(args)
        print(f"ttft_paths: {describe(args)}, capture {capture}, device {args.device}, context {args.context}")
        engine = make_engine(session, config, args, capture=capture)
        # its own session over the package as written (the engine's session runs engine_model's graph)
        generator = Generator(args.package_dir, device=args.device, capture=capture)

        def engine_path(new_tokens: int) -> Callable[[], float]:
            return lambda: greedy_run(engine, args, new_tokens=new_tokens).ttft_s

        def generator_path(new_tokens: int) -> Callable[[], float]:
            return lambda: run_onnxgen(generator, prompt_ids(config.vocab_size, args.prompt_tokens), new_tokens).ttft_s

        paths = {
            "engine-1": engine_path(1),
            "engine-N": engine_path(args.new_tokens),
            "generator-1": generator_path(1),
            "generator-N": generator_path(args.new_tokens),
        }
        for n in lengths:
            args.prompt_tokens = n
            times: dict[str, list[float]] = {name: [] for name in paths}
            for round_ in range(args.warmup + args.repeats):
                for name, path in paths.items():
                    ttft = path()
                    if round_ >= args.warmup:
                        times[name].append(1000 * ttft)
            row = ", ".join(f"{name} {statistics.median(ms):.2f}" for name, ms in times.items())
            print(f"prompt {n:5d} tokens, TTFT median ms over {args.repeats} rounds: {row} (N = {args.new_tokens})")
        caps = sorted(generator.engine._static_kvs)
        print(f"static cache capacities: engine {args.context} rows; generator {caps or 'none (dynamic KV)'} rows")


if __name__ == "__main__":
    main()
