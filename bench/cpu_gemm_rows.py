"""How a CPU GEMM's time grows with the rows of a batch: torch's int4 weight-only GEMM (the CPU
int4 path, contrib_quant.py) and the fp32 products, one layer, per row count. What bounds continuous
batching's gain on the CPU (docs/batching.md).

    python -m bench.cpu_gemm_rows --n 1536 --k 576 --rows 1,2,4,8,16 --threads 1
    python -m bench.cpu_gemm_rows --n 1536 --k 576 --rows 1,2,4,8,16 --threads 2 --copies 40

fp32 columns: the weight as an ONNX MatMul holds it ([K, N]) and as a Gemm with transB does (the
[N, K] lm_head of a tied embedding), each through torch's plain product and through onnxgen's
(ops/cpu_gemv.py, which falls back to the plain product where it does not apply: one thread,
more than its row limit). ``--copies C`` cycles through C copies of every weight, so that they
come from memory as in a decode step, not from the cache (each figure is per call).
"""

from __future__ import annotations

import argparse
import time

import torch

from onnxgen.runtime.ops.cpu_gemv import split_gemv


def timed(fn, repeats: int) -> float:
    for _ in range(max(3, repeats // 10)):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1536, help="output features (SmolLM2's MLP: 1,536)")
    parser.add_argument("--k", type=int, default=576, help="input features (SmolLM2's hidden: 576)")
    parser.add_argument("--group", type=int, default=32, help="int4 quantization block")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--copies", type=int, default=1, help="weights cycled per call (memory, not cache)")
    args = parser.parse_args(argv)
    if args.copies < 1 or args.repeats < 1:
        parser.error("--copies and --repeats must be >= 1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    copies = range(args.copies)
    packed = [
        torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (args.n, args.k), dtype=torch.int32), 1)
        for _ in copies
    ]
    scales_zeros = (torch.randn(args.k // args.group, args.n, 2) * 0.01).to(torch.bfloat16)
    by_columns = [torch.randn(args.k, args.n) for _ in copies]  # MatMul's [K, N]
    by_rows = [torch.randn(args.n, args.k) for _ in copies]  # Gemm transB's [N, K]
    repeats = max(1, args.repeats // args.copies)
    print(f"{args.n} x {args.k}, int4 block {args.group}, {args.threads} thread(s), {args.copies} cop(ies) of "
          f"each weight, us per call\n")  # fmt: skip
    print("| rows | int4 GEMM | fp32 [K,N] torch | fp32 [K,N] onnxgen | fp32 [N,K]^T torch | fp32 [N,K]^T onnxgen |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")

    def per_call(fn) -> float:
        return timed(lambda: [fn(i) for i in copies], repeats) / args.copies * 1e6

    def onnxgen(a: torch.Tensor, w: torch.Tensor, transposed: bool) -> torch.Tensor:
        out = split_gemv(a, w, b_transposed=transposed)
        return out if out is not None else a @ (w.t() if transposed else w)

    int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    for rows in (int(r) for r in args.rows.split(",")):
        a = torch.randn(rows, args.k)
        a16 = a.to(torch.bfloat16)
        cells = [
            per_call(lambda i, a16=a16: int4_mm(a16, packed[i], args.group, scales_zeros)),
            per_call(lambda i, a=a: a @ by_columns[i]),
            per_call(lambda i, a=a: onnxgen(a, by_columns[i], False)),
            per_call(lambda i, a=a: a @ by_rows[i].t()),
            per_call(lambda i, a=a: onnxgen(a, by_rows[i], True)),
        ]
        print(f"| {rows} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
