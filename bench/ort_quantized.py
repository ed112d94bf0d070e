"""A package whose MatMuls onnxruntime's own MatMulNBitsQuantizer quantized, from an fp32 package.

    python -m bench.ort_quantized --bits 8 --out /tmp/q8/smollm2-int8
    python -m bench.cpu_decode --package /tmp/q8/smollm2-int8 --threads 2 --genai-threads 2
    ONNXGEN_CPU_INT4_GEMM=0 python -m bench.cpu_decode --package /tmp/q8/smollm2-int8 --skip-genai --threads 2
    python -m bench.cpu_memory --part peak --package /tmp/q8/smollm2-int8

The form a user gets by quantizing a model with onnxruntime's tools rather than a builder: every
MatMul with a constant weight becomes MatMulNBits (bits, block size, symmetric or not, the
accuracy level given here), the rest of the graph as it was (the fp32 package's tied embedding and
lm_head stay fp32). The source defaults to the SmolLM2 fp32 CPU package that ``onnxgen pull``
makes. Prints the package directory on stdout.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections import Counter
from pathlib import Path

import onnx

DEFAULT_SOURCE = Path.home() / ".cache/onnxgen/packages/smollm2-135m-instruct-fp32-cpu-gqa"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="an fp32 package directory")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--bits", type=int, default=8, choices=[4, 8])
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--accuracy-level", type=int, default=4)
    parser.add_argument("--asymmetric", action="store_true", help="zero points per block (default: symmetric)")
    args = parser.parse_args()
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    if not (args.source / "model.onnx").is_file():
        sys.exit(f"no model.onnx in {args.source} (an fp32 package directory is expected; `onnxgen pull` makes one)")
    args.out.mkdir(parents=True, exist_ok=True)
    for path in args.source.iterdir():
        if path.is_file() and path.name not in ("model.onnx", "model.onnx.data"):
            shutil.copy(path, args.out / path.name)
    config = DefaultWeightOnlyQuantConfig(
        block_size=args.block_size, is_symmetric=not args.asymmetric, accuracy_level=args.accuracy_level,
        bits=args.bits,
    )  # fmt: skip
    quantizer = MatMulNBitsQuantizer(onnx.load(args.source / "model.onnx"), algo_config=config)
    quantizer.process()
    model = quantizer.model.model
    onnx.save_model(model, args.out / "model.onnx", save_as_external_data=True, location="model.onnx.data")
    ops = Counter(node.op_type for node in model.graph.node)
    print(f"MatMulNBits nodes: {ops['MatMulNBits']}, MatMul left: {ops['MatMul']}", file=sys.stderr)
    print(args.out)


if __name__ == "__main__":
    main()
