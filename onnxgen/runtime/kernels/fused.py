"""Kernels of the ops the CUDA fusion pass writes (onnxgen/runtime/fusion.py; domain ``onnxgen``).

- ``MatMulGroup(A, W_1..W_n, bias_1..bias_n)``, attribute ``widths``: one GEMM of A with the
  weights concatenated along N (made once per weight set and cached), bias in the GEMM's
  epilogue, split into the n outputs (views).
- ``MatMulNBitsGroup(A, (B, scales, zero_points)_1..n, bias_1..n)``: each MatMulNBits weight
  dequantized as MatMulNBits would, concatenated, then the same GEMM.
- ``SiluMul(g, u)``: silu(g) * u.
The concatenated weights cost memory next to the originals (which the graph still holds); the
MatMulNBits dequantized copy counts against ONNXGEN_DEQUANT_CACHE_MB like MatMulNBits' own.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from onnxgen.runtime.kernels.common import NodeContext, sdpa
from onnxgen.runtime.kernels.contrib_attention import compute_dtype
from onnxgen.runtime.kernels.contrib_quant import (
    DEQUANT_CACHE,
    _int8_activations,
    dequantize_nbits,
    fake_quantize_int8_blocks,
)
from onnxgen.runtime.kernels.registry import kernel
from onnxgen.runtime.kernels.triton_support import int4_gemv_serves, triton_serves

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


@kernel("MatMulGroup", domain=FUSED_DOMAIN)
def matmul_group(ctx: NodeContext, a: torch.Tensor, *rest: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    widths = [int(w) for w in ctx.require("widths")]
    n = len(widths)
    weights, biases = tuple(rest[:n]), tuple(rest[n : 2 * n]) + (None,) * (2 * n - len(rest))
    if ctx.attrs.get("packed_weight"):  # the session packed the weights already (pack_matmul_groups)
        return _linear_split(a, weights[0], _cached_bias(biases, widths, a), widths)
    for w, width in zip(weights, widths):
        if w is None or w.dim() != 2 or w.shape[1] != width or w.shape[0] != a.shape[-1]:
            raise ctx.fail(f"weights must be [K={a.shape[-1]}, N] with N as in widths {widths}")

    def build() -> torch.Tensor:  # [sum N, K]: F.linear's layout, one contiguous copy
        return torch.cat([w.t() for w in weights]).contiguous()

    weight = DEQUANT_CACHE.get(tuple(weights), ("MatMulGroup", a.dtype), build)
    bias = _cached_bias(biases, widths, a)
    return _linear_split(a, weight.to(a.dtype), bias, widths)


@kernel("MatMulNBitsGroup", domain=FUSED_DOMAIN)
def matmul_nbits_group(ctx: NodeContext, a: torch.Tensor, *rest: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    widths = [int(w) for w in ctx.require("widths")]
    n = len(widths)
    k, bits, block_size = int(ctx.require("K")), int(ctx.attr("bits", 4)), int(ctx.require("block_size"))
    if a.shape[-1] != k:
        raise ctx.fail(f"A has {a.shape[-1]} columns, K is {k}")
    triples = [tuple(rest[3 * i : 3 * i + 3]) for i in range(n)]
    biases = tuple(rest[3 * n : 4 * n]) + (None,) * (4 * n - len(rest))
    dtype = compute_dtype(a.dtype, a.device)
    if any(_int8_activations(ctx, a, z, bits, block_size) for _, _, z in triples):
        # as each MatMulNBits would (accuracy_level 4 emulation, see contrib_quant): A's rounding
        # depends on A and the block size only, so one rounding serves every member
        a = fake_quantize_int8_blocks(a, block_size)
    elif int4_gemv_serves(a, k, bits):
        packed = _packed_group(ctx, triples, biases, widths, k, block_size)
        if packed is not None:
            from onnxgen.runtime.kernels.triton_gemv import gemv_int4

            b, s, z, bias = packed
            out = gemv_int4(a.reshape(k), b, s, z, bias, n=sum(widths), k=k, block_size=block_size)
            return tuple(torch.split(out.reshape(*a.shape[:-1], -1), widths, dim=-1))

    def build() -> torch.Tensor:
        return torch.cat([
            dequantize_nbits(b, s, z, None, k=k, n=width, bits=bits, block_size=block_size, dtype=dtype)
            for (b, s, z), width in zip(triples, widths)
        ])  # fmt: skip

    sources = tuple(t for triple in triples for t in triple)
    weight = DEQUANT_CACHE.get(sources, ("MatMulNBitsGroup", k, bits, block_size, dtype, a.device), build)
    bias = _cached_bias(biases, widths, a.to(dtype))
    outs = _linear_split(a.to(dtype), weight, bias, widths)
    return tuple(o.to(a.dtype) for o in outs) if dtype != a.dtype else outs


@kernel("MaskedAttention", domain=FUSED_DOMAIN)
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
    return out.to(q.dtype)


def _explicit_attention(q, k, v, mask, scale: float, groups: int, fill: float) -> torch.Tensor:
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.where(mask.bool(), scores, torch.tensor(fill, dtype=scores.dtype, device=scores.device))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


@kernel("SiluMul", domain=FUSED_DOMAIN)
def silu_mul(ctx: NodeContext, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    if g.shape == u.shape and g.dtype == u.dtype and g.is_floating_point() and triton_serves(g):
        from onnxgen.runtime.kernels.triton_silu import silu_mul as fused

        return fused(g, u)
    return F.silu(g) * u


def _packed_group(ctx: NodeContext, triples: list, biases: tuple, widths: list[int], k: int, block_size: int):
    """The members' packed weights, scales, zero points and biases end to end along N (made once per
    node; None when the members' zero points are of different kinds)."""
    sources = [t for triple in triples for t in triple] + list(biases)
    cached = ctx.__dict__.get("_packed_group")
    if cached is not None and all(r() is t for r, t in zip(cached[0], sources) if r is not None):
        return cached[1]
    kinds = {None if z is None else z.dtype == torch.uint8 for _, _, z in triples}
    if len(kinds) != 1:
        return None
    n_blocks = -(-k // block_size)
    b = torch.cat([bb.reshape(w, -1) for (bb, _, _), w in zip(triples, widths)])
    s = torch.cat([ss.reshape(w, n_blocks) for (_, ss, _), w in zip(triples, widths)])
    z = None if kinds == {None} else torch.cat([zz.reshape(w, -1) for (_, _, zz), w in zip(triples, widths)])
    bias = _group_bias(biases, widths, s) if any(x is not None for x in biases) else None
    refs = [weakref.ref(t) if t is not None else None for t in sources]
    ctx.__dict__["_packed_group"] = (refs, (b, s, z, bias))
    return b, s, z, bias
