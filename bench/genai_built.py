"""A package made by onnxruntime-genai's own builder from random weights in a real model's shape.

    python -m bench.genai_built --shape smollm2-135m-instruct --precision fp32 --execution cpu --out /tmp/gb
    python -m bench.cpu_decode --package /tmp/gb/genai-fp32-cpu --kv auto      # then time it on the CPU

peers_decode's write_checkpoint writes a random checkpoint of the shape (RandomSource's seeded
weights, seed 0, fp16, with its word-level tokenizer), and ``python -m onnxruntime_genai.models.builder`` turns
it into a package in ``OUT/genai-PRECISION-EXECUTION``: the form that builder writes (its op
layouts, its tied embedding, its genai_config.json), which is what onnxgen must run as fast as its
own. Prints the package directory on stdout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from bench.peers_decode import checkpoint_bytes, disk_free, write_checkpoint, write_wrapper_checkpoint
from onnxgen.models.random_source import MODEL_SHAPES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m-instruct", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "int4"])
    parser.add_argument("--execution", default="cpu", choices=["cpu", "cuda"], help="the builder's -e")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    config = MODEL_SHAPES[args.shape]
    checkpoint = args.out / f"hf-{args.shape}"
    if not (checkpoint / "config.json").is_file():
        # the checkpoint, its wrapper form for hybrids, the package: each at most the fp16 weights' size
        copies = 3 if config.layer_types else 2
        need, free = copies * checkpoint_bytes(config, "fp16"), disk_free(args.out)
        if need > free:
            parser.error(f"{args.shape} needs about {need / 1e9:.0f} GB under {args.out}; {free / 1e9:.0f} GB are free")
        print(f"writing a random {args.shape} checkpoint to {checkpoint}", file=sys.stderr)
        write_checkpoint(config, checkpoint, torch.float16, seed=0)
    if config.layer_types:  # the builder takes hybrids of the Qwen3.5 layout only as the multimodal wrapper
        wrapper = checkpoint.with_name(checkpoint.name + "-wrapper")
        if not (wrapper / "config.json").is_file():
            write_wrapper_checkpoint(config, checkpoint, wrapper, seed=0)
        checkpoint = wrapper
    package = args.out / f"genai-{args.precision}-{args.execution}"
    build_with_genai(checkpoint, package, args.precision, args.execution, config.vocab_size)
    print(package)


def build_with_genai(checkpoint: Path, package: Path, precision: str, execution: str, vocab_size: int) -> None:
    """onnxruntime-genai's builder (``-p precision -e execution``) on a Hugging Face checkpoint; its
    output on stderr. Raises CalledProcessError where it fails."""
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o", str(package)]
    command += ["-p", precision, "-e", execution]
    print("running " + " ".join(command), file=sys.stderr)
    subprocess.run(command, check=True, stdout=sys.stderr)
    drop_ids_outside_the_vocabulary(package, vocab_size)


def drop_ids_outside_the_vocabulary(package: Path, vocab_size: int) -> None:
    """With this word-level tokenizer the builder listed the id vocab_size among the Qwen2 shape's EOS
    ids (seen with onnxruntime-genai 0.18), which onnxgen refuses at load as outside the vocabulary;
    the id is dropped here, and said."""
    path = package / "genai_config.json"
    config = json.loads(path.read_text())
    eos = config["model"].get("eos_token_id")
    if isinstance(eos, list) and any(i >= vocab_size for i in eos):
        kept = [i for i in eos if i < vocab_size]
        print(f"genai_config.json: eos_token_id {eos} -> {kept} (ids outside the vocabulary dropped)", file=sys.stderr)
        config["model"]["eos_token_id"] = kept
        path.write_text(json.dumps(config, indent=4))


if __name__ == "__main__":
    main()
