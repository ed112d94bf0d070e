"""Can a long prompt's 4-bit weight dequantization hide behind cuBLAS's GEMMs? (GPU only)

    python -m bench.dequant_overlap [--shape qwen2.5-coder-1.5b-instruct] [--rows 1024,256] [--layers 8]

Past 128 rows a prompt's 4-bit products dequantize each weight into the session's scratch and
multiply it with cuBLAS, one after the other on one stream: a memory-bound kernel in series with
compute-bound GEMMs. This times, per prompt length M, a stack of --layers decoder layers' four
products (qkv, o_proj, gate_up, down: their weights distinct per layer, so they stream from HBM)
through the runtime's own calls (linear_q4.matmul_q4 with a scratch sized as a session sizes it),
each form in one CUDA graph:

    fp16       cuBLAS on resident fp16 weights (the fp16 package's products)
    serial     dequantize-then-cuBLAS in series (the int4 package's products by default)
    ahead      option q4_dequant_ahead: the next chunk dequantized on a second stream into the other
               half of the scratch while cuBLAS multiplies this one (gpu/dequant_ahead.py; the order
               learned in the warm-up run)
    ahead-hi   the same, with the GEMMs' stream at high priority (so the dequantization's programs
               take SMs only where the GEMM's leave some)

and reports microseconds per layer and the share of serial's time over fp16 that each ahead form
takes away. The ahead forms must give serial's bits (checked on eager runs); each line says so. A
layer's attention, norms and rotary are left out: they would give the dequantization more to hide
behind, not less.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from bench.gemv_micro import cuda_device, layer_shapes, time_in_graph
from onnxgen import options
from onnxgen.runtime.gpu import linear_q4 as Q4

PRODUCTS = ("qkv", "o_proj", "gate_up", "down")


class Weight:
    """One product's 4-bit weight (MatMulNBits layout, symmetric, blocks of 32) and its fp16 form."""

    def __init__(self, n: int, k: int, dev: torch.device, block_size: int = 32) -> None:
        nb = -(-k // block_size)
        self.codes = torch.randint(0, 256, (n, nb, block_size // 2), device=dev, dtype=torch.uint8)
        self.scales = torch.rand(n, nb, device=dev, dtype=torch.float16) * 0.01
        self.n, self.k, self.block_size = n, k, block_size
        packed, scale, zeros, kind = Q4._layout(self.codes, self.scales, None, n, k, block_size)
        self.dense = Q4.dequantize_q4(packed, scale, zeros, kind, rows=slice(0, n), k=k, block_size=block_size,
                                      dtype=torch.float16)  # fmt: skip


class Stack:
    """The layers' products of one prompt length in each form; each returns their results."""

    def __init__(self, weights: list[Weight], scratch: Q4.DequantScratch, inputs: dict[int, torch.Tensor]) -> None:
        self.weights, self.scratch, self.inputs = weights, scratch, inputs

    def fp16(self) -> list[torch.Tensor]:
        return [F.linear(self.inputs[w.k], w.dense) for w in self.weights]

    def serial(self) -> list[torch.Tensor]:
        return self._four_bit(ahead=False)

    def ahead(self) -> list[torch.Tensor]:
        return self._four_bit(ahead=True)

    def _four_bit(self, ahead: bool) -> list[torch.Tensor]:
        with options.override(triton_q4=True, q4_prompt="dequant", q4_dequant_ahead=ahead):
            outs = [Q4.matmul_q4(self.inputs[w.k], w.codes, w.scales, None, n=w.n, k=w.k, block_size=w.block_size,
                                 scratch=self.scratch) for w in self.weights]  # fmt: skip
        self.scratch.join()  # the end of a unit, as a session's run ends
        return outs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--rows", type=lambda v: [int(x) for x in v.split(",") if x], default=[1024, 256],
                        help="prompt lengths (comma list)")  # fmt: skip
    parser.add_argument("--layers", type=int, default=8, help="decoder layers in each graph")
    args = parser.parse_args()
    dev = cuda_device()
    if dev is None:
        return 2
    if any(m <= 0 for m in args.rows) or args.layers <= 0:
        print("--rows and --layers must be positive", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    shapes = {name: (k, n) for name, k, n in layer_shapes(args.shape) if name in PRODUCTS}
    missing = [p for p in PRODUCTS if p not in shapes]
    if missing:
        print(f"shape {args.shape} has no {', '.join(missing)} product: a dense decoder's are needed", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} shape {args.shape}, {args.layers} layers")
    weights = [Weight(shapes[p][1], shapes[p][0], dev) for _ in range(args.layers) for p in PRODUCTS]
    scratch = Q4.DequantScratch(Q4.scratch_elements([w.n * w.k for w in weights]), torch.float16, dev)
    for m in args.rows:
        inputs = {k: torch.randn(m, k, device=dev, dtype=torch.float16) for k in {w.k for w in weights}}
        stack = Stack(weights, scratch, inputs)
        serial = stack.serial()
        results = {}
        for label, fn, stream in (("fp16", stack.fp16, torch.cuda.Stream()),
                                  ("serial", stack.serial, torch.cuda.Stream()),
                                  ("ahead", stack.ahead, torch.cuda.Stream()),
                                  ("ahead-hi", stack.ahead, torch.cuda.Stream(priority=-1))):  # fmt: skip
            us = time_in_graph(lambda _, fn=fn: fn(), 1, replays=10, stream=stream)
            same = label == "fp16" or all(torch.equal(a, b) for a, b in zip(fn(), serial))
            results[label] = (us, same)
        base_us, fp16_us = results["serial"][0], results["fp16"][0]
        print(f"\n{m} rows: us per layer (4 products)")
        for label, (us, same) in results.items():
            hidden = (base_us - us) / (base_us - fp16_us) if label.startswith("ahead") and base_us > fp16_us else None
            note = f"  {hidden:6.1%} of serial's extra hidden" if hidden is not None else ""
            bits = "" if label == "fp16" else ("  same bits as serial" if same else "  BITS DIFFER from serial")
            print(f"  {label:11s} {us / args.layers:9.1f}{note}{bits}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
