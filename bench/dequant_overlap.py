"""Can a long prompt's 4-bit weight dequantization hide behind cuBLAS's GEMMs? (GPU only)

    python -m bench.dequant_overlap [--shape qwen2.5-coder-1.5b-instruct] [--rows 1024,256] [--layers 8]

Past 128 rows a prompt's 4-bit products dequantize each weight into a scratch buffer and multiply it
with cuBLAS, one after the other on one stream: the dequantization is a memory-bound kernel in series
with compute-bound GEMMs. This times, per prompt length M, a stack of --layers decoder layers' four
products (qkv, o_proj, gate_up, down: their weights distinct per layer, so they stream from HBM), each
form in one CUDA graph:

    fp16       cuBLAS on resident fp16 weights (the fp16 package's products)
    serial     each weight dequantized into one buffer, then cuBLAS (the int4 package's products today)
    overlap    the next weight dequantized on a second stream into the other of two buffers while
               cuBLAS multiplies this one (events order each buffer's writes after its last reader)
    overlap-hi the same, with the GEMMs' stream at high priority (so the dequantization's programs
               take SMs only where the GEMM's leave some)

and reports microseconds per layer and the share of serial's time over fp16 that each overlap form
takes away. Every form must give the same bits as serial; each line says so. A layer's attention,
norms and rotary are left out: they would give the dequantization more to hide behind, not less.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.gemv_micro import cuda_device, layer_shapes, time_in_graph
from onnxgen.runtime.gpu import linear_q4 as Q4

PRODUCTS = ("qkv", "o_proj", "gate_up", "down")


class Weight:
    """One product's 4-bit weight (MatMulNBits layout, symmetric, blocks of 32) and its fp16 form."""

    def __init__(self, n: int, k: int, dev: torch.device, block_size: int = 32) -> None:
        nb = -(-k // block_size)
        codes = torch.randint(0, 256, (n, nb, block_size // 2), device=dev, dtype=torch.uint8)
        scales = torch.rand(n, nb, device=dev, dtype=torch.float16) * 0.01
        self.n, self.k, self.block_size = n, k, block_size
        self.packed, self.scale, self.zeros, self.kind = Q4._layout(codes, scales, None, n, k, block_size)
        self.dense = self.dequantize_into(torch.empty(n * k, dtype=torch.float16, device=dev))

    def dequantize_into(self, buffer: torch.Tensor) -> torch.Tensor:
        return Q4.dequantize_q4(self.packed, self.scale, self.zeros, self.kind, rows=slice(0, self.n), k=self.k,
                                block_size=self.block_size, dtype=torch.float16,
                                out=buffer[: self.n * self.k].view(self.n, self.k))  # fmt: skip


class Stack:
    """The layers' products of one prompt length in each form; every form writes ``outs``."""

    def __init__(self, weights: list[Weight], buffers: list[torch.Tensor], inputs: dict[int, torch.Tensor],
                 outs: list[torch.Tensor]) -> None:  # fmt: skip
        self.weights, self.buffers, self.inputs, self.outs = weights, buffers, inputs, outs
        self.side = torch.cuda.Stream()

    def fp16(self) -> None:
        for w, out in zip(self.weights, self.outs):
            torch.mm(self.inputs[w.k], w.dense.t(), out=out)

    def serial(self) -> None:
        for w, out in zip(self.weights, self.outs):
            torch.mm(self.inputs[w.k], w.dequantize_into(self.buffers[0]).t(), out=out)

    def overlapped(self) -> None:
        """Weight j + 1 dequantized on the side stream into buffer (j + 1) % 2 while weight j's GEMM
        runs; a buffer is rewritten only after its last GEMM (event ``read``), and read only after
        its dequantization (event ``ready``)."""
        main, side, weights = torch.cuda.current_stream(), self.side, self.weights
        ready = [torch.cuda.Event() for _ in weights]
        read = [torch.cuda.Event() for _ in weights]
        side.wait_stream(main)
        for j, (w, out) in enumerate(zip(weights, self.outs)):
            with torch.cuda.stream(side):
                for i in (j, j + 1) if j == 0 else (j + 1,):
                    if i >= len(weights):
                        continue
                    if i >= 2:
                        side.wait_event(read[i - 2])
                    weights[i].dequantize_into(self.buffers[i % 2])
                    ready[i].record(side)
            main.wait_event(ready[j])
            torch.mm(self.inputs[w.k], self.buffers[j % 2][: w.n * w.k].view(w.n, w.k).t(), out=out)
            read[j].record(main)
        main.wait_stream(side)


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
    largest = max(w.n * w.k for w in weights)
    buffers = [torch.empty(largest, dtype=torch.float16, device=dev) for _ in range(2)]
    for m in args.rows:
        inputs = {k: torch.randn(m, k, device=dev, dtype=torch.float16) for k in {w.k for w in weights}}
        outs = [torch.empty(m, w.n, device=dev, dtype=torch.float16) for w in weights]

        stack = Stack(weights, buffers, inputs, outs)
        results = {}
        for label, fn, stream in (("fp16", stack.fp16, torch.cuda.Stream()),
                                  ("serial", stack.serial, torch.cuda.Stream()),
                                  ("overlap", stack.overlapped, torch.cuda.Stream()),
                                  ("overlap-hi", stack.overlapped, torch.cuda.Stream(priority=-1))):  # fmt: skip
            us = time_in_graph(lambda _, fn=fn: fn(), 1, replays=10, stream=stream)
            results[label] = (us, [o.clone() for o in outs])
        base_us, base_outs = results["serial"]
        fp16_us = results["fp16"][0]
        print(f"\n{m} rows: us per layer (4 products)")
        for label, (us, got) in results.items():
            same = label == "fp16" or all(torch.equal(a, b) for a, b in zip(got, base_outs))
            hidden = (base_us - us) / (base_us - fp16_us) if label.startswith("overlap") and base_us > fp16_us else None
            note = f"  {hidden:6.1%} of serial's extra hidden" if hidden is not None else ""
            bits = "" if label == "fp16" else ("  same bits as serial" if same else "  BITS DIFFER from serial")
            print(f"  {label:11s} {us / args.layers:9.1f}{note}{bits}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
