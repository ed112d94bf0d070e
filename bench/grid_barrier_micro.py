"""What a kernel boundary costs in the decode step's chain, against a grid-wide barrier (GPU only).

    python -m bench.grid_barrier_micro [--stages 96] [--k 896] [--n 896] [--repeats 5]

Issue 18's decode target needs fewer dependent kernels per layer: the step is a chain of about
five GEMV kernels per layer, each waiting for the one before. This times the two ways such a chain
can run, on the same work, inside one CUDA graph:

    kernels       one kernel per stage, y_{s+1} = W_s @ y_s, chained with programmatic dependent
                  launch (each loads its weight tile before its wait), as the step runs today
    kernels-nopdl the same without PDL
    persistent    one kernel of P programs (P <= SMs, all resident) doing every stage: the weight tile
                  of stage s is loaded before the barrier that ends stage s-1, and a barrier (a
                  counter every program adds to, then reads until all have arrived) replaces each
                  kernel boundary
    floor         the persistent kernel's loads and products with no dependency between stages
                  (each stage reads y_0): what the chain would cost with nothing to wait for

Each stage multiplies a distinct [N, K] fp16 weight (so weights stream from memory, not from L2)
by the previous stage's output. Outputs are compared with torch's chain (fp32 accumulation, fp16
rounding per stage as the kernels store). The per-stage difference between `kernels` and
`persistent` is what merging dependent kernels into persistent ones could save per boundary.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from onnxgen.runtime.gpu.launch import COMPILE_OPTIONS
from onnxgen.runtime.gpu.pdl import wait_for_previous


@triton.jit
def _stage_kernel(w_ptr, x_ptr, y_ptr, n, k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < n, cols < k
    w = tl.load(w_ptr + rows[:, None] * k + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    wait_for_previous(PDL)
    x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _arrive_and_wait(counter_ptr, target):
    """Every program's stores so far are visible to every program once this returns (all programs
    call it with the same target, the count of arrivals it waits for)."""
    tl.debug_barrier()  # the program's threads have all stored
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _persistent_kernel(
    w_ptr, ys_ptr, counter_ptr, n, k, stages, tiles,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHAINED: tl.constexpr,
):  # fmt: skip
    """ys[s + 1] = W_s @ ys[s] (CHAINED) or W_s @ ys[0]; tiles of BLOCK_N rows dealt round-robin.
    Every program has a tile (the launcher keeps programs <= tiles), so each arrives at every barrier."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BLOCK_K)
    col_ok = cols < k
    for s in range(stages):
        for t in range(pid, tiles, programs):
            rows = t * BLOCK_N + tl.arange(0, BLOCK_N)
            row_ok = rows < n
            w = tl.load(
                w_ptr + s * n * k + rows[:, None] * k + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :],
                other=0.0,
            )
            if CHAINED and t == pid and s > 0:  # the stage's first tile's weights are in flight
                _arrive_and_wait(counter_ptr, s * programs)
            src = s if CHAINED else 0
            x = tl.load(ys_ptr + src * k + cols, mask=col_ok, other=0.0).to(tl.float32)
            y = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
            tl.store(ys_ptr + (s + 1) * n + rows, y.to(ys_ptr.dtype.element_ty), mask=row_ok)


def _graph_time(fn, repeats: int) -> float:
    """Seconds per replay of a CUDA graph of fn (median of `repeats` timings of 20 replays)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / 20)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", type=int, default=96)
    p.add_argument("--k", type=int, default=896)
    p.add_argument("--n", type=int, default=896, help="must equal --k (each stage feeds the next)")
    p.add_argument("--block-n", type=int, default=8)
    p.add_argument("--programs", type=int, default=0, help="persistent programs (0: one per SM, at most the tiles)")
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("grid_barrier_micro: needs a CUDA device", file=sys.stderr)
        return 2
    if a.n != a.k:
        print("grid_barrier_micro: --n must equal --k", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    torch.manual_seed(0)
    n, k, stages = a.n, a.k, a.stages
    w = (torch.randn(stages, n, k, device=dev) / k**0.5).half()
    ys = torch.zeros(stages + 1, n, dtype=torch.float16, device=dev)
    ys[0] = torch.randn(n, device=dev).half()
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    block_k = triton.next_power_of_2(k)
    tiles = triton.cdiv(n, a.block_n)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    programs = min(a.programs or sms, tiles)

    expect = [ys[0].float()]
    for s in range(stages):
        expect.append((w[s].float() @ expect[-1]).half().float())

    def kernels(pdl: bool):
        extra = {**COMPILE_OPTIONS, **({"PDL": True, "launch_pdl": True} if pdl else {"PDL": False})}

        def run():
            for s in range(stages):
                _stage_kernel[(tiles,)](w[s], ys[s], ys[s + 1], n, k, BLOCK_N=a.block_n, BLOCK_K=block_k,
                                        num_warps=a.warps, **extra)  # fmt: skip

        return run

    def persistent(chained: bool):
        def run():
            counter.zero_()
            _persistent_kernel[(programs,)](w, ys, counter, n, k, stages, tiles, BLOCK_N=a.block_n, BLOCK_K=block_k,
                                            CHAINED=chained, num_warps=a.warps, **COMPILE_OPTIONS)  # fmt: skip

        return run

    weight_mb = w.numel() * 2 / 1e6
    header = f"{stages} stages of [{n}, {k}] fp16 ({weight_mb:.1f} MB), {tiles} tiles of {a.block_n} rows"
    header += f", persistent programs {programs} of {sms} SMs"
    print(f"# {torch.cuda.get_device_name(dev)}: {header}", file=sys.stderr)
    print("variant,us_per_stage,us_total,max_abs_err")
    for name, fn, check in (
        ("kernels", kernels(True), True),
        ("kernels-nopdl", kernels(False), True),
        ("persistent", persistent(True), True),
        ("floor", persistent(False), False),
    ):
        ys[1:].zero_()
        try:
            t = _graph_time(fn, a.repeats)
        except Exception as exc:  # a launch option this triton lacks: say so, time the rest
            print(f"{name},failed,{type(exc).__name__}: {exc}".replace("\n", " ")[:300])
            continue
        err = max((ys[s].float() - expect[s]).abs().max().item() for s in range(stages + 1)) if check else float("nan")
        print(f"{name},{t / stages * 1e6:.3f},{t * 1e6:.1f},{err:.3g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
