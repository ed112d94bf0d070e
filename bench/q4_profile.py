"""Each one-row 4-bit kernel variant launched a few times on one layer shape, for a profiler (GPU).

    ncu --clock-control none -k regex:_q4 --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section SchedulerStats --section LaunchStats \\
        python -m bench.q4_profile --layer gate_up --variant bytes:16,1024,4 --variant words:32,1024,4

With ``--prompt-rows M`` it launches the prompt path instead (linear_q4.matmul_q4 on M rows, the
default policy: the split-K GEMM for short prompts), over zero points of ``--zero-points`` form
(gemv_micro's: packed, bytes, float; absent by default), e.g. for ncu -k regex:_q4_split.

A variant is ``bytes`` (gpu/linear_q4.py), ``words`` (gpu/linear_q4_words.py) or ``half``
(gpu/linear_q4_half.py, the fp16 pair kernel) with its launch configuration BLOCK_N,BLOCK_K,WARPS;
``--prologue skip_rms`` fuses the norm as the decode step does for gate_up and qkv. Each variant
runs --launches times (3 by default) after one warm-up call, on fresh random codes (not zeros), so
a profiler filtered on the kernel name sees the same number of launches per variant, in the order
given.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.gemv_micro import cuda_device, layer_shapes, zero_points
from onnxgen import options
from onnxgen.models.random_source import MODEL_SHAPES
from onnxgen.runtime.gpu import linear_q4 as Q4

KERNELS = ("bytes", "words", "half")  # option gemv_q4's KERNEL index of each variant kind


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    dense = sorted(name for name, config in MODEL_SHAPES.items() if not config.layer_types)
    parser.add_argument("--shape", default="qwen2.5-coder-0.5b-instruct", choices=dense)
    parser.add_argument("--layer", default="gate_up", choices=["qkv", "o_proj", "gate_up", "down", "lm_head"])
    parser.add_argument("--variant", action="append", default=[], help="bytes|words|half:BLOCK_N,BLOCK_K,WARPS")
    parser.add_argument("--prompt-rows", type=int, default=0, help="launch the prompt path on this many rows")
    parser.add_argument("--zero-points", choices=["packed", "bytes", "float"], help="(with --prompt-rows)")
    parser.add_argument("--prologue", default="none", choices=["none", "skip_rms"])
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=32)
    args = parser.parse_args()
    dev = cuda_device()
    if dev is None:
        return 2
    k, n = next((k, n) for name, k, n in layer_shapes(args.shape) if name == args.layer)
    bs = args.block_size
    nb = -(-k // bs)
    torch.manual_seed(0)
    codes = torch.randint(0, 256, (n, nb, bs // 2), device=dev, dtype=torch.uint8)
    scales = torch.rand(n, nb, device=dev, dtype=torch.float16) * 0.01
    x = torch.randn(k, device=dev, dtype=torch.float16)
    skip = torch.randn(k, device=dev, dtype=torch.float16)
    gamma = torch.rand(k, device=dev, dtype=torch.float16) + 0.5
    total = torch.empty(k, device=dev, dtype=torch.float16)
    if args.prompt_rows:
        zeros = zero_points(args.zero_points, n, nb, 4, dev)
        a = torch.randn(args.prompt_rows, k, device=dev, dtype=torch.float16)
        for _ in range(1 + args.launches):
            Q4.matmul_q4(a, codes, scales, zeros, n=n, k=k, block_size=bs)
        torch.cuda.synchronize()
        print(f"{args.layer} N={n} K={k}: {1 + args.launches} prompt launches of {args.prompt_rows} rows, "
              f"zero points {args.zero_points or 'none'}")  # fmt: skip
        return 0
    if not args.variant:
        parser.error("give --variant (one-row kernels) or --prompt-rows")
    fused = {} if args.prologue == "none" else dict(prologue="skip_rms", x2=skip, gamma=gamma, eps=1e-6, sum_out=total)
    results = {}
    for variant in args.variant:
        kind, _, config = variant.partition(":")
        if kind not in KERNELS:
            parser.error(f"variant {variant!r}: expected bytes:..., words:... or half:...")
        bn, bk, warps = (int(v) for v in config.split(","))
        with options.override(gemv_q4=(bn, bk, warps, KERNELS.index(kind)), q4_norm_apart=0):
            for _ in range(1 + args.launches):
                y = Q4.linear_row_q4(x, codes, scales, None, n=n, k=k, block_size=bs, **fused)
        torch.cuda.synchronize()
        results[variant] = y.float()
    first = next(iter(results.values()))
    for variant, y in results.items():
        err = ((y - first).norm() / first.norm()).item()
        print(f"{args.layer} N={n} K={k} {variant}: relative difference from the first variant {err:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
