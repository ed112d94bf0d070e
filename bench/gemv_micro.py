"""One-row GEMV kernels at the decode step's shapes, inside CUDA graphs (GPU only).

    python -m bench.gemv_micro [--shape qwen2.5-coder-0.5b-instruct] [--quick]

For each linear layer of the shape (QKV, o_proj, gate/up, down, lm_head) it times, per call inside
one captured CUDA graph of many calls over distinct weight copies (so the weights stream from HBM,
not from L2):
    cublas-linear   F.linear(x, W[N, K])      (what MatMulGroup runs)
    cublas-matmul   x @ W[K, N]               (what a plain MatMul runs)
    triton BN/BK/W  gpu/linear_row.py's dense kernel, swept over launch configurations
    q4-dequant      F.linear over a dequantized fp16 copy (what ONNXGEN_TRITON_Q4=0 runs)
    q4 BN/BK/W      gpu/linear_q4.py's one-row 4-bit kernel on the packed codes, swept (BK < K: split along K;
                    --bits 8: the same kernels over 8-bit codes)
    q4w / q4h       with --words / --half: the word kernel (gpu/linear_q4_words.py) / the fp16 pair kernel
                    (gpu/linear_q4_half.py) swept the same way
    BN/BK/1         with --one-warp: one-warp programs of 2-8 rows of those kernels, whose reductions need
                    no barrier between warps
and the same kernel with its norm prologue fused (skip_rms) at the chosen configuration. Each row
gives us/call and the bandwidth it reached (weight bytes / time). The chosen configurations of
dense_config/q4_config are marked with '*'.

With --prompt-rows M,...: the products of M rows (a prompt chunk), cuBLAS on the fp16 weight against
the 4-bit prompt paths (the default policy, dequantize-then-cuBLAS, the tiled GEMM swept, and for
M <= 64 the GEMM split along K swept: ONNXGEN_Q4_PROMPT=split). --prompt-only skips the one-row part:

    python -m bench.gemv_micro --shape qwen2.5-coder-1.5b-instruct --prompt-rows 16,64 --prompt-only
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F

from onnxgen import options
from onnxgen.models.config import DecoderConfig
from onnxgen.models.random_source import MODEL_SHAPES
from onnxgen.runtime.gpu import linear_q4 as Q4
from onnxgen.runtime.gpu import linear_row as TL
from onnxgen.runtime.ops.contrib_quant import dequantize_nbits


def layer_shapes(shape: str) -> list[tuple[str, int, int]]:
    return config_layer_shapes(MODEL_SHAPES[shape])


def config_layer_shapes(c: DecoderConfig) -> list[tuple[str, int, int]]:
    """(name, K, N) of each one-row product a decode step of ``c`` runs, members of one
    MatMulGroup (the same input) as one product: a dense decoder's QKV, o_proj, gate_up, down and
    lm_head; a hybrid's Gated DeltaNet input projections (qkv, z, b, a) and output, its gated
    attention's q (with the gate), k and v, and, for a mixture of experts, the router grouped with
    the shared expert's gate and gate_up, and the shared expert's down (the routed experts are
    bench/moe_prompt.py's)."""
    hd = c.head_dim
    q = c.num_attention_heads * hd * (2 if c.attn_output_gate else 1)
    qkv = q + 2 * c.num_key_value_heads * hd
    layers = [("qkv", c.hidden_size, qkv), ("o_proj", c.num_attention_heads * hd, c.hidden_size)]
    la = c.linear_attention
    if la is not None:
        key_dim, value_dim = la.num_key_heads * la.key_head_dim, la.num_value_heads * la.value_head_dim
        gdn_in = 2 * key_dim + 2 * value_dim + 2 * la.num_value_heads  # qkv, z, then b and a per value head
        layers += [("gdn_in", c.hidden_size, gdn_in), ("gdn_out", value_dim, c.hidden_size)]
    if c.moe is not None:
        moe_in = c.moe.num_experts + (1 + 2 * c.moe.shared_intermediate if c.moe.shared_intermediate else 0)
        layers += [("moe_in", c.hidden_size, moe_in)]
        if c.moe.shared_intermediate:
            layers += [("shared_down", c.moe.shared_intermediate, c.hidden_size)]
    else:
        layers += [("gate_up", c.hidden_size, 2 * c.intermediate_size), ("down", c.intermediate_size, c.hidden_size)]
    return [*layers, ("lm_head", c.hidden_size, c.vocab_size)]


def cuda_device() -> torch.device | None:
    """The CUDA device these layer benches time on; None, having said why on stderr, where there is none."""
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return None
    return torch.device("cuda")


def time_in_graph(fn, copies: int, replays: int = 20, stream: torch.cuda.Stream | None = None) -> float:
    """Microseconds per call of fn(i) for i in range(copies), recorded in one CUDA graph (on
    ``stream``, a new one by default)."""
    stream = stream or torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):  # warm-up: compile, allocate
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(copies):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / (replays * copies))
    return sorted(times)[len(times) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-coder-0.5b-instruct", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--quick", action="store_true", help="a smaller sweep")
    parser.add_argument("--block-size", type=int, default=32, help="MatMulNBits block size")
    parser.add_argument("--bits", type=int, default=4, choices=[4, 8], help="MatMulNBits code width (8: the byte "
                        "kernels only; the word-kernel sweep is 4-bit)")  # fmt: skip
    parser.add_argument(
        "--prompt-rows",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[],
        help="also time prompts of these many rows (comma list): cuBLAS fp16, q4 dequant, q4 gemm, q4 split",
    )
    parser.add_argument("--prompt-only", action="store_true", help="only the --prompt-rows products")
    parser.add_argument(
        "--zero-points",
        nargs="?",
        const="packed",
        choices=["packed", "bytes", "float"],
        help="zero points: packed uint8 codes as MatMulNBits stores them (the default when named alone); bytes: "
        "int8 a byte per block, the form a session widens packed 4-bit ones to at load "
        "(contrib_quant.widen_zero_points); float: integer values as fp16 in the scales' layout (MatMulNBits' "
        "float form); default: none, the symmetric form",
    )
    parser.add_argument("--words", action="store_true", help="also sweep the 4-bit kernel over 32-bit words")
    parser.add_argument("--half", action="store_true", help="also sweep the 4-bit fp16 pair kernel (option q4_half)")
    parser.add_argument("--one-warp", action="store_true",
                        help="also sweep one-warp programs of 2, 4 and 8 rows (the byte kernel, and the word and "
                        "pair kernels where --words / --half ask for them): no reduction crosses a warp")  # fmt: skip
    parser.add_argument("--layers", help="comma list of layer_shapes' names: qkv, o_proj, gate_up, down, lm_head; "
                        "gdn_in, gdn_out, moe_in, shared_down for the hybrid shapes (default: all)")  # fmt: skip
    args = parser.parse_args()
    dev = cuda_device()
    if dev is None:
        return 2
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} shape {args.shape}")
    bn_list = [2, 4, 8, 16] if args.quick else [1, 2, 4, 8]
    bk_list = [128, 256] if args.quick else [128, 256, 512, 1024]
    w_list = [4] if args.quick else [4, 8]
    bpi_list = [8, 16, 32] if args.quick else [2, 4, 8, 16, 32, 64]  # 4-bit: rows per program
    summary = []
    for name, k, n in layer_shapes(args.shape):
        if args.layers and name not in args.layers.split(","):
            continue
        rows = bench_shape(name, k, n, args, dev, (bn_list, bk_list, w_list, bpi_list))
        if args.prompt_only:
            continue
        dense = [r for r in rows if r[0].startswith("triton ") and "prologue" not in r[0]]
        q4 = [r for r in rows if r[0].startswith("q4 ") and "prologue" not in r[0]]
        q4w = [r for r in rows if r[0].startswith(("q4w", "q4h")) and "prologue" not in r[0]]
        best_w = min(q4w, key=lambda r: r[1]) if q4w else ("-", float("nan"), 0.0)
        summary.append((name, rows[0][1], rows[1][1], min(dense, key=lambda r: r[1]), min(q4, key=lambda r: r[1]),
                        best_w))  # fmt: skip
        torch.cuda.empty_cache()
    print("\nshape summary (us/call): cublas-linear, cublas-matmul, best triton dense, best q4, best q4w / q4h")
    for name, lin, mm, bd, bq, bw in summary:
        best = f"{bd[1]:7.2f} ({bd[0]})  {bq[1]:7.2f} ({bq[0]})  {bw[1]:7.2f} ({bw[0]})"
        print(f"  {name:8s} {lin:7.2f} {mm:7.2f}  {best}")
    return 0


def bench_shape(name: str, k: int, n: int, args, dev, sweeps) -> list[tuple[str, float, float]]:
    wbytes = n * k * 2
    copies = max(2, min(48, int(256e6 // wbytes)))  # >= 256 MB per graph: far past the L2
    ws = [torch.randn(n, k, device=dev, dtype=torch.float16) * 0.02 for _ in range(copies)]
    rows: list[tuple[str, float, float]] = []

    def add(label: str, us: float, nbytes: int = wbytes) -> None:
        rows.append((label, us, nbytes / us / 1e3))

    # 4-bit weights (8-bit with --bits 8), MatMulNBits layout, symmetric (no zero points; with
    # --zero-points, packed uint8 ones, a byte per block, or integers as fp16 [N, blocks])
    bs = args.block_size
    nb = -(-k // bs)
    row_bytes = bs * args.bits // 8  # per block
    qbytes = n * nb * row_bytes + n * nb * 2
    qcopies = max(2, min(96, int(256e6 // qbytes)))
    qb = [torch.randint(0, 256, (n, nb, row_bytes), device=dev, dtype=torch.uint8) for _ in range(qcopies)]
    qs = [torch.rand(n, nb, device=dev, dtype=torch.float16) * 0.01 for _ in range(qcopies)]
    qz = [zero_points(args.zero_points, n, nb, args.bits, dev) for _ in range(qcopies)]
    qbytes += qz[0].numel() * qz[0].element_size() if qz[0] is not None else 0
    if not args.prompt_only:
        one_row_sweeps(name, k, n, args, sweeps, ws, qb, qs, qz, qcopies, add, copies, wbytes, qbytes)
    prompt_rows(name, k, n, args, ws, qb, qs, qz, qcopies, add, copies, wbytes, qbytes)
    print(f"\n{name}: K={k} N={n}  fp16 weight {wbytes / 1e6:.2f} MB, int4 {qbytes / 1e6:.2f} MB", flush=True)
    for label, us, gbs in rows:
        print(f"  {label:36s} {us:8.2f} us  {gbs:7.0f} GB/s")
    return rows


def zero_points(form: str | None, n: int, nb: int, bits: int, dev) -> torch.Tensor | None:
    """Random zero points of ``nb`` blocks per row in --zero-points' form (None: absent)."""
    if form == "packed":  # each row padded to whole bytes
        return torch.randint(0, 256, (n, -(-nb * bits // 8)), device=dev, dtype=torch.uint8)
    if form == "bytes":
        return torch.randint(0, 16, (n, nb), device=dev, dtype=torch.int8)  # widened 4-bit codes
    if form == "float":
        return torch.randint(0, 1 << bits, (n, nb), device=dev).to(torch.float16)
    return None


def one_row_sweeps(name, k, n, args, sweeps, ws, qb, qs, qz, qcopies, add, copies, wbytes, qbytes) -> None:
    """The one-row products: cuBLAS, the dense Triton GEMV swept, the 4-bit kernels swept."""
    bn_list, bk_list, w_list, bpi_list = sweeps
    dev = ws[0].device
    wt = [w.t().contiguous() for w in ws]
    x = torch.randn(1, k, device=dev, dtype=torch.float16)
    skip = torch.randn(k, device=dev, dtype=torch.float16)
    gamma = torch.rand(k, device=dev, dtype=torch.float16) + 0.5
    total = torch.empty(k, device=dev, dtype=torch.float16)
    bs = args.block_size
    nb = -(-k // bs)
    ref = F.linear(x, ws[0]).float()
    add("cublas-linear", time_in_graph(lambda i: F.linear(x, ws[i]), copies))
    add("cublas-matmul", time_in_graph(lambda i: x @ wt[i], copies))
    chosen = TL.dense_config(n, k)
    for bn, bk, warps in itertools.product(bn_list, bk_list, w_list):
        if bk > 2 * triton_pow2(k):
            continue
        with options.override(gemv_dense=(bn, bk, warps)):  # every shape: ONNXGEN_GEMV_DENSE=bn,bk,warps
            got = TL.linear_row(x, ws[0]).float()
            err = ((got - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                print(f"  {name} triton {bn}/{bk}/{warps}: WRONG (rel err {err:.3g})")
                continue
            mark = "*" if (bn, bk, warps) == chosen else ""
            add(f"triton {bn}/{bk}/{warps}{mark}", time_in_graph(lambda i: TL.linear_row(x, ws[i]), copies))

    def fused(i: int) -> torch.Tensor:
        return TL.linear_row(x, ws[i], prologue="skip_rms", x2=skip, gamma=gamma, eps=1e-6, sum_out=total)

    add("triton chosen + skip_rms prologue", time_in_graph(fused, copies))
    add("q4-dequant (fp16 copy)", time_in_graph(lambda i: F.linear(x, ws[i]), copies), wbytes)

    # the configuration linear_row_q4 takes here (fp16 activations, integer zero points: the pair kernel fits)
    qchosen = Q4.q4_config(n, k, bs, dev, bits=args.bits, half=args.bits == 4)
    wq = dequantize_nbits(qb[0], qs[0], qz[0], None, k=k, n=n, bits=args.bits, block_size=bs, dtype=torch.float32)
    qref = F.linear(x, wq.half()).float()

    def q4(i: int) -> torch.Tensor:
        return Q4.linear_row_q4(x, qb[i], qs[i], qz[i], n=n, k=k, block_size=bs, bits=args.bits)

    tile = triton_pow2(nb * bs)  # BLOCK_K >= K: the whole row in one program
    q4_bk = [tile] + ([b for b in (256, 512, 1024) if b < nb * bs] if nb * bs > 1024 else [])
    for bn, bk, warps in itertools.product(bpi_list, q4_bk, [4, 8]):
        mark = "*" if (bn, bk, warps, 0) == qchosen else ""
        with options.override(gemv_q4=(bn, bk, warps, 0)):  # ONNXGEN_GEMV_Q4=bn,bk,warps,0
            err = ((q4(0).float() - qref).norm() / qref.norm()).item()
            if not err < 1e-2:
                print(f"  {name} q4 {bn}/{bk}/{warps}: WRONG (rel err {err:.3g})")
                continue
            add(f"q4 {bn}/{bk}/{warps}{mark}", time_in_graph(q4, qcopies), qbytes)

    def q4_fused(i: int) -> torch.Tensor:
        return Q4.linear_row_q4(x, qb[i], qs[i], qz[i], n=n, k=k, block_size=bs, bits=args.bits, prologue="skip_rms",
                                x2=skip, gamma=gamma, eps=1e-6, sum_out=total)  # fmt: skip

    add("q4 chosen + skip_rms prologue", time_in_graph(q4_fused, qcopies), qbytes)
    # the same products over the codes as 32-bit words (gpu/linear_q4_words.py, KERNEL 1) and in fp16 pair
    # arithmetic (gpu/linear_q4_half.py, KERNEL 2)
    swept = (((1, "q4w"), args.words), ((2, "q4h"), args.half))
    for kernel, tag in [form for form, wanted in swept if wanted and args.bits == 4]:
        word_tiles = [tile] if nb * bs <= 2048 else [512, 1024]
        for bn, bk, warps in itertools.product([8, 16, 32, 64], word_tiles, [2, 4, 8]):
            with options.override(gemv_q4=(bn, bk, warps, kernel)):
                err = ((q4(0).float() - qref).norm() / qref.norm()).item()
                if not err < 1e-2:
                    print(f"  {name} {tag} {bn}/{bk}/{warps}: WRONG (rel err {err:.3g})")
                    continue
                mark = "*" if (bn, bk, warps, kernel) == qchosen else ""
                add(f"{tag} {bn}/{bk}/{warps}{mark}", time_in_graph(q4, qcopies), qbytes)
                if nb * bs <= 2048 and name != "lm_head":
                    add(f"{tag} {bn}/{bk}/{warps} + skip_rms prologue", time_in_graph(q4_fused, qcopies), qbytes)
    if args.one_warp and args.bits == 4:  # one-warp programs: their reductions take shuffles, no barriers
        kernels = [(0, "q4")] + [form for form, wanted in swept if wanted]
        for (kernel, tag), bn, bk in itertools.product(kernels, [2, 4, 8], q4_bk if nb * bs > 2048 else [tile]):
            with options.override(gemv_q4=(bn, bk, 1, kernel)):
                err = ((q4(0).float() - qref).norm() / qref.norm()).item()
                if not err < 1e-2:
                    print(f"  {name} {tag} {bn}/{bk}/1: WRONG (rel err {err:.3g})")
                    continue
                add(f"{tag} {bn}/{bk}/1", time_in_graph(q4, qcopies), qbytes)
                if nb * bs <= 2048 and name != "lm_head":
                    add(f"{tag} {bn}/{bk}/1 + skip_rms prologue", time_in_graph(q4_fused, qcopies), qbytes)
    if nb * bs <= 2048:  # rows a norm prologue can precede (the whole row in one tile): their sweep
        for bn, warps in itertools.product([16, 32, 64], [4, 8]):
            with options.override(gemv_q4=(bn, tile, warps, 0)):
                add(f"q4 {bn}/{tile}/{warps} + skip_rms prologue", time_in_graph(q4_fused, qcopies), qbytes)


def prompt_rows(name, k, n, args, ws, qb, qs, qz, qcopies, add, copies, wbytes, qbytes) -> None:
    """Several rows (a prompt; the lm_head reads one row, so there only M = 1 runs): cuBLAS on fp16
    against the 4-bit prompt paths: the default policy, the tiled GEMM swept, the split-K GEMM swept
    (q4_prompt=split)."""
    bs = args.block_size
    dev = ws[0].device
    # the lm_head multiplies one row only (a decode step's, or a prompt's last): there only M = 1
    for m in args.prompt_rows if name != "lm_head" else [r for r in args.prompt_rows if r == 1]:
        a = torch.randn(m, k, device=dev, dtype=torch.float16)
        add(f"prompt {m} rows: cublas fp16", time_in_graph(lambda i, a=a: F.linear(a, ws[i]), copies), wbytes)
        want = F.linear(a, dequantize_nbits(qb[0], qs[0], qz[0], None, k=k, n=n, bits=args.bits,
                                            block_size=bs, dtype=torch.float16)).float()  # fmt: skip
        gemms = GEMM_SWEEP_SMALL if m <= 64 else GEMM_SWEEP_LARGE
        variants = [("auto", None), ("dequant", None), ("dequant-bytes", None), ("gemm", None)]
        variants += [("gemm", c) for c in gemms]
        if m <= Q4.SPLIT_MAX_ROWS:
            variants += [("split", None)] + [("split", c) for c in SPLIT_SWEEP]
        for mode, config in variants:
            key = "gemm_q4_split" if mode == "split" else "gemm_q4"
            changes = {"q4_prompt": mode} | ({key: config} if config else {})
            if mode == "dequant-bytes":  # the same path with option q4_dequant's other kernel
                changes = {"q4_prompt": "dequant", "q4_dequant": "bytes"}
            with options.override(**changes):
                got = Q4.matmul_q4(a, qb[0], qs[0], qz[0], n=n, k=k, block_size=bs, bits=args.bits).float()
                err = ((got - want).norm() / want.norm()).item()
                us = time_in_graph(
                    lambda i, a=a: Q4.matmul_q4(a, qb[i], qs[i], qz[i], n=n, k=k, block_size=bs, bits=args.bits),
                    qcopies,
                )
                label = f"{mode} {','.join(map(str, config))}" if config else f"{mode} (default table)"
                if mode == "auto":
                    label = "default policy (dequant, or gemm for short prompts of short rows)"
                elif mode == "dequant":
                    label = "dequant by blocks (the default q4_dequant, then cuBLAS)"
                elif mode == "dequant-bytes":
                    label = "dequant by bytes (q4_dequant=bytes, then cuBLAS)"
                add(f"prompt {m} rows: q4 {label} (err {err:.1e})", us, qbytes)
    if args.prompt_rows and name != "lm_head":
        dequant_alone(k, n, args, qb, qs, qz, qcopies, add, qbytes)


def dequant_alone(k, n, args, qb, qs, qz, qcopies, add, qbytes) -> None:
    """The prompts' dequantization kernel alone, each form (option q4_dequant), the whole weight into
    one fp16 buffer: what the dequantize-then-cuBLAS path adds to cuBLAS. Both forms must give the
    same bits; the line says so."""
    bs = args.block_size
    outs = {}
    for form in Q4.DEQUANT_FORMS:
        buffer = torch.empty((n, k), dtype=torch.float16, device=qb[0].device)

        def run(i, form=form, buffer=buffer):
            packed, scale, zeros, kind = Q4._layout(qb[i], qs[i], qz[i], n, k, bs, args.bits)
            return Q4.dequantize_q4(packed, scale, zeros, kind, rows=slice(0, n), k=k, block_size=bs,
                                    dtype=torch.float16, out=buffer, bits=args.bits, form=form)  # fmt: skip

        outs[form] = run(0).clone()
        same = torch.equal(outs[form], outs[Q4.DEQUANT_FORMS[0]])
        add(f"dequantize alone, {form} form ({'same bits' if same else 'BITS DIFFER'})",
            time_in_graph(run, qcopies), qbytes)  # fmt: skip


# BLOCK_M, BLOCK_N, BLOCK_K, WARPS, STAGES of the 4-bit prompt GEMM tried per shape
# (the 32- and 64-row tiles: a tile of 16 rows reads each weight tile four times over 64 rows)
GEMM_SWEEP_SMALL = [(16, 32, 128, 4, 3), (16, 64, 128, 4, 3), (16, 64, 256, 4, 3), (16, 128, 128, 4, 3),
                    (32, 64, 128, 4, 3), (64, 64, 128, 4, 3), (64, 32, 128, 4, 3), (64, 128, 64, 4, 3)]  # fmt: skip
# BLOCK_M, BLOCK_N, BLOCK_K, WARPS, STAGES, SPLITS, WORDS of the split-K GEMM (SPLITS 0: its own rule)
SPLIT_SWEEP = [(16, 32, 128, 4, 3, 0, 0), (16, 32, 256, 4, 3, 0, 1), (16, 64, 128, 4, 3, 0, 1),
               (16, 32, 128, 4, 3, 1, 1), (16, 32, 128, 4, 3, 2, 1), (16, 32, 128, 4, 3, 8, 1),
               (16, 32, 128, 8, 3, 0, 1), (16, 16, 128, 4, 3, 0, 1), (16, 128, 128, 4, 3, 0, 1),
               (32, 32, 128, 4, 3, 0, 0), (64, 32, 128, 4, 3, 0, 0), (64, 64, 128, 4, 3, 0, 0),
               (32, 64, 128, 4, 3, 0, 0), (64, 32, 128, 8, 3, 0, 0)]  # fmt: skip
# (the 256-row and 256-column tiles: twice the products per dequantized weight tile; compiled for sm_90
# their K loops issue about 0.4 instructions per tensor-core cycle of their products, against about 0.8
# for 128 x 128 x 64)
# and SWAP 1 (the weight tile as the tensor cores' first operand, from registers; a sixth value)
GEMM_SWEEP_LARGE = [(64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 64, 128, 4, 3), (64, 128, 128, 8, 3),
                    (128, 128, 128, 8, 3), (256, 128, 64, 8, 3), (128, 256, 64, 8, 3),
                    (256, 128, 128, 8, 2), (64, 128, 64, 4, 3, 1), (128, 128, 64, 8, 3, 1), (128, 256, 64, 8, 3, 1),
                    (256, 128, 64, 8, 3, 1), (128, 128, 128, 8, 3, 1)]  # fmt: skip


def triton_pow2(k: int) -> int:
    return 1 << max(0, (k - 1).bit_length())


if __name__ == "__main__":
    sys.exit(main())
