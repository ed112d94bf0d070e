"""Mixture of experts (com.microsoft MoE, and QMoE over integer-quantized experts): routing, each
token's top-k expert FFNs and their weighted sum, as onnxruntime-genai's builder writes them for
MoE decoders (QMoE for int4 experts).

Routing: softmax over each token's router logits, the top k experts, their probabilities
renormalized to sum to one where ``normalize_routing_weights`` is set. Expert e's FFN is
fc2_e(act(fc1_e(x))) (+ biases), with SwiGLU taking its gate and up halves from a fused fc1
(interleaved or concatenated) or from fc1 and fc3. Everything is computed in fp32 and rounded to
the tensor type once.

"gelu" is the tanh approximation, as onnxruntime's CPU kernel computes it.

On CUDA (where Triton serves, launch.triton_serves) a call of up to
option moe_pairs_per_expert times experts (token, expert) pairs runs the experts as two Triton
kernels that read each pair's expert weights in place (dense, or QMoE's 4- and 8-bit codes, scales
and zero points as stored): no gathered or dequantized copy, no host read, shapes from the token
count alone, so a decode step (and a short prompt) containing it can be recorded. Longer prompts
take gpu/moe_grouped.py's kernels: the pairs grouped by expert on the device, each expert's
weights read once per tile of its pairs, on tensor cores; recordable too. The routing is one
kernel there (gpu/moe_routing.py: softmax, top k, renormalization), where torch's form takes five
or six. Forms the kernels do not read (moe_experts.moe_experts says None) take the torch path below.

The torch path, two ways to run the experts with the same arithmetic: where a call has at most as
many pairs as there are experts (a decode step: k pairs) each pair's weights are gathered on the
device by the routing indices (dequantized to fp32 whole), so nothing waits for the host and the
shapes depend on the token count alone; with more (a prompt, a wide batched step) the tokens are
grouped by expert, one GEMM per expert that has tokens, which reads the routing on the host: a
recording that meets it fails, and the capture runtime quarantines the op and runs it eagerly,
saying so (on CUDA only for forms the kernels do not read).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from onnxgen.runtime.gpu.launch import triton_serves
from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.registry import MS_DOMAIN, implements

_ACTIVATIONS = ("relu", "gelu", "silu", "swiglu", "identity")


def _activation(kind: str, h: torch.Tensor, up: torch.Tensor | None, alpha: float, beta: float, limit: float | None):
    if kind == "swiglu":
        assert up is not None
        if limit is not None:
            h = h.clamp(max=limit)
            up = up.clamp(min=-limit, max=limit)
        return h * torch.sigmoid(alpha * h) * (up + beta)
    if kind == "relu":
        return F.relu(h)
    if kind == "gelu":
        return F.gelu(h, approximate="tanh")
    if kind == "silu":
        return F.silu(h)
    return h


@implements("MoE", domain=MS_DOMAIN)
def moe(
    ctx: NodeContext,
    x: torch.Tensor,
    router_probs: torch.Tensor,
    fc1_weights: torch.Tensor,
    fc1_bias: torch.Tensor | None = None,
    fc2_weights: torch.Tensor | None = None,
    fc2_bias: torch.Tensor | None = None,
    fc3_weights: torch.Tensor | None = None,
    fc3_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    if fc2_weights is None:
        raise ctx.fail("fc2_experts_weights is required")
    experts = _DenseExperts({"fc1": fc1_weights, "fc2": fc2_weights, "fc3": fc3_weights},
                            {"fc1": fc1_bias, "fc2": fc2_bias, "fc3": fc3_bias})  # fmt: skip
    return _mixture(ctx, x, router_probs, experts)


@implements("QMoE", domain=MS_DOMAIN)
def qmoe(
    ctx: NodeContext,
    x: torch.Tensor,
    router_probs: torch.Tensor,
    fc1_weights: torch.Tensor,
    fc1_scales: torch.Tensor | None = None,
    fc1_bias: torch.Tensor | None = None,
    fc2_weights: torch.Tensor | None = None,
    fc2_scales: torch.Tensor | None = None,
    fc2_bias: torch.Tensor | None = None,
    fc3_weights: torch.Tensor | None = None,
    fc3_scales: torch.Tensor | None = None,
    fc3_bias: torch.Tensor | None = None,
    fc1_zero_points: torch.Tensor | None = None,
    fc2_zero_points: torch.Tensor | None = None,
    fc3_zero_points: torch.Tensor | None = None,
    router_weights: torch.Tensor | None = None,
    *rest: torch.Tensor | None,
) -> torch.Tensor:
    """MoE over integer-quantized experts (quant_type 'int', 4 or 8 bits, per row or per block
    along K): each call dequantizes only the experts it runs (the gathered pairs, or one expert at
    a time), so no dequantized copy of an expert outlives the call."""
    quant = ctx.attr("quant_type", "int")
    if quant != "int":
        raise ctx.fail(f"quant_type {quant!r}: only integer quantization ('int') is implemented")
    if int(ctx.attr("weights_prepacked", -1)) == 1:
        raise ctx.fail("weights_prepacked 1 (an execution provider's prepacked layout) is not supported; expected "
                       "the raw [experts, N, K * bits / 8] layout (0)")  # fmt: skip
    if router_weights is not None or any(extra is not None for extra in rest):
        raise ctx.fail("router_weights and the fp4/fp8 global and activation scales are not implemented")
    if fc2_weights is None or fc1_scales is None or fc2_scales is None:
        raise ctx.fail("fc2_experts_weights, fc1_scales and fc2_scales are required for quant_type 'int'")
    if fc3_weights is not None and fc3_scales is None:
        raise ctx.fail("fc3_experts_weights needs fc3_scales")
    default_bits = int(ctx.attr("expert_weight_bits", 4))
    bits = {fc: int(ctx.attr(f"{fc}_expert_weight_bits", default_bits)) for fc in ("fc1", "fc2", "fc3")}
    for fc, b in bits.items():
        if b not in (4, 8):
            raise ctx.fail(f"{fc} has {b}-bit weights; onnxgen's QMoE takes 4 or 8 bits")
    block = int(ctx.attr("block_size", 0) or 0)
    if block and (block < 16 or block & (block - 1)):
        raise ctx.fail(f"block_size {block} must be a power of two >= 16")
    experts = _QuantExperts(
        {"fc1": fc1_weights, "fc2": fc2_weights, "fc3": fc3_weights},
        {"fc1": fc1_scales, "fc2": fc2_scales, "fc3": fc3_scales},
        {"fc1": fc1_zero_points, "fc2": fc2_zero_points, "fc3": fc3_zero_points},
        {"fc1": fc1_bias, "fc2": fc2_bias, "fc3": fc3_bias},
        bits, block, x.shape[-1],
    )  # fmt: skip
    return _mixture(ctx, x, router_probs, experts)


class _DenseExperts:
    """Expert weights as stored: [experts, N, K] per projection."""

    def __init__(self, weights: dict[str, torch.Tensor | None], biases: dict[str, torch.Tensor | None]):
        self.weights, self.biases = weights, biases

    def count(self) -> int:
        return self.weights["fc1"].shape[0]

    def shape(self, fc: str) -> tuple[int, int] | None:
        w = self.weights[fc]
        return None if w is None else (w.shape[1], w.shape[2])

    def weight(self, fc: str, index: torch.Tensor | int) -> torch.Tensor:
        return self.weights[fc][index].float()

    def bias(self, fc: str, index: torch.Tensor | int) -> torch.Tensor | None:
        b = self.biases[fc]
        return None if b is None else b[index].float()

    def stored(self, fc: str) -> dict | None:
        """The projection's tensors as stored (gpu/moe_experts.ExpertWeights' fields), or None."""
        w = self.weights[fc]
        return None if w is None else dict(weight=w, inner=w.shape[2], bias=self.biases[fc])


class _QuantExperts(_DenseExperts):
    """Expert weights as QMoE stores them: [experts, N, K * bits / 8] codes (two 4-bit codes per
    byte, the low nibble first), scales per row [experts, N] or per block [experts, N, K / block],
    zero points packed like the codes (default 2^(bits - 1)); dequantized per call."""

    def __init__(self, codes, scales, zeros, biases, bits: dict[str, int], block: int, hidden: int):
        super().__init__(codes, biases)
        self.scales, self.zeros, self.bits, self.block = scales, zeros, bits, block
        self.inner = {"fc1": hidden, "fc2": codes["fc2"].shape[2] * 8 // bits["fc2"], "fc3": hidden}

    def shape(self, fc: str) -> tuple[int, int] | None:
        w = self.weights[fc]
        return None if w is None else (w.shape[1], self.inner[fc])

    def stored(self, fc: str) -> dict | None:
        w = self.weights[fc]
        if w is None:
            return None
        return dict(weight=w, inner=self.inner[fc], bits=self.bits[fc], scales=self.scales[fc], zeros=self.zeros[fc],
                    bias=self.biases[fc])  # fmt: skip

    def weight(self, fc: str, index: torch.Tensor | int) -> torch.Tensor:
        bits, k = self.bits[fc], self.inner[fc]
        q = _unpack(self.weights[fc][index], bits)[..., :k].float()  # (..., N, K)
        scale = self.scales[fc][index].float()
        column_wise = scale.dim() == q.dim() - 1  # one scale per row
        if column_wise:
            scale = scale.unsqueeze(-1)
        zero_codes = self.zeros[fc]
        if zero_codes is None:
            zero = torch.full_like(scale, float(1 << (bits - 1)))
        elif column_wise:  # (..., ceil(N * bits / 8)): one zero point per row
            zero = _unpack(zero_codes[index], bits)[..., : q.shape[-2]].unsqueeze(-1).float()
        elif zero_codes.dtype == torch.int8:  # (..., N, blocks): a byte per block (contrib_quant.widen_zero_points)
            zero = zero_codes[index].float()
        else:  # (..., N, ceil(blocks * bits / 8))
            zero = _unpack(zero_codes[index], bits)[..., : scale.shape[-1]].float()
        block = k // scale.shape[-1]
        return (q - zero.repeat_interleave(block, dim=-1)) * scale.repeat_interleave(block, dim=-1)


# QMoE's inputs per projection: (scales, zero points)
_SCALE_AND_ZERO_INPUTS = {"fc1": (3, 11), "fc2": (6, 12), "fc3": (9, 13)}


def packed_expert_zero_readers(
    ctx: NodeContext, inputs: list[str], initializers: dict
) -> list[tuple[str, tuple[int, int, int]]]:
    """(zero point input, (experts, N, blocks)) of each 4-bit projection of a block-wise QMoE whose
    packed per-block zero points contrib_quant.widen_zero_points may widen to a byte per block (the
    expert kernels' ZERO_KIND 3 with per-block scales); none where a projection with zero points
    is not 4-bit or has no 3-D initializer scales, since the kernels take fc1 and fc3 in one form.
    (Where widen_zero_points must keep one of them packed, as another op reads it too, it keeps all
    of the node's packed.)"""
    if (ctx.op_type, ctx.domain) != ("QMoE", MS_DOMAIN) or not int(ctx.attrs.get("block_size", 0) or 0):
        return []
    default_bits = int(ctx.attrs.get("expert_weight_bits", 4))
    found = []
    for fc, (scale_at, zero_at) in _SCALE_AND_ZERO_INPUTS.items():
        zero_name = inputs[zero_at] if len(inputs) > zero_at else ""
        if not zero_name:
            continue
        if int(ctx.attrs.get(f"{fc}_expert_weight_bits", default_bits)) != 4:
            return []
        scales = initializers.get(inputs[scale_at]) if len(inputs) > scale_at else None
        if not isinstance(scales, torch.Tensor) or scales.dim() != 3:
            return []
        found.append((zero_name, tuple(scales.shape)))
    return found


def _unpack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes (..., B) as integers (..., B * 8 / bits): 4-bit codes low nibble first."""
    if bits == 8:
        return codes.to(torch.int32)
    wide = codes.to(torch.int32)
    return torch.stack((wide & 0xF, wide >> 4), dim=-1).flatten(-2)


def _mixture(ctx: NodeContext, x: torch.Tensor, router_probs: torch.Tensor, experts: _DenseExperts) -> torch.Tensor:
    kind = ctx.attr("activation_type", "relu")
    if kind not in _ACTIVATIONS:
        raise ctx.fail(f"activation_type {kind!r} is not one of {', '.join(_ACTIVATIONS)} (onnxgen's MoE)")
    if int(ctx.attr("use_sparse_mixer", 0)):
        raise ctx.fail("use_sparse_mixer (Phi-3.5-MoE's sparse mixer routing) is not implemented")
    if int(ctx.attr("swiglu_limit_after_activation", 0)):
        raise ctx.fail("swiglu_limit_after_activation (onnxruntime's CUDA-only clamp) is not implemented")
    fusion = int(ctx.attr("swiglu_fusion", 0))
    if fusion not in (0, 1, 2):
        raise ctx.fail(f"swiglu_fusion must be 0, 1 or 2, got {fusion}")
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    count = experts.count()
    k = int(ctx.attr("k", 1))
    if router_probs.shape != (rows.shape[0], count):
        raise ctx.fail(f"router_probs has shape {list(router_probs.shape)}; expected [{rows.shape[0]}, {count}] "
                       "(one row per token, one column per expert)")  # fmt: skip
    if not 1 <= k <= count:
        raise ctx.fail(f"k {k} must be between 1 and the {count} experts")
    fused = kind == "swiglu" and fusion in (1, 2)
    if kind == "swiglu" and not fused and experts.shape("fc3") is None:
        raise ctx.fail("swiglu with swiglu_fusion 0 takes its up projection from fc3_experts_weights, which is missing")
    fc1, fc2 = experts.shape("fc1"), experts.shape("fc2")
    if fc1 is None or fc2 is None or fc1[1] != hidden or fc2[0] != hidden:
        raise ctx.fail(f"expert weights fc1 {fc1} and fc2 {fc2} (N, K) do not match hidden size {hidden}")
    limit = ctx.attr("swiglu_limit", None)
    params = _Params(
        kind, fusion if fused else 0, float(ctx.attr("activation_alpha", 1.0)), float(ctx.attr("activation_beta", 0.0)),
        None if limit is None or math.isinf(float(limit)) else float(limit),
    )  # fmt: skip

    normalize = bool(int(ctx.attr("normalize_routing_weights", 0)))
    on_device = triton_serves(rows)
    routed = None
    if on_device:
        from onnxgen.runtime.gpu.moe_routing import route

        routed = route(router_probs, k, normalize)  # one kernel (None where it does not serve)
    if routed is not None:
        weights, chosen = routed
    else:
        probs = torch.softmax(router_probs.float(), dim=-1)
        weights, chosen = probs.topk(k, dim=-1)  # (T, k)
        if normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    out = _on_kernels(rows, chosen, weights, experts, params) if on_device else None
    if out is None:
        xf = rows.float()
        if rows.shape[0] * k <= count:
            out = _gathered(xf, chosen, weights, experts, params)
        else:
            out = _grouped(xf, chosen, weights, experts, params)
    return out.to(x.dtype).reshape(x.shape)


def _on_kernels(rows, chosen, weights, experts: _DenseExperts, p: _Params) -> torch.Tensor | None:
    """The experts through gpu/moe_experts.py's kernels (the weights read in place), or None where
    they do not serve this call (its form, or more pairs than they take)."""
    from onnxgen.runtime.gpu.moe_experts import ExpertWeights, moe_experts

    fc1, fc2, fc3 = (experts.stored(fc) for fc in ("fc1", "fc2", "fc3"))
    assert fc1 is not None and fc2 is not None
    up = None if fc3 is None else ExpertWeights(**fc3)
    return moe_experts(rows, chosen, weights, ExpertWeights(**fc1), ExpertWeights(**fc2), up, activation=p.kind,
                       fusion=p.fusion, alpha=p.alpha, beta=p.beta, limit=p.limit)  # fmt: skip


class _Params:
    def __init__(self, kind: str, fusion: int, alpha: float, beta: float, limit: float | None):
        self.kind, self.fusion, self.alpha, self.beta, self.limit = kind, fusion, alpha, beta, limit

    def split(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fc1's output as (gate or the only half, up or None)."""
        if self.fusion == 1:  # [g0, l0, g1, l1, ...]
            return h[..., 0::2], h[..., 1::2]
        if self.fusion == 2:  # [g | l]
            half = h.shape[-1] // 2
            return h[..., :half], h[..., half:]
        return h, None


def _ffn(xe: torch.Tensor, experts: _DenseExperts, index: torch.Tensor | int, p: _Params) -> torch.Tensor:
    """fc2(act(fc1 x)) for rows xe, through one expert (index an int) or each row's own (index a
    tensor of one expert per row)."""
    per_row = isinstance(index, torch.Tensor)

    def project(fc: str, inputs: torch.Tensor) -> torch.Tensor:
        w = experts.weight(fc, index)
        y = torch.einsum("pnk,pk->pn", w, inputs) if per_row else inputs @ w.T
        b = experts.bias(fc, index)
        return y if b is None else y + b

    gate, up = p.split(project("fc1", xe))
    if p.kind == "swiglu" and up is None:
        up = project("fc3", xe)
    return project("fc2", _activation(p.kind, gate, up, p.alpha, p.beta, p.limit))


def _gathered(xf, chosen, weights, experts: _DenseExperts, p: _Params) -> torch.Tensor:
    """Each (token, expert) pair's weights gathered by index: no host read, fixed shapes."""
    xk = xf.repeat_interleave(chosen.shape[1], dim=0)  # (T * k, H)
    y = _ffn(xk, experts, chosen.reshape(-1), p)
    return (y.reshape(*chosen.shape, -1) * weights.unsqueeze(-1)).sum(dim=1)


def _grouped(xf, chosen, weights, experts: _DenseExperts, p: _Params) -> torch.Tensor:
    """Tokens grouped by expert: one GEMM per expert that any token chose (reads the routing)."""
    out = torch.zeros_like(xf)
    token_of_pair = torch.arange(chosen.shape[0], device=xf.device).repeat_interleave(chosen.shape[1])
    flat_expert, flat_weight = chosen.reshape(-1), weights.reshape(-1)
    order = torch.argsort(flat_expert, stable=True)
    counts = torch.bincount(flat_expert, minlength=experts.count()).tolist()
    start = 0
    for e, count in enumerate(counts):
        if not count:
            continue
        pick = order[start : start + count]
        start += count
        tokens = token_of_pair[pick]
        out.index_add_(0, tokens, _ffn(xf[tokens], experts, e, p) * flat_weight[pick].unsqueeze(-1))
    return out
