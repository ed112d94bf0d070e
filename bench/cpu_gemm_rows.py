"""How a CPU GEMM's time grows with the rows of a batch: torch's int4 weight-only GEMM (the CPU
int4 path, contrib_quant.py) and the fp32 linear, one layer, per row count. What bounds continuous
batching's gain on the CPU (docs/batching.md).

    python -m bench.cpu_gemm_rows --n 1536 --k 576 --rows 1,2,4,8,16 --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch


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
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (args.n, args.k), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales_zeros = (torch.randn(args.k // args.group, args.n, 2) * 0.01).to(torch.bfloat16)
    weight = torch.randn(args.n, args.k)
    print(f"{args.n} x {args.k}, int4 block {args.group}, {args.threads} thread(s), us per call\n")
    print("| rows | int4 GEMM | per row | fp32 linear | per row |\n| ---: | ---: | ---: | ---: | ---: |")
    for rows in (int(r) for r in args.rows.split(",")):
        a = torch.randn(rows, args.k)
        a16 = a.to(torch.bfloat16)
        int4 = timed(lambda a16=a16: torch.ops.aten._weight_int4pack_mm_for_cpu(a16, packed, args.group, scales_zeros),
                     args.repeats)  # fmt: skip
        fp32 = timed(lambda a=a: torch.nn.functional.linear(a, weight), args.repeats)
        print(f"| {rows} | {int4 * 1e6:.0f} | {int4 * 1e6 / rows:.0f} | {fp32 * 1e6:.0f} | {fp32 * 1e6 / rows:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
