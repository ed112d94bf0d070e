"""CPU decode speed: onnxgen vs onnxruntime-genai on the same package, same prompt ids, same process.

    python -m bench.cpu_decode --precision int4 --new-tokens 128 --repeats 3
    python -m bench.cpu_decode --precision fp32
    python -m bench.cpu_decode --package DIR --accuracy-level 0   # rewrite MatMulNBits' level first

Each engine gets one warm-up generation, then `--repeats` timed ones; the median is printed.
TTFT is prompt prefill + first token; decode tok/s counts the tokens after the first (onnxgen's
GenerationStats convention, applied to both). EOS is ignored by both (onnxruntime-genai through
min_length = max_length), so both make exactly --new-tokens tokens. Thread counts: onnxgen's
(--threads, else its default: OMP_NUM_THREADS or half the cores, onnxgen/threads.py) and
onnxruntime-genai's (--genai-threads, else onnxruntime's default intra-op pool, which is one thread
on a 2-vCPU guest, not one per core); both are printed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench.genai_peer import Run, genai_config_variant, median_run, pin_intra_op_threads, run_genai, run_onnxgen
from onnxgen.models.package_variants import with_accuracy_level


def pull(precision: str) -> Path:
    out = subprocess.run(
        [sys.executable, "-m", "onnxgen", "pull", "smollm2-135m-instruct", "--precision", precision],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return Path(out.strip().splitlines()[-1])


def with_genai_threads(package: Path, out: Path, threads: int) -> Path:
    """A copy of the package whose genai_config.json pins onnxruntime's intra-op thread count."""
    return genai_config_variant(package, out, lambda config: pin_intra_op_threads(config, threads))


def describe(name: str, run: Run, rates: list[float]) -> str:
    ms = 1000.0 / run.decode_tok_s if run.decode_tok_s else float("nan")
    spread = ", ".join(f"{r:.1f}" for r in rates)
    return (
        f"{name:18s} decode {run.decode_tok_s:7.1f} tok/s  {ms:6.2f} ms/token  "
        f"TTFT {run.ttft_s * 1000:7.1f} ms  (runs: {spread})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--package", type=Path, help="package directory (default: pull SmolLM2-135M)")
    parser.add_argument("--precision", default="int4", choices=["int4", "fp32", "fp16"])
    parser.add_argument("--accuracy-level", type=int, help="rewrite MatMulNBits accuracy_level in a copy")
    # (a prompt whose 128-token greedy continuation has no EOS, so the token comparison is whole)
    parser.add_argument("--prompt", default="Once upon a time, in a small village, there lived")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv", default="auto", choices=["auto", "static", "dynamic"])
    parser.add_argument("--threads", type=int, help="torch threads (default: onnxgen's, half the cores)")
    parser.add_argument("--genai-threads", type=int, help="onnxruntime intra-op threads (default: its default)")
    parser.add_argument("--skip-genai", action="store_true")
    parser.add_argument("--skip-onnxgen", action="store_true")
    args = parser.parse_args()

    package = args.package or pull(args.precision)
    with tempfile.TemporaryDirectory() as tmp:
        if args.accuracy_level is not None:
            package = with_accuracy_level(package, Path(tmp), args.accuracy_level)
        from onnxgen.genai import Generator
        from onnxgen.threads import ThreadOptions

        # an explicit count, not torch.set_num_threads: onnxgen cannot tell a set_num_threads equal
        # to torch's own default (one per core) from no choice, and would apply its own default
        generator = Generator(package, kv=args.kv, threads=ThreadOptions(num_threads=args.threads))
        ids = generator.encode(args.prompt, chat=args.chat)
        print(f"package {package}")
        print(f"prompt {len(ids)} tokens, {args.new_tokens} new tokens, greedy, median of {args.repeats}")
        print(f"cpu: nproc {os.cpu_count()}, torch threads {torch.get_num_threads()}, torch {torch.__version__}")
        # other processes on the machine distort both engines (torch's OpenMP threads worst of all)
        print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        ours = theirs = None
        if not args.skip_onnxgen:
            ours, rates = median_run(lambda: run_onnxgen(generator, ids, args.new_tokens), args.repeats)
            print(describe(f"onnxgen ({generator.kv_kind})", ours, rates))
        if not args.skip_genai:
            import onnxruntime_genai as og

            genai_package = package
            if args.genai_threads:
                genai_package = with_genai_threads(package, Path(tmp) / "genai", args.genai_threads)
            print(f"onnxruntime-genai intra-op threads: {args.genai_threads or 'onnxruntime default'}")
            model = og.Model(str(genai_package))
            theirs, rates = median_run(lambda: run_genai(model, ids, args.new_tokens), args.repeats)
            print(describe(f"ort-genai {og.__version__}", theirs, rates))
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        if ours and theirs:
            print(f"ratio onnxgen / onnxruntime-genai (decode tok/s): {ours.decode_tok_s / theirs.decode_tok_s:.2f}x")
            # onnxruntime-genai suppresses EOS (min_length) where onnxgen emits it and goes on, so
            # the sequences are comparable only up to onnxgen's first EOS
            eos = next((i for i, t in enumerate(ours.tokens) if t in generator.eos_ids), len(ours.tokens))
            a, b = ours.tokens[:eos], theirs.tokens[:eos]
            same = a == b
            differ = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            print(
                f"greedy tokens identical over {eos} tokens: {same}"
                + ("" if same else f" (first difference at token {differ})")
            )


if __name__ == "__main__":
    main()
