"""What bounds a one-row 4-bit product: its memory side alone, its arithmetic alone, and the two
together, each timed inside one CUDA graph over distinct weight copies (GPU only).

    python -m bench.q4_ceiling --shape qwen2.5-coder-1.5b-instruct --layer lm_head

Per launch configuration of the byte tile kernel (gpu/linear_q4.py's _q4_tile_kernel; rows of at
most linear_q4.TILE_LIMIT elements):
    kernel            the kernel as the decode step runs it, codes streaming from HBM
    codes from cache  the same kernel with a row stride of 0, so that every program reads row 0's
                      codes (from L1 / L2): its arithmetic with the codes' DRAM traffic removed
                      (scales and zero points still stream)
    fp16 pair kernel  gpu/linear_q4_half.py's kernel, streaming and with its codes from cache
    loads only        a kernel that loads the same codes (as 32-bit words), scales and zero
                      points in the same tiles and folds them with one XOR per word: the memory
                      side of the tile pattern with next to no arithmetic
If the kernel's time is near the sum of the other two, its loads and its arithmetic do not
overlap; near the larger of the two, they do. The dense fp16 kernel's time over the fp16 weight
(the same row tiles, four times the bytes) is printed beside them, with the bandwidth each reached.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from bench.gemv_micro import cuda_device, layer_shapes, time_in_graph, zero_points
from onnxgen import options
from onnxgen.models.random_source import MODEL_SHAPES
from onnxgen.runtime.gpu import linear_q4 as Q4
from onnxgen.runtime.gpu import linear_q4_half as H
from onnxgen.runtime.gpu import linear_row as TL
from onnxgen.runtime.gpu.launch import COMPILE_OPTIONS


@triton.jit
def _loads_only_kernel(
    w_ptr, scale_ptr, out_ptr, n, n_blocks, row_words, BLOCK_N: tl.constexpr, WORDS: tl.constexpr,
    BLOCKS: tl.constexpr, SCALES: tl.constexpr = True,
):  # fmt: skip
    """out[row] = XOR of the row's code words, plus the sum of its scales: every byte of the tile
    is loaded and used, with about one instruction per word."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    cols = tl.arange(0, WORDS)
    ok = row_ok[:, None] & (cols < row_words)[None, :]
    words = tl.load(w_ptr + rows[:, None] * row_words + cols[None, :], mask=ok, other=0)
    folded = tl.reduce(words, 1, _xor).to(tl.float32)
    if SCALES:
        blk = tl.arange(0, BLOCKS)
        ok = row_ok[:, None] & (blk < n_blocks)[None, :]
        scale = tl.load(scale_ptr + rows[:, None] * n_blocks + blk[None, :], mask=ok, other=0.0).to(tl.float32)
        folded += tl.sum(scale, axis=1)
    tl.store(out_ptr + rows, folded, mask=row_ok)


@triton.jit
def _xor(a, b):
    return a ^ b


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    dense = sorted(name for name, config in MODEL_SHAPES.items() if not config.layer_types)
    parser.add_argument("--shape", default="qwen2.5-coder-1.5b-instruct", choices=dense)
    parser.add_argument("--layer", action="append", default=[], help="qkv, o_proj, gate_up, lm_head (repeatable)")
    parser.add_argument("--config", action="append", default=[], help="BLOCK_N,WARPS of the byte tile kernel "
                        "(repeatable; default: 8,4 16,4 32,8)")  # fmt: skip
    parser.add_argument("--zero-points", choices=["packed", "bytes", "float"])
    args = parser.parse_args()
    dev = cuda_device()
    if dev is None:
        return 2
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} shape {args.shape}")
    configs = [tuple(int(v) for v in c.split(",")) for c in args.config] or [(8, 4), (16, 4), (32, 8)]
    for name, k, n in layer_shapes(args.shape):
        if name not in (args.layer or ["lm_head"]):
            continue
        bench_layer(name, k, n, configs, args.zero_points, dev)
    return 0


def bench_layer(name: str, k: int, n: int, configs, zero_form: str | None, dev) -> None:
    bs, nb = 32, -(-k // 32)
    if nb * bs > Q4.TILE_LIMIT:
        print(f"{name}: rows of {k} elements split along K; this bench takes one-tile rows only")
        return
    qbytes = n * nb * (bs // 2 + 2)
    copies = max(2, min(96, int(256e6 // qbytes)))  # >= 256 MB per graph: far past the L2
    codes = [torch.randint(0, 256, (n, nb * bs // 2), device=dev, dtype=torch.uint8) for _ in range(copies)]
    scales = [torch.rand(n, nb, device=dev, dtype=torch.float16) * 0.01 for _ in range(copies)]
    zeros = [zero_points(zero_form, n, nb, 4, dev) for _ in range(copies)]
    if zeros[0] is not None:
        qbytes += zeros[0].numel() * zeros[0].element_size()
    x = torch.randn(k, device=dev, dtype=torch.float16)
    out = torch.empty(n, device=dev, dtype=torch.float16)
    folded = torch.empty(n, device=dev, dtype=torch.float32)
    words = [c.view(torch.int32) for c in codes]
    b0, b1, b2 = Q4.power_parts(nb)
    loads_only = loads_only_timer(words, scales, folded, n, nb, copies)
    print(f"\n{name}: N={n} K={k}, {qbytes / 1e6:.1f} MB of codes, scales and zero points; {copies} copies")

    def line(label: str, us: float, nbytes: int = qbytes) -> None:
        print(f"  {label:40s} {us:8.2f} us  {nbytes / us / 1e3:6.0f} GB/s", flush=True)

    wdense = max(2, min(48, int(256e6 // (n * k * 2))))
    ws = [torch.randn(n, k, device=dev, dtype=torch.float16) * 0.02 for _ in range(wdense)]
    xd = x.reshape(1, k)
    line("dense fp16 kernel (chosen)", time_in_graph(lambda i: TL.linear_row(xd, ws[i]), wdense), n * k * 2)
    ws.clear()
    for block_n, warps in configs:

        def kernel(i: int, stride: int | None = None, block_n=block_n, warps=warps) -> torch.Tensor:
            packed, scale, zp, kind = Q4._layout(codes[i], scales[i], zeros[i], n, k, bs)
            Q4._q4_tile_kernel[(triton.cdiv(n, block_n),)](
                x, x, x, x, packed, scale, zp, out, out, n, k, nb, packed.shape[1] if stride is None else stride,
                zp.shape[1], 0.0, PROLOGUE=0, ZERO_KIND=kind, HAS_BIAS=False, QBLOCK=bs, BLOCK_N=block_n, B0=b0,
                B1=b1, B2=b2, PDL=False, BITS=4, num_warps=warps, **COMPILE_OPTIONS,
            )  # fmt: skip
            return out

        with options.override(gemv_q4=(block_n, triton.next_power_of_2(nb * bs), warps, 0)):
            want = Q4.linear_row_q4(x, codes[0], scales[0], zeros[0], n=n, k=k, block_size=bs).float()
        if not torch.equal(kernel(0).float(), want):
            print(f"  {block_n} rows, {warps} warps: the direct launch differs from linear_row_q4's")
        line(f"{block_n} rows / {warps} warps: kernel", time_in_graph(kernel, copies))
        line(f"{block_n} rows / {warps} warps: codes from cache", time_in_graph(lambda i: kernel(i, 0), copies))
        if zeros[0] is None or zeros[0].dtype != torch.float16:

            def half(i: int, stride: int | None = None, block_n=block_n, warps=warps) -> torch.Tensor:
                _, scale, zp, kind = Q4._layout(codes[i], scales[i], zeros[i], n, k, bs)
                row_words = words[i].shape[1] if stride is None else stride
                H._q4h_tile_kernel[(triton.cdiv(n, block_n),)](
                    x, x, x, x, words[i], scale, zp, out, out, n, k, nb, row_words,
                    zp.shape[1], 0.0, PROLOGUE=0, ZERO_KIND=kind, HAS_BIAS=False, QBLOCK=bs, BLOCK_N=block_n, B0=b0,
                    B1=b1, B2=b2, PDL=False, num_warps=warps, **COMPILE_OPTIONS,
                )  # fmt: skip
                return out

            err = ((half(0).float() - want).abs().max() / want.abs().max()).item()
            print(f"  {block_n} rows / {warps} warps: fp16 pair kernel against the byte kernel: {err:.1e} of max |y|")
            line(f"{block_n} rows / {warps} warps: fp16 pair kernel", time_in_graph(half, copies))
            line(f"{block_n} rows / {warps} warps: fp16 pairs, codes from cache",
                 time_in_graph(lambda i: half(i, 0), copies))  # fmt: skip

        line(f"{block_n} rows / {warps} warps: loads only", loads_only(block_n, warps, True), n * nb * (bs // 2 + 2))
    for block_n, warps in [(4, 1), (8, 2), (16, 4), (32, 4), (64, 8)]:
        us = loads_only(block_n, warps, False)
        line(f"{block_n} rows / {warps} warps: codes alone, loads only", us, n * nb * bs // 2)


def loads_only_timer(words, scales, folded, n: int, nb: int, copies: int):
    """us per _loads_only_kernel launch over the copies, for (BLOCK_N, warps, whether scales load)."""

    def timed(block_n: int, warps: int, with_scales: bool) -> float:
        def loads(i: int) -> torch.Tensor:
            _loads_only_kernel[(triton.cdiv(n, block_n),)](
                words[i], scales[i], folded, n, nb, words[i].shape[1], BLOCK_N=block_n,
                WORDS=triton.next_power_of_2(words[i].shape[1]), BLOCKS=triton.next_power_of_2(nb),
                SCALES=with_scales, num_warps=warps, **COMPILE_OPTIONS,
            )  # fmt: skip
            return folded

        return time_in_graph(loads, copies)

    return timed


if __name__ == "__main__":
    sys.exit(main())
