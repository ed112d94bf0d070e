"""Kernels of the ops the CUDA fusion pass writes (onnxgen/runtime/fusion.py; domain ``onnxgen``).

- ``MatMulGroup(A, W_1..W_n, bias_1..bias_n)``, attribute ``widths``: one GEMM of A with the
  weights concatenated along N (made once per weight set and cached), bias in the GEMM's
  epilogue, split into the n outputs (views).
- ``MatMulNBitsGroup(A, (B, scales, zero_points)_1..n, bias_1..n)``: each MatMulNBits weight
  dequantized as MatMulNBits would, concatenated, then the same GEMM; with option ``triton_q4`` (on
  by default) the packed codes end to end through gpu/linear_q4.py instead. A CUDA session joins the members' codes
  once (fusion.pack_nbits_groups, attribute ``packed_weight``): one member of width sum(widths).
- ``SiluMul(g, u)``: silu(g) * u.
- ``SigmoidGate(y, g[, x])``: y * sigmoid(g) (+ x), in fp32, rounded once (fusion_gates.py).
- ``L2Normalize(x)``, attribute ``epsilon``: x / sqrt(sum(x^2) + epsilon) over the last axis, in
  fp32 (fp64 for fp64), rounded once; one kernel where Triton serves (gpu/l2_norm.py).
Either group may carry a ``prologue`` (attribute; inputs x2 and gamma after the biases, see
fusion.py): rms, skip_rms (residual sum as the last output) or silu_mul, applied to A first. At one
row on a Triton device the group is one kernel, prologue included (gpu/linear_row.py);
otherwise the prologue runs first, as the unfused graph's op would, then the GEMM.
The concatenated weights cost memory next to the originals (which the graph still holds); the
MatMulNBits dequantized copy counts against ONNXGEN_DEQUANT_CACHE_MB like MatMulNBits' own.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
import torch.nn.functional as F

from onnxgen.runtime.dtypes import torch_dtype
from onnxgen.runtime.gpu.launch import linear_row_serves, triton_serves
from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.common import sdpa
from onnxgen.runtime.ops.contrib_attention import compute_dtype
from onnxgen.runtime.ops.contrib_norm import simplified_layer_norm, skip_simplified_layer_norm
from onnxgen.runtime.ops.contrib_quant import (
    DEQUANT_CACHE,
    SCRATCH_ATTR,
    _int8_activations,
    dequantize_nbits,
    fake_quantize_int8_blocks,
    q4_kernel_applies,
    q4_linear,
)
from onnxgen.runtime.ops.registry import implements

FUSED_DOMAIN = "onnxgen"


def _cached_bias(biases: tuple, widths: list[int], like: torch.Tensor) -> torch.Tensor | None:
    """The members' biases end to end (zeros for a member without one), made once."""
    if all(b is None for b in biases):
        return None
    return DEQUANT_CACHE.get(biases, ("group-bias", like.dtype), lambda: _group_bias(biases, widths, like))


def _group_bias(biases: tuple, widths: list[int], like: torch.Tensor) -> torch.Tensor:
    parts = [b.to(like.dtype) if b is not None else torch.zeros(w, dtype=like.dtype, device=like.device)
             for b, w in zip(biases, widths)]  # fmt: skip
    return torch.cat(parts)


def _linear_split(a: torch.Tensor, weight_nk: torch.Tensor, bias: torch.Tensor | None, widths: list[int]):
    out = F.linear(a, weight_nk, bias)
    return tuple(torch.split(out, widths, dim=-1))


def _prologue(ctx: NodeContext) -> str:
    kind = ctx.attr("prologue", "")
    return kind.decode() if isinstance(kind, bytes) else str(kind)


def _split_prologue(ctx: NodeContext, rest: tuple, count: int) -> tuple[tuple, Any, Any]:
    """(the group's own inputs, x2, gamma): a prologue's two inputs come after the ``count`` own ones."""
    own = tuple(rest[:count]) + (None,) * (count - len(rest))
    if not _prologue(ctx):
        return own, None, None
    extra = tuple(rest[count : count + 2]) + (None,) * 2
    return own, extra[0], extra[1]


# the op each prologue stands for, run as that op (same kernel, same roundings): its type, the
# number of outputs and which of them the group needs
_PROLOGUE_OPS = {
    "rms": ("SimplifiedLayerNormalization", 1, (True,)),
    "skip_rms": ("SkipSimplifiedLayerNormalization", 4, (True, False, False, True)),
}


def apply_prologue(ctx: NodeContext, a: torch.Tensor, x2, gamma) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The prologue as its own op computes it: (the group's A, the residual sum or None)."""
    kind = _prologue(ctx)
    if kind == "silu_mul":
        if x2 is None or x2.shape != a.shape:
            raise ctx.fail(f"silu_mul prologue: up {None if x2 is None else list(x2.shape)} vs gate {list(a.shape)}")
        return silu_mul(ctx, a, x2), None
    if kind not in _PROLOGUE_OPS:
        raise ctx.fail(f"unknown prologue {kind!r} (rms, skip_rms or silu_mul)")
    if gamma is None or gamma.shape != (a.shape[-1],):
        raise ctx.fail(f"{kind} prologue: gamma must be [{a.shape[-1]}]")
    if kind == "skip_rms" and (x2 is None or x2.shape != a.shape):
        raise ctx.fail("skip_rms prologue: the skip input must have A's shape")
    op_type, outputs, wanted = _PROLOGUE_OPS[kind]
    norm_ctx = dataclasses.replace(
        ctx, op_type=op_type, attrs={"epsilon": float(ctx.attr("epsilon", 0.0))}, num_outputs=outputs,
        outputs_wanted=wanted,
    )  # fmt: skip
    if kind == "rms":
        return simplified_layer_norm(norm_ctx, a, gamma), None
    y, _, _, total = skip_simplified_layer_norm(norm_ctx, a, x2, gamma)
    return y, total


def _with_sum(ctx: NodeContext, outs: tuple[torch.Tensor, ...], total: torch.Tensor | None) -> tuple:
    return (*outs, total) if _prologue(ctx) == "skip_rms" else outs


def _row_prologue_ok(ctx: NodeContext, a: torch.Tensor, k: int, x2, gamma) -> bool:
    """The one-row kernel can compute this prologue itself (else the prologue runs first)."""
    kind = _prologue(ctx)
    if a.numel() != k:
        return False
    if kind in ("silu_mul", "skip_rms") and (x2 is None or x2.dtype != a.dtype or x2.numel() != k):
        return False
    if kind in ("rms", "skip_rms") and (gamma is None or gamma.dtype != a.dtype or gamma.numel() != k):
        return False
    return True


def _row_kwargs(ctx: NodeContext, a: torch.Tensor, x2, gamma) -> tuple[dict, torch.Tensor | None]:
    kind = _prologue(ctx) or "none"
    total = torch.empty_like(a) if kind == "skip_rms" else None
    args = dict(prologue=kind, x2=x2, gamma=gamma, eps=float(ctx.attr("epsilon", 0.0)), sum_out=total)
    return args, total


@implements("MatMulGroup", domain=FUSED_DOMAIN)
def matmul_group(ctx: NodeContext, a: torch.Tensor, *rest: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    widths = [int(w) for w in ctx.require("widths")]
    n = len(widths)
    own, x2, gamma = _split_prologue(ctx, rest, 2 * n)
    weights, biases = own[:n], own[n:]
    if ctx.attrs.get("packed_weight"):  # the session packed the weights already (pack_matmul_groups)
        weight = weights[0]
    else:
        k = a.shape[-1]
        for w, width in zip(weights, widths):
            if w is None or w.dim() != 2 or w.shape[1] != width or w.shape[0] != k:
                raise ctx.fail(f"weights must be [K={k}, N] with N as in widths {widths}")

        def build() -> torch.Tensor:  # [sum N, K]: F.linear's layout, one contiguous copy
            return torch.cat([w.t() for w in weights]).contiguous()

        weight = DEQUANT_CACHE.get(tuple(weights), ("MatMulGroup", a.dtype), build).to(a.dtype)
    bias = _cached_bias(biases, widths, a)
    if (
        linear_row_serves(a)
        and _row_prologue_ok(ctx, a, weight.shape[1], x2, gamma)
        and weight.dtype == a.dtype
        and (bias is None or bias.dtype == a.dtype)
    ):
        return _dense_row(ctx, a, weight, bias, widths, x2, gamma)
    total = None
    if _prologue(ctx):
        a, total = apply_prologue(ctx, a, x2, gamma)
    return _with_sum(ctx, _linear_split(a, weight, bias, widths), total)


def _dense_row(ctx: NodeContext, a, weight, bias, widths: list[int], x2, gamma) -> tuple[torch.Tensor, ...]:
    """One row through gpu/linear_row.py's dense kernel, prologue fused, split into the members' outputs."""
    from onnxgen.runtime.gpu.linear_row import linear_row

    kwargs, total = _row_kwargs(ctx, a, x2, gamma)
    out = linear_row(a, weight, bias, **kwargs).reshape(*a.shape[:-1], -1)
    return _with_sum(ctx, tuple(torch.split(out, widths, dim=-1)), total)


@implements("MatMulNBitsGroup", domain=FUSED_DOMAIN)
def matmul_nbits_group(ctx: NodeContext, a: torch.Tensor, *rest: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    widths = [int(w) for w in ctx.require("widths")]
    n = len(widths)
    k, bits, block_size = int(ctx.require("K")), int(ctx.attr("bits", 4)), int(ctx.require("block_size"))
    if a.shape[-1] != k:
        raise ctx.fail(f"A has {a.shape[-1]} columns, K is {k}")
    own, x2, gamma = _split_prologue(ctx, rest, 4 * n)
    triples = [tuple(own[3 * i : 3 * i + 3]) for i in range(n)]
    biases = tuple(own[3 * n : 4 * n])
    if ctx.attrs.get("packed_weight"):  # the session joined the members (pack_nbits_groups): one of sum(widths)
        triples, biases, member_widths = triples[:1], biases[:1], [sum(widths)]
    else:
        member_widths = widths
    int8_a = any(_int8_activations(ctx, a, z, bits, block_size) for _, _, z in triples)
    b0, s0, z0 = triples[0]
    if not int8_a and q4_kernel_applies(a, b0, s0, z0, None, k=k, bits=bits, block_size=block_size):
        packed = (
            triples[0] + biases[:1] if len(triples) == 1 else _packed_group(ctx, triples, biases, widths, k, block_size)
        )
        if packed is not None:
            return _q4_group(ctx, a, packed, widths, k, bits, block_size, x2, gamma)
    dtype = compute_dtype(a.dtype, a.device)
    if not int8_a and dtype == a.dtype and linear_row_serves(a) and _row_prologue_ok(ctx, a, k, x2, gamma):
        # one row over the dequantized copy (option triton_q4 off): the dense kernel, prologue fused
        weight = _dequantized_group(triples, member_widths, k, bits, block_size, dtype, a.device)
        return _dense_row(ctx, a, weight, _cached_bias(biases, member_widths, a), widths, x2, gamma)
    total = None
    if _prologue(ctx):
        a, total = apply_prologue(ctx, a, x2, gamma)
    outs = _nbits_group_gemm(ctx, a, triples, biases, member_widths, k, bits, block_size, int8_a)
    if len(member_widths) != len(widths):
        outs = torch.split(outs[0], widths, dim=-1)
    return _with_sum(ctx, tuple(outs), total)


def _q4_group(ctx: NodeContext, a, packed, widths: list[int], k: int, bits: int, block_size: int, x2, gamma) -> tuple:
    """The group through gpu/linear_q4.py over its members' codes end to end: one row in one kernel,
    prologue fused; several rows after the prologue, in one GEMM."""
    b, s, z, bias = packed
    total = None
    if _row_prologue_ok(ctx, a, k, x2, gamma):
        kwargs, total = _row_kwargs(ctx, a, x2, gamma)
        out = q4_linear(a, b, s, z, bias, n=sum(widths), k=k, block_size=block_size, bits=bits, **kwargs)
    else:
        if _prologue(ctx):
            a, total = apply_prologue(ctx, a, x2, gamma)
        scratch = ctx.__dict__.get(SCRATCH_ATTR)
        out = q4_linear(a, b, s, z, bias, n=sum(widths), k=k, block_size=block_size, bits=bits, scratch=scratch)
    return _with_sum(ctx, tuple(torch.split(out, widths, dim=-1)), total)


def _dequantized_group(triples, widths, k: int, bits: int, block_size: int, dtype, device) -> torch.Tensor:
    """The members' weights dequantized, [sum N, K] (F.linear's layout), made once and cached."""

    def build() -> torch.Tensor:
        return torch.cat([
            dequantize_nbits(b, s, z, None, k=k, n=width, bits=bits, block_size=block_size, dtype=dtype)
            for (b, s, z), width in zip(triples, widths)
        ])  # fmt: skip

    sources = tuple(t for triple in triples for t in triple)
    return DEQUANT_CACHE.get(sources, ("MatMulNBitsGroup", k, bits, block_size, dtype, device), build)


def _nbits_group_gemm(ctx, a, triples, biases, widths, k: int, bits: int, block_size: int, int8_a: bool) -> tuple:
    dtype = compute_dtype(a.dtype, a.device)
    if int8_a:
        # as each MatMulNBits would (accuracy_level 4 emulation, see contrib_quant): A's rounding
        # depends on A and the block size only, so one rounding serves every member
        a = fake_quantize_int8_blocks(a, block_size)
    weight = _dequantized_group(triples, widths, k, bits, block_size, dtype, a.device)
    bias = _cached_bias(biases, widths, a.to(dtype))
    outs = _linear_split(a.to(dtype), weight, bias, widths)
    return tuple(o.to(a.dtype) for o in outs) if dtype != a.dtype else outs


@implements("MaskedAttention", domain=FUSED_DOMAIN)
def masked_attention(
    ctx: NodeContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax(Q K^T * scale, masked) V with K/V heads shared by ``groups`` query heads (fusion_attention)."""
    scale = float(ctx.attr("scale", 1.0))
    groups = int(ctx.attr("groups", 1))
    kind = ctx.attr("mask_kind", "none")
    kind = kind.decode() if isinstance(kind, bytes) else str(kind)
    fill = float(ctx.attr("fill", 0.0))
    if q.dim() != 4 or k.dim() != 4 or k.shape[1] * groups != q.shape[1] or v.shape[:3] != k.shape[:3]:
        raise ctx.fail(f"Q {list(q.shape)}, K {list(k.shape)}, V {list(v.shape)} do not fit {groups} group(s)")
    dtype = compute_dtype(q.dtype, q.device)
    qc, kc, vc = q.to(dtype), k.to(dtype), v.to(dtype)
    attn_mask = None
    if kind == "add" and mask is not None:
        attn_mask = mask.to(dtype)
    elif kind == "where" and mask is not None:
        if fill > -1e4:  # not a "minus infinity" fill: Where's exact semantics
            return _explicit_attention(qc, kc, vc, mask, scale, groups, fill).to(q.dtype)
        # masked scores at the fill value and scores + (most negative) agree after the softmax
        attn_mask = torch.zeros(mask.shape, dtype=dtype, device=q.device)
        attn_mask.masked_fill_(~mask.bool(), torch.finfo(dtype).min)
    out = sdpa(qc, kc, vc, attn_mask, scale=scale, enable_gqa=groups > 1)
    if kind == "where" and mask is not None and q.device.type == "cuda":
        out = _fully_masked_rows_as_where(out, vc, mask, groups)
    return out.to(q.dtype)


def _fully_masked_rows_as_where(out: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, groups: int) -> torch.Tensor:
    """A row whose every key is masked: Where puts the one fill value everywhere, so the softmax is
    uniform and the row is the mean of V. CUDA's fused SDPA kernels scale the most negative score
    past -inf and return 0 there instead (seen on the H200); three small kernels put the mean back."""
    blind = ~mask.bool().any(dim=-1, keepdim=True)  # [..., Sq, 1], broadcast like the mask
    mean = v.mean(dim=-2, keepdim=True)
    if groups > 1:
        mean = mean.repeat_interleave(groups, dim=1)
    return torch.where(blind, mean.to(out.dtype), out)


def _explicit_attention(q, k, v, mask, scale: float, groups: int, fill: float) -> torch.Tensor:
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.where(mask.bool(), scores, torch.tensor(fill, dtype=scores.dtype, device=scores.device))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


@implements("RowSumCast", domain=FUSED_DOMAIN)
def row_sum_cast(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    """Cast(ReduceSum(x, axes=[1], keepdims) + offset, to): a [rows, width] integer tensor's row sums
    (the attention mask's valid lengths), in the integer type of x as the unfused ops compute them."""
    offset, keepdims = int(ctx.attr("offset", 0)), bool(ctx.attr("keepdims", 1))
    dtype = torch_dtype(int(ctx.require("to")))
    if x.dim() != 2:
        raise ctx.fail(f"RowSumCast takes a [rows, width] tensor, got shape {list(x.shape)}")
    if triton_serves(x) and x.dtype in (torch.int32, torch.int64) and x.stride(1) == 1:
        from onnxgen.runtime.gpu.prelude import row_sum_cast as kernel_fn

        out = kernel_fn(x, offset, dtype)
    else:
        out = (x.sum(dim=1, dtype=x.dtype) + offset).to(dtype)
    return out.reshape(-1, 1) if keepdims else out


@implements("SiluMul", domain=FUSED_DOMAIN)
def silu_mul(ctx: NodeContext, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    if g.shape == u.shape and g.dtype == u.dtype and g.is_floating_point() and triton_serves(g):
        from onnxgen.runtime.gpu.silu_mul import silu_mul as fused

        return fused(g, u)
    return F.silu(g) * u


@implements("SigmoidGate", domain=FUSED_DOMAIN)
def sigmoid_gate(ctx: NodeContext, y: torch.Tensor, g: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
    """y * sigmoid(g) (+ x), broadcasting as the Sigmoid -> Mul (-> Add) it replaces (fusion_gates.py),
    in fp32, rounded once to y's dtype."""
    if not y.is_floating_point():
        raise ctx.fail(f"SigmoidGate takes float tensors, got {y.dtype}")
    if triton_serves(y):
        from onnxgen.runtime.gpu.sigmoid_gate import sigmoid_gate as kernel
        from onnxgen.runtime.gpu.sigmoid_gate import sigmoid_gate_applies

        if sigmoid_gate_applies(y, g, x):
            return kernel(y, g, x)
    out = y.float() * torch.sigmoid(g.float())
    if x is not None:
        out = out + x.float()
    return out.to(y.dtype)


@implements("L2Normalize", domain=FUSED_DOMAIN)
def l2_normalize(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    """The chain ReduceSumSquare(last axis) -> Add eps -> Sqrt -> Div that fusion_hybrid.py replaces."""
    eps = float(ctx.attr("epsilon", 0.0))
    if not x.is_floating_point() or x.dim() == 0:
        raise ctx.fail(f"L2Normalize takes a float tensor of rank >= 1, got {x.dtype} of shape {list(x.shape)}")
    if triton_serves(x):
        from onnxgen.runtime.gpu.l2_norm import l2_norm_applies
        from onnxgen.runtime.gpu.l2_norm import l2_normalize as kernel

        if l2_norm_applies(x):
            return kernel(x, eps)
    xf = x if x.dtype == torch.float64 else x.float()
    return (xf / torch.sqrt(xf.square().sum(dim=-1, keepdim=True) + eps)).to(x.dtype)


def join_nbits_members(triples, biases, widths: list[int], n_blocks: int):
    """MatMulNBits members' codes [sum N, row bytes], scales [sum N, n_blocks], zero points and biases
    end to end along N (a member of one keeps its tensors, as views); None when the members' zero
    points are of different kinds or dtypes, or their scales of different dtypes."""
    if len({None if z is None else z.dtype for _, _, z in triples}) != 1 or len({s.dtype for _, s, _ in triples}) != 1:
        return None

    def join(parts: list[torch.Tensor]) -> torch.Tensor:
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    b = join([bb.reshape(w, -1) for (bb, _, _), w in zip(triples, widths)])
    s = join([ss.reshape(w, n_blocks) for (_, ss, _), w in zip(triples, widths)])
    z = None if triples[0][2] is None else join([zz.reshape(w, -1) for (_, _, zz), w in zip(triples, widths)])
    bias = _group_bias(biases, widths, s) if any(x is not None for x in biases) else None
    return b, s, z, bias


def _packed_group(ctx: NodeContext, triples: list, biases: tuple, widths: list[int], k: int, block_size: int):
    """join_nbits_members for a group the session did not join, made once per node."""
    sources = [t for triple in triples for t in triple] + list(biases)
    cached = ctx.__dict__.get("_packed_group")
    if cached is not None and all(r() is t for r, t in zip(cached[0], sources) if r is not None):
        return cached[1]
    joined = join_nbits_members(triples, biases, widths, -(-k // block_size))
    if joined is None:
        return None
    refs = [weakref.ref(t) if t is not None else None for t in sources]
    ctx.__dict__["_packed_group"] = (refs, joined)
    return joined


@implements("RowSelect", domain=FUSED_DOMAIN)
def row_select(ctx: NodeContext, x: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """One row of axis 1 of x per batch entry, kept as an axis of length 1 (runtime/row_select.py
    writes it): row ``row[0]`` of every entry when ``row`` has one element, else row ``row[b]`` of
    entry b (``row`` has one element per entry: a batch of prompts of different lengths, each
    wanting the logits of its own last row). x itself when that axis already has one row: a
    one-token decode step runs no kernel for it. The rows are read on the device (capture-safe),
    so they must lie in [0, x.shape[1])."""
    if x.dim() < 2:
        raise ctx.fail(f"RowSelect takes a tensor with a row axis (axis 1), got shape {list(x.shape)}")
    if row.dim() != 1 or row.numel() not in (1, x.shape[0]) or row.dtype not in (torch.int64, torch.int32):
        raise ctx.fail(
            f"RowSelect's rows must be int64 or int32 of shape [1] or [{x.shape[0]}] (one per batch entry), "
            f"got {row.dtype} of shape {list(row.shape)}"
        )
    if x.shape[1] == 1:
        return x
    if row.numel() == 1:
        return x.index_select(1, row)
    index = row.to(torch.int64).view(-1, 1, *([1] * (x.dim() - 2))).expand(x.shape[0], 1, *x.shape[2:])
    return x.gather(1, index)
