"""The routing of com.microsoft MoE / QMoE in one Triton kernel: softmax over the router logits,
the top k experts, optionally renormalized.

Why: runtime/ops/contrib_moe.py's torch form takes five or six kernels per layer (the cast to fp32,
the softmax, top-k, the sum and the division of the renormalization); on the Qwen3.5-35B-A3B shape
that is forty layers of them in every decode step, each far shorter than a launch. One program
here owns one token's row of E logits:

    p        = softmax(logits) in fp32 (exp(l - max) / sum)
    for j < k: w_j = the largest p not taken yet, e_j its expert (the lowest index among equals)
    w        = w / sum(w)          (normalize_routing_weights)

so the chosen experts come in descending weight, as torch.topk's sorted output does; where two
probabilities are equal the lower expert comes first (torch leaves that order open). The routing
differs from the torch form's only in the rounding of exp and the sums (a choice can move where
two experts' probabilities differ by about one fp32 ulp). Every reduction has a fixed order: a
run repeats bit for bit. The kernel is launched without programmatic dependent launch, as
torch's top-k was, so the expert kernels after it may read the routing before their wait
(launch.settled_before_launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onnxgen.runtime.gpu.launch import COMPILE_OPTIONS, KERNEL_DTYPES, LAUNCHES

MAX_EXPERTS = 4096  # one program holds a token's logits
MAX_K = 32


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, chosen_ptr, experts, row_stride, K: tl.constexpr, KP: tl.constexpr,
    NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    ok = e < experts
    logits = tl.load(logits_ptr + t.to(tl.int64) * row_stride + e, mask=ok, other=float("-inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, 0))
    p = p / tl.sum(p, 0)
    left = tl.where(ok, p, -1.0)  # probabilities are >= 0: -1 marks an expert taken or absent
    slot = tl.arange(0, KP)
    weights = tl.zeros((KP,), tl.float32)
    chosen = tl.zeros((KP,), tl.int64)
    for j in tl.static_range(K):
        best = tl.max(left, 0)
        index = tl.min(tl.where(left == best, e, BLOCK_E), 0)
        weights = tl.where(slot == j, best, weights)
        chosen = tl.where(slot == j, index.to(tl.int64), chosen)
        left = tl.where(e == index, -1.0, left)
    if NORMALIZE:
        weights = weights / tl.sum(weights, 0)
    tl.store(weights_ptr + t * K + slot, weights, mask=slot < K)
    tl.store(chosen_ptr + t * K + slot, chosen, mask=slot < K)


def route(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(weights [T, k] fp32, chosen [T, k] int64) for router logits [T, E], or None where the kernel
    does not serve (the caller runs the torch form)."""
    if logits.dim() != 2 or logits.dtype not in KERNEL_DTYPES or logits.stride(-1) != 1:
        return None
    tokens, experts = logits.shape
    if not 1 <= k <= min(experts, MAX_K) or experts > MAX_EXPERTS:
        return None
    weights = torch.empty((tokens, k), dtype=torch.float32, device=logits.device)
    chosen = torch.empty((tokens, k), dtype=torch.int64, device=logits.device)
    if tokens:
        LAUNCHES["moe_routing"] += 1
        _route_kernel[(tokens,)](
            logits, weights, chosen, experts, logits.stride(0), K=k, KP=triton.next_power_of_2(k),
            NORMALIZE=normalize, BLOCK_E=triton.next_power_of_2(experts), **COMPILE_OPTIONS,
        )  # fmt: skip
    return weights, chosen
