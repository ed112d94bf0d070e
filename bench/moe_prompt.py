"""One routed-expert layer of a prompt, timed per expert path: the per-pair kernels (each (token,
expert) pair reads its expert, gpu/moe_experts.py) against the grouped ones (each chosen expert
read once per tile of its pairs, gpu/moe_grouped.py), at the bound option moe_pairs_per_expert sets.

    python -m bench.moe_prompt --tokens 1,16,32,64,128,256 --bounds 4,1,0.5,0
    python -m bench.moe_prompt --tokens 32,64,128 --bounds 0 --variant rule: \
        --variant m32:ONNXGEN_MOE_GROUPED=32,32,64,64,4 --variant k128:ONNXGEN_MOE_GROUPED=0,32,64,128,4

The layer is the Qwen3.5-35B-A3B shape as onnxgen's int4 build writes it (--experts 256, top
--top-k 8, --hidden 2048, --inter 512; SwiGLU interleaved; 4-bit blocks of 32 with zero points;
fp16 activations), random codes and router logits (seeded). Each (tokens, bound) call is recorded
in a CUDA graph, as a captured prompt chunk runs it, and timed over its replays
(gemv_micro.time_in_graph: the median of five runs of 20 back-to-back replays). That time is
printed with the bytes the call must read (every chosen expert once) and what that is per second,
and the largest difference from the first bound's output (the grouped kernels round the weights
and h to fp16 for the tensor cores; the per-pair ones keep fp32).
Each --variant NAME:ENV=VALUE,... (bench/step_sweep.py's form, e.g. a forced grouped tile,
ONNXGEN_MOE_GROUPED) runs every length and bound again under those settings, in this process.
CUDA only: the kernels' timing is the point.
"""

from __future__ import annotations

import argparse

import torch

from bench.gemv_micro import time_in_graph
from bench.step_sweep import apply_env, check_variant, parse_variant
from onnxgen import options
from onnxgen.runtime.gpu.launch import LAUNCHES
from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.contrib_moe import qmoe
from onnxgen.runtime.ops.contrib_quant import unpack_codes

MS = "com.microsoft"
BLOCK = 32


def quantized(gen: torch.Generator, experts: int, n: int, k: int, zero_bytes: bool) -> tuple[torch.Tensor, ...]:
    """(codes [E, N, K / 2], fp16 scales [E, N, K / 32], 4-bit zero points: packed, or with
    ``zero_bytes`` int8 a byte per block as option moe_zero_bytes holds them) on the GPU."""
    codes = torch.randint(0, 256, (experts, n, k // 2), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(experts, n, k // BLOCK, generator=gen) + 0.5) / (8 * k**0.5)
    zeros = torch.randint(0, 256, (experts, n, -(-k // BLOCK // 2)), generator=gen, dtype=torch.uint8)
    if zero_bytes:
        zeros = unpack_codes(zeros, 4)[..., : k // BLOCK].to(torch.int8)
    return codes.cuda(), scales.half().cuda(), zeros.contiguous().cuda()


def graph_us(call) -> tuple[float, torch.Tensor]:
    """``call`` recorded in a CUDA graph and timed by gemv_micro.time_in_graph (us per replay), and
    the recorded output."""
    out: list[torch.Tensor] = []
    us = time_in_graph(lambda _: out.append(call()), 1)
    return us, out[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,16,32,64,128,256", help="prompt lengths, comma-separated")
    parser.add_argument("--bounds", default="4,1,0.5,0.25,0", help="moe_pairs_per_expert values, comma-separated")
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=512)
    parser.add_argument("--variant", action="append", default=[], help="NAME:ENV=VALUE,... (step_sweep's form)")
    parser.add_argument("--zero-points", choices=["packed", "bytes"], default="packed",
                        help="the experts' zero points as QMoE stores them, or a byte per block (option "
                        "moe_zero_bytes's form; the tensors are made here, not loaded by a session)")  # fmt: skip
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variant] or [("", {})]
    for _, env in variants:
        check_variant(env)
    if not torch.cuda.is_available():
        raise SystemExit("bench.moe_prompt times CUDA kernels: no CUDA device here")
    gen = torch.Generator().manual_seed(0)
    e, h, inter = args.experts, args.hidden, args.inter
    fc1 = quantized(gen, e, 2 * inter, h, args.zero_points == "bytes")
    fc2 = quantized(gen, e, h, inter, args.zero_points == "bytes")
    attrs = {"activation_type": "swiglu", "k": args.top_k, "swiglu_fusion": 1, "normalize_routing_weights": 1,
             "expert_weight_bits": 4, "block_size": BLOCK}  # fmt: skip
    ctx = NodeContext("QMoE", "QMoE", MS, 1, attrs, torch.device("cuda"), 14, 1, (True,))
    expert_bytes = sum(
        t[0].numel() + 2 * t[1].numel() + t[2].numel()
        for t in ((fc1[0][0], fc1[1][0], fc1[2][0]), (fc2[0][0], fc2[1][0], fc2[2][0]))
    )
    bounds = [float(b) for b in args.bounds.split(",")]
    print(
        f"moe_prompt: {e} experts, top {args.top_k}, hidden {h}, inter {inter}, int4 blocks of {BLOCK} with zero "
        f"points ({args.zero_points}), fp16; {expert_bytes / 1e6:.2f} MB per expert; {torch.cuda.get_device_name()}"
    )
    for name, env in variants:
        if name or env:
            apply_env(env)
            print(f"variant {name}: {', '.join(f'{k}={v}' for k, v in env.items()) or 'the process settings'}")
        gen.manual_seed(1)  # the same prompts and routing for every variant
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = (torch.randn(tokens, h, generator=gen)).half().cuda()
            router = (torch.randn(tokens, e, generator=gen) * 2).half().cuda()
            chosen = router.float().topk(args.top_k, dim=-1).indices
            distinct = int(chosen.unique().numel())
            inputs = [x, router, fc1[0], fc1[1], None, fc2[0], fc2[1], None, None, None, None, fc1[2], fc2[2], None]
            floor_mb = distinct * expert_bytes / 1e6
            first = None
            for bound in bounds:
                with options.override(moe_pairs_per_expert=bound):
                    grouped_before = LAUNCHES["moe_grouped"]
                    us, out = graph_us(lambda inputs=inputs: qmoe(ctx, *inputs))
                    path = "grouped" if LAUNCHES["moe_grouped"] > grouped_before else "per-pair"
                diff = 0.0 if first is None else float((out.float() - first.float()).abs().max())
                first = out if first is None else first
                print(
                    f"tokens {tokens:4d} ({tokens * args.top_k:5d} pairs, {distinct:3d} experts, {floor_mb:7.1f} MB): "
                    f"bound {bound:g} -> {path:8s} {us:8.1f} us  {floor_mb / us:6.2f} TB/s of the chosen experts' "
                    f"bytes  max |diff| {diff:.2e}"
                )


if __name__ == "__main__":
    main()
