"""Block-quantized weights: com.microsoft MatMulNBits and GatherBlockQuantized.

Codes are packed low bits first (for 4 bits: element 2i in the low nibble of byte i), blocks run
along K, and a weight is (code - zero_point) * scale with the default zero point 2^(bits - 1).

On a Triton device (option ``triton_q4``, on by default) 4- and 8-bit weights in power-of-two blocks
are multiplied as packed codes by gpu/linear_q4.py (one row: the GEMV kernels; a prompt: a tiled GEMM,
or each weight dequantized into a buffer that lives for the call), and nothing below is cached;
a form those kernels cannot take (quant_forms.py says which) is said once. Otherwise MatMulNBits
dequantizes its weight to [N, K] and runs one GEMM. Caching (a conscious choice):
the dequantized weight is kept per (B, scales, zero_points, g_idx) tensor identity, so a weight
that is an initializer is dequantized once and each later call is a single GEMM (few kernels per
decode step, which is what decode speed on the GPU hinges on). The price is memory: a 4-bit
weight held as fp16 takes 4x its packed size (fp32: 8x). ONNXGEN_DEQUANT_CACHE_MB (option
``dequant_cache_mb``) caps the cache (0 turns it off; unset: no cap); past the cap, weights are
dequantized on every call. An entry dies with its packed tensor, and a changed tensor (in-place
write) is not served from the cache.

accuracy_level 4 lets an implementation quantize A to int8 in blocks of block_size along K, and
onnxruntime's CPU kernel does (symmetric, scale max|a|/127, a times 1/scale rounded half to even)
whenever the zero points are absent or uint8 and its MLAS has an int8 kernel for (bits,
block_size); on x86-64 that is every case but bits=2 with block_size 16. That moves outputs by
about 0.5% against the unquantized product. By default we do not follow it: the GEMM runs on A as
it is (in the activation dtype; fp32 on the CPU for half types, as onnxruntime's CPU kernel does).
ONNXGEN_INT8_ACTIVATIONS=cpu (or all; option ``int8_activations``) rounds A the same way ("fake"
quantization; the GEMM stays floating point, exact for these integer products up to fp32 rounding).
A single op then matches onnxruntime to ~1e-7, but not a whole model: one-ulp differences upstream
(a norm's reduction order) flip a rounded code now and then, the flip spreads through the layers,
and on an 8-layer int4 model built by onnxruntime-genai the logits differed more (median 2.2e-3)
than without the rounding (1.8e-3). So it is off by default and useful for single-op checks.

On the CPU at accuracy_level >= 3, 4-bit weights skip all of the above and go through torch's
int4 weight-only GEMM with bf16 activations (see "CPU fast path" below): the level permits bf16
compute, and decode reads the packed weight instead of an 8x larger fp32 copy. 8-bit weights go
the same way as two 4-bit planes, their codes' high and low nibbles (int4pack_planes). A CPU session puts
that layout in place of the node's codes, scales and zero points at load (prepack_int4), so the
weight is held once. At levels 0-2 the exact path stays (fp32 one-row products split across
cores, see cpu_gemv) over a cached fp32 copy.

GatherBlockQuantized dequantizes only the gathered rows (no cache needed).
"""

from __future__ import annotations

import math
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from onnxgen import options
from onnxgen.runtime.gpu.launch import q4_kernels_serve, triton_serves
from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops import int4pack_rows
from onnxgen.runtime.ops.common import normalize_axis
from onnxgen.runtime.ops.contrib_attention import compute_dtype
from onnxgen.runtime.ops.cpu_gemv import split_gemv
from onnxgen.runtime.ops.indexing import checked_indices
from onnxgen.runtime.ops.quant_forms import int4pack_enabled, int4pack_form_unserved, q4_form_unserved, zero_kind
from onnxgen.runtime.ops.registry import MS_DOMAIN, implements

_CHUNK_ELEMENTS = 1 << 24  # fp32 elements per dequantization chunk (64 MiB)
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [..., n] -> uint8 [..., n * 8 / bits], low-order bits first."""
    if bits == 8:
        return packed
    if bits not in (2, 4):
        raise ValueError(f"bits={bits} is not supported (2, 4 or 8)")
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.flatten(-2)


def dequantize_nbits(
    b: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    *,
    k: int,
    n: int,
    bits: int,
    block_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """MatMulNBits' B as a dense [N, K] weight of `dtype` (computed in fp32, rounded once).

    Works through rows in chunks so that the fp32 temporaries stay small next to the result
    (an embedding-sized lm_head would otherwise need several full-size fp32 copies at once).
    """
    n_blocks = -(-k // block_size)
    packed = b.reshape(n, -1)
    scale = scales.reshape(n, n_blocks)
    if zero_points is None:
        zero: torch.Tensor | None = None
    elif zero_points.dtype == torch.uint8:  # packed like B, each row padded to whole bytes
        zero = zero_points.reshape(n, -1)
    else:  # unpacked: the scales' type, or int8 codes a byte per block (widen_zero_points)
        zero = zero_points.reshape(n, n_blocks)
    group = g_idx.to(torch.long).reshape(-1)[:k] if g_idx is not None else None
    out = torch.empty((n, k), dtype=dtype, device=b.device)
    rows = max(1, _CHUNK_ELEMENTS // (n_blocks * block_size))
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        codes = unpack_codes(packed[lo:hi], bits)[:, : n_blocks * block_size].float()
        if zero is None:
            zeros = torch.full((hi - lo, n_blocks), float(1 << (bits - 1)), device=b.device)
        elif zero.dtype == torch.uint8:
            zeros = unpack_codes(zero[lo:hi], bits)[:, :n_blocks].float()
        else:
            zeros = zero[lo:hi].float()
        scale_rows = scale[lo:hi].float()
        if group is not None:  # act-order: each k names its block
            weight = (codes[:, :k] - zeros[:, group]) * scale_rows[:, group]
        else:
            blocks = codes.view(hi - lo, n_blocks, block_size)
            weight = ((blocks - zeros.unsqueeze(-1)) * scale_rows.unsqueeze(-1)).reshape(hi - lo, -1)[:, :k]
        out[lo:hi] = weight
    return out


def _version_of(tensor: torch.Tensor | None) -> int:
    """The in-place write counter (inference-mode tensors have none: they count as never written)."""
    if tensor is None:
        return -1
    try:
        return tensor._version
    except RuntimeError:
        return 0


@dataclass
class _Entry:
    refs: tuple[Any, ...]  # weak references to the packed tensors (None for an absent input)
    versions: tuple[int, ...]
    weight: torch.Tensor


class DequantCache:
    """Dequantized weights, keyed by the identity and version of the tensors they came from. The cap
    is ``budget_bytes`` (None: no cap), or with ``from_options`` the options' cap in force when a
    weight would be stored (a hit never reads it)."""

    def __init__(self, budget_bytes: int | None = None, *, from_options: bool = False):
        self._budget = budget_bytes
        self._from_options = from_options
        self.used = 0
        self._entries: dict[tuple, _Entry] = {}

    @property
    def budget(self) -> int | None:
        return options.current().dequant_cache_bytes if self._from_options else self._budget

    def get(self, sources: tuple[torch.Tensor | None, ...], extra: tuple, build) -> torch.Tensor:
        key = tuple(id(t) for t in sources) + extra
        entry = self._entries.get(key)
        versions = tuple(_version_of(t) for t in sources)
        if entry is not None:
            alive = all((r() if r is not None else None) is t for r, t in zip(entry.refs, sources))
            if alive and entry.versions == versions:
                return entry.weight
            self._drop(key)
        weight = build()
        size = weight.numel() * weight.element_size()
        budget = self.budget
        if budget is not None and self.used + size > budget:
            return weight  # over the cap: use once, keep nothing
        refs = tuple(weakref.ref(t, lambda _r, key=key: self._drop(key)) if t is not None else None for t in sources)
        self._entries[key] = _Entry(refs, versions, weight)
        self.used += size
        return weight

    def _drop(self, key: tuple) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.used -= entry.weight.numel() * entry.weight.element_size()

    def clear(self) -> None:
        self._entries.clear()
        self.used = 0


DEQUANT_CACHE = DequantCache(from_options=True)


def _int8_activations(
    ctx: NodeContext, a: torch.Tensor, zero_points: torch.Tensor | None, bits: int, block: int
) -> bool:
    """Whether onnxruntime's CPU kernel would quantize A to int8 here (see the module docstring)."""
    if int(ctx.attr("accuracy_level", 0)) != 4:
        return False
    mode = options.current().int8_activations
    if mode == "none" or (mode != "all" and a.device.type != "cpu"):
        return False
    float_zero_points = zero_points is not None and zero_points.is_floating_point()
    return not float_zero_points and not (bits == 2 and block < 32)


def q4_kernel_applies(
    a: torch.Tensor,
    b: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    *,
    k: int,
    bits: int,
    block_size: int,
) -> bool:
    """gpu/linear_q4.py's kernels take this MatMulNBits on the packed codes: a form that
    quant_forms.q4_form_unserved accepts, B as whole blocks per row, scales (and float zero
    points) in A's dtype, on a Triton device with option ``triton_q4`` on. A form they cannot take
    on such a device is said once (``_say_fallback``) and runs over a dequantized copy."""
    if not q4_kernels_serve(a):
        return False
    why = q4_form_unserved(
        bits=bits, block_size=block_size, has_g_idx=g_idx is not None, codes_uint8=b.dtype == torch.uint8,
        scales_float=scales.is_floating_point(),
        zero=zero_kind(zero_points is not None, zero_points is not None and zero_points.dtype in INTEGER_ZEROS,
                       zero_points is not None and zero_points.dtype == scales.dtype),
    )  # fmt: skip
    if why is None and scales.dtype != a.dtype:
        why = f"scales of dtype {scales.dtype} beside activations of {a.dtype}"
    n_blocks = -(-k // block_size) if block_size > 0 else 0
    if why is None and not (b.numel() == scales.numel() * (block_size * bits // 8) and scales.numel() % n_blocks == 0):
        why = "B or scales do not hold whole blocks per row"
    if why is not None:
        _say_fallback(why)
        return False
    return True


_SAID: set[str] = set()


def _say_fallback(why: str) -> None:
    """Once per reason and process: a MatMulNBits form the packed kernels cannot take keeps a
    dequantized copy (the memory the packed path exists to save)."""
    if why not in _SAID:
        _SAID.add(why)
        warnings.warn(
            f"MatMulNBits with {why}: no packed kernel; it runs over a dequantized copy of its weight "
            "(`onnxgen show PKG --device cuda` lists each form's path)",
            RuntimeWarning,
            stacklevel=4,
        )


def q4_linear(
    a, b, scales, zero_points, bias, *, n: int, k: int, block_size: int, bits: int = 4, scratch: Any = None,
    **prologue,
) -> torch.Tensor:  # fmt: skip
    """A @ W^T (+ bias) through gpu/linear_q4.py: the one-row kernel (``prologue`` fused) for one
    row, the prompt GEMM (no prologue; ``scratch``: the session's DequantScratch) for several;
    [..., N] in A's dtype."""
    from onnxgen.runtime.gpu.linear_q4 import linear_row_q4, matmul_q4

    if a.numel() == k:
        out = linear_row_q4(a, b, scales, zero_points, bias, n=n, k=k, block_size=block_size, bits=bits, **prologue)
        return out.reshape(*a.shape[:-1], n)
    if prologue:
        raise ValueError("a prologue is fused for one row only")
    return matmul_q4(a, b, scales, zero_points, bias, n=n, k=k, block_size=block_size, scratch=scratch, bits=bits)


# the nodes that multiply MatMulNBits weights through q4_linear: the op, and fusion's groups of it
_NBITS_OPS = (("MatMulNBits", MS_DOMAIN), ("MatMulNBitsGroup", "onnxgen"))


def _weight_rows(ctx: NodeContext) -> int:
    """N of a MatMulNBits, or of all a MatMulNBitsGroup's members together (their widths)."""
    widths = ctx.attrs.get("widths")
    return sum(int(w) for w in widths) if widths else int(ctx.attrs.get("N", 0))


SCRATCH_ATTR = "_q4_scratch"  # NodeContext.__dict__ key of the session's DequantScratch


def attach_q4_scratch(program: Any) -> int:
    """On CUDA, where prompts may dequantize 4- or 8-bit weights (option ``q4_prompt`` not ``gemm``,
    the packed kernels on): one DequantScratch for the whole session, sized for its largest packed
    weights (linear_q4.scratch_elements), allocated now, outside any capture, and handed to every
    MatMulNBits and MatMulNBitsGroup node. Under option ``q4_dequant_ahead`` its halves take turns
    (gpu/dequant_ahead.py), so the program joins it at the end of every unit of work. Returns its
    size in elements (0: none)."""
    opts = options.current()
    device = getattr(program, "device", None)
    if device is None or device.type != "cuda" or not opts.triton_q4 or opts.q4_prompt == "gemm":
        return 0
    from onnxgen.runtime.gpu.linear_q4 import DequantScratch, scratch_elements

    nodes, sizes, dtype = [], [], None
    for node in program.nodes:
        ctx = node.ctx
        if (ctx.op_type, ctx.domain) not in _NBITS_OPS:
            continue
        if int(ctx.attrs.get("bits", 4)) not in (4, 8):
            continue
        n = _weight_rows(ctx)
        scales = program.initializers.get(node.inputs[2]) if len(node.inputs) > 2 else None
        if not isinstance(scales, torch.Tensor) or not scales.is_floating_point():
            continue
        nodes.append(ctx)
        sizes.append(n * int(ctx.attrs.get("K", 0)))
        dtype = dtype or scales.dtype
    elements = scratch_elements(sizes)
    if not nodes or not elements:
        return 0
    scratch = DequantScratch(elements, dtype, device)
    for ctx in nodes:
        ctx.__dict__[SCRATCH_ATTR] = scratch
    program.unit_joins.append(scratch.join)  # no prefetch outlives a run, an eager unit or a recording
    return scratch.buffer.numel()


def fake_quantize_int8_blocks(a: torch.Tensor, block_size: int) -> torch.Tensor:
    """A rounded to symmetric int8 per block of `block_size` along the last axis, back in fp32."""
    k = a.shape[-1]
    af = F.pad(a.float(), (0, -k % block_size))
    blocks = af.reshape(*af.shape[:-1], -1, block_size)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    # multiply by the reciprocal, not divide: the two round differently now and then, and one
    # code off by one moves an output by ~0.4%; torch.round is round half to even, like MLAS
    inverse = torch.where(scale == 0, 0.0, 1.0 / scale)
    codes = torch.round(blocks * inverse)
    return (codes * scale).reshape(af.shape)[..., :k]


# -- CPU fast path: torch's int4 weight-only GEMM ---------------------------------------------------
# Decode on the CPU is memory-bound: the fp32 dequantized weight reads 8x the bytes of the packed
# one. aten::_weight_int4pack_mm_for_cpu reads 4-bit codes and dequantizes on the fly, as
# w = (q - 8) * scale + zero; with zero = (8 - zero_point) * scale that is MatMulNBits'
# (q - zero_point) * scale. Its fast kernel needs bf16 activations, scales and zeros (fp32 ones take
# a reference loop, ~20x slower), so it is used only where the node permits that precision:
# accuracy_level >= 3 (3 = bf16, 4 = int8 compute; onnxruntime itself rounds activations to int8
# per block at level 4). At levels 0-2 the exact fp32 path below stays. Its cost grows with the
# rows about as fast as the rows, so a prompt chunk's product (int4pack_rows.MIN_ROWS rows or more)
# dequantizes the packed weight for that call into a shared scratch buffer and runs one fp32 GEMM
# (int4pack_rows.py); no fp32 copy is kept either way.
# ONNXGEN_CPU_INT4_GEMM=0 (option cpu_int4_gemm) turns it off.
_INT4PACK_OP = getattr(getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None), "default", None)
# the same kernel through torch's own binding where it has one: a decode step calls it once per
# quantized linear layer, and the binding's call costs less than the op overload's dispatch
_INT4PACK_CALL = getattr(torch, "_weight_int4pack_mm_for_cpu", _INT4PACK_OP)


def _int4pack_applies(
    ctx: NodeContext,
    a: torch.Tensor,
    b: torch.Tensor,
    g_idx: torch.Tensor | None,
    *,
    k: int,
    n: int,
    bits: int,
    block_size: int,
) -> bool:
    if _INT4PACK_OP is None or a.device.type != "cpu" or not int4pack_enabled(options.current()):
        return False
    why = int4pack_form_unserved(
        accuracy_level=int(ctx.attr("accuracy_level", 0)), bits=bits, has_g_idx=g_idx is not None,
        block_size=block_size, k=k, n=n,
    )  # fmt: skip
    return why is None and b.dtype == torch.uint8 and a.is_floating_point()


# output rows packed at a time: a multiple of the packing's row tiles (64 with AVX-512), small enough
# that an embedding-sized lm_head's temporaries stay a fraction of its packed size (with 4,096 rows
# packing a 49,152-row lm_head raised the load's peak resident memory by four times its result)
_PACK_ROWS = 1024


def int4pack_planes(bits: int) -> int:
    """The 4-bit planes the CPU int4 GEMM multiplies for one weight of ``bits``-bit codes: 4-bit codes
    are one plane; 8-bit codes are two, their high nibbles and their low ones, stacked as a weight
    of twice the rows (so one kernel call serves both, and the packed planes hold a byte per
    weight, as B does)."""
    return 2 if bits == 8 else 1


def _int4pack_weight(b: torch.Tensor, *, k: int, n: int, bits: int = 4) -> torch.Tensor:
    """B in the kernel's packed layout ([planes * N, K / 2] uint8; int4pack_planes). The packing
    takes int32 codes, 8x the packed size; done in slices of rows of the stacked planes (the layout
    packs rows independently: checked in tests/test_cpu_resources.py) so an embedding-sized lm_head
    never has all its codes at once."""
    rows = b.reshape(n, -1)
    planes = int4pack_planes(bits)
    out = torch.empty((planes * n, k // 2), dtype=torch.uint8)
    for lo in range(0, planes * n, _PACK_ROWS):
        hi = min(planes * n, lo + _PACK_ROWS)
        out[lo:hi] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(_plane_codes(rows, lo, hi, n, k, bits), 1)
    return out


def _plane_codes(rows: torch.Tensor, lo: int, hi: int, n: int, k: int, bits: int) -> torch.Tensor:
    """int32 4-bit codes of the stacked planes' rows [lo, hi): for 8-bit codes, row r < N is row r's
    high nibbles and row N + r its low ones."""
    if bits == 4:
        return unpack_codes(rows[lo:hi], 4)[:, :k].to(torch.int32).contiguous()
    parts = []
    for plane, shift in ((0, 4), (1, 0)):  # high nibbles first
        first, last = max(lo, plane * n), min(hi, (plane + 1) * n)
        if first < last:
            codes = rows[first - plane * n : last - plane * n, :k]
            parts.append(((codes >> shift) & 15).to(torch.int32))
    return torch.cat(parts).contiguous()


def _int4pack_scales_zeros(
    scales: torch.Tensor, zero_points: torch.Tensor | None, *, k: int, n: int, block_size: int, bits: int = 4
) -> torch.Tensor:
    """[K / block, planes * N, 2] bf16, the kernel's (scale, zero) with w = (q - 8) * scale + zero,
    computed in fp32, rounded once; _PACK_ROWS rows at a time, so the fp32 temporaries stay small
    beside the result. 4-bit: (s, (8 - zero_point) * s). 8-bit code 16h + l as two planes:
    (16 s, (136 - zero_point) * s) for the high nibbles h and (s, 0) for the low ones l, whose sum
    is (16h + l - zero_point) * s (16 s is exact in bf16)."""
    n_blocks = k // block_size
    scales = scales.reshape(n, -1)
    zero_rows = zero_points.reshape(n, -1) if zero_points is not None else None
    planes = int4pack_planes(bits)
    out = torch.empty((n_blocks, planes * n, 2), dtype=torch.bfloat16)
    default = float(1 << (bits - 1))
    for lo in range(0, n, _PACK_ROWS):
        hi = min(n, lo + _PACK_ROWS)
        scale = scales[lo:hi, :n_blocks].float()
        if zero_rows is None:
            zp = torch.full_like(scale, default)
        elif zero_rows.dtype == torch.uint8:
            zp = unpack_codes(zero_rows[lo:hi], bits)[:, :n_blocks].float()
        else:
            zp = zero_rows[lo:hi, :n_blocks].float()
        if planes == 1:
            out[:, lo:hi] = torch.stack((scale, (8.0 - zp) * scale), dim=-1).transpose(0, 1)
        else:
            out[:, lo:hi] = torch.stack((scale * 16.0, (136.0 - zp) * scale), dim=-1).transpose(0, 1)
            out[:, n + lo : n + hi] = torch.stack((scale, torch.zeros_like(scale)), dim=-1).transpose(0, 1)
    return out


def _weak(t: torch.Tensor | None) -> Any:
    return weakref.ref(t) if t is not None else None


class _Int4Plan:
    """One node's packed weight, kept on its NodeContext (decode calls skip all re-validation).

    It serves a call only while B, scales and zero_points are the very tensors it was built from,
    unwritten since (weak references: the plan never keeps a weight alive). Memory: the packed
    copy is as large as B itself, plus bf16 scales/zeros.
    """

    __slots__ = ("refs", "versions", "packed", "sz", "k", "n", "block_size", "planes")

    def __init__(
        self, b: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None, *, k, n, block_size,
        bits: int = 4, packed: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):  # fmt: skip
        self.refs = (weakref.ref(b), weakref.ref(scales), _weak(zero_points))
        self.versions = (_version_of(b), _version_of(scales), _version_of(zero_points))
        if packed is not None:  # made at load (prepack_int4): b and scales are these very tensors
            self.packed, self.sz = packed
        else:
            self.packed = _int4pack_weight(b, k=k, n=n, bits=bits)
            self.sz = _int4pack_scales_zeros(scales, zero_points, k=k, n=n, block_size=block_size, bits=bits)
        self.k, self.n, self.block_size, self.planes = k, n, block_size, int4pack_planes(bits)

    def serves(self, b: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None) -> bool:
        rb, rs, rz = self.refs
        if rb() is not b or rs() is not scales or (rz() if rz is not None else None) is not zero_points:
            return False
        try:  # (inline: this runs for every quantized matmul of every decode step)
            versions = (b._version, scales._version, zero_points._version if zero_points is not None else -1)
        except RuntimeError:  # an inference tensor has no version counter
            versions = (_version_of(b), _version_of(scales), _version_of(zero_points))
        return self.versions == versions

    def run(self, a: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """A @ W^T (+ bias) through the int4 kernel, in A's dtype; many rows (a prompt chunk) as the
        weight dequantized for the call and one fp32 GEMM (int4pack_rows.py). Two planes (8-bit
        codes) give two halves of the output, which are summed in fp32."""
        rows = a.numel() // self.k
        n = self.n
        if int4pack_rows.serves(self.planes * n, rows):
            x = a.reshape(rows, self.k).to(torch.float32)
            out = int4pack_rows.matmul(
                x, self.packed, self.sz, k=self.k, n=n, block_size=self.block_size, planes=self.planes
            )
        else:  # the decode step: .bfloat16() / .float() are the cheapest casts to call per layer
            x = a.reshape(-1, self.k)
            x = (x if x.is_contiguous() else x.contiguous()).bfloat16()
            out = _INT4PACK_CALL(x, self.packed, self.block_size, self.sz).float()
            if self.planes == 2:
                out = out[:, :n] + out[:, n:]
        if bias is not None:
            out += bias
        out = out.view(*a.shape[:-1], n)
        return out if a.dtype == torch.float32 else out.to(a.dtype)


# integer zero points: uint8 packed as MatMulNBits stores them, or int8 a byte per block (widen_zero_points)
INTEGER_ZEROS = (torch.uint8, torch.int8)


def widen_zero_points(program: Any) -> int:
    """Where the packed Triton kernels serve the session's device: every 4-bit MatMulNBits (and
    joined MatMulNBitsGroup) whose zero points are a packed uint8 initializer read by such nodes
    alone gets them at load as int8 [N, n_blocks], a byte per block, in place of the packed tensor
    (gpu/linear_q4.py's ZERO_KIND 3, whose load lets the prompt GEMMs keep their weight tile in
    registers); with option ``moe_zero_bytes`` (on by default) so do a QMoE's
    block-wise 4-bit expert zero points, as int8 [experts, N, n_blocks]
    (contrib_moe.packed_expert_zero_readers). Half a byte more per block; rows of one block (the
    same either way) stay packed. Option ``q4_zero_bytes`` off keeps them all packed. Returns the
    initializers widened."""
    from onnxgen.runtime.fusion import _readers
    from onnxgen.runtime.ops.contrib_moe import packed_expert_zero_readers

    device = getattr(program, "device", None)
    opts = options.current()
    if device is None or not (opts.triton_q4 and opts.q4_zero_bytes):
        return 0
    if not triton_serves(torch.empty(0, device=device)):
        return 0
    fed = {vi.name for vi in program.inputs} | {vi.name for vi in program.outputs}
    shapes: dict[str, list[tuple[int, ...]]] = {}  # zero point name -> (lead dims..., blocks) per such reader
    expert_groups: list[list[str]] = []  # each QMoE's zero points: widened together or not at all
    for node in program.nodes:
        shape = _packed_zero_reader(node.ctx)
        name = node.inputs[3] if len(node.inputs) > 3 else ""
        if shape is not None and name:
            shapes.setdefault(name, []).append(shape)
        if opts.moe_zero_bytes:
            found = packed_expert_zero_readers(node.ctx, node.inputs, program.initializers)
            for name, shape in found:
                shapes.setdefault(name, []).append(shape)
            if found:
                expert_groups.append([name for name, _ in found])
    readers = _readers(program)
    widen = {name for name, seen in shapes.items() if name not in fed and _widens(program.initializers.get(name),
                                                                                 seen, readers[name])}  # fmt: skip
    # a QMoE whose fc1 zero points widened and fc3's did not (another op reads one of them) would
    # leave the expert kernels two forms they do not take together: keep such a node's all packed,
    # to a fixed point, as a tensor two QMoE nodes share ties their groups
    changed = True
    while changed:
        changed = False
        for group in expert_groups:
            if widen.intersection(group) and not widen.issuperset(group):
                widen.difference_update(group)
                changed = True
    for name in widen:
        *lead, n_blocks = shapes[name][0]
        rows = math.prod(lead)
        codes = unpack_codes(program.initializers[name].reshape(rows, -1), 4)[:, :n_blocks]
        program.initializers[name] = codes.to(torch.int8).reshape(*lead, n_blocks).contiguous()
    return len(widen)


def _widens(zero: Any, seen: list[tuple[int, ...]], readers: int) -> bool:
    """Whether packed zero points ``zero`` may become a byte per block: an initializer that only the
    ``seen`` readers read, all with one (lead dims..., blocks) shape of at least two blocks, and
    packed for that shape."""
    if readers != len(seen) or len(set(seen)) != 1 or not isinstance(zero, torch.Tensor):
        return False
    *lead, n_blocks = seen[0]
    return zero.dtype == torch.uint8 and n_blocks >= 2 and zero.numel() == math.prod(lead) * -(-n_blocks // 2)


def _packed_zero_reader(ctx: NodeContext) -> tuple[int, int] | None:
    """(rows, blocks) of a node whose input 3 is a 4-bit weight's zero points that the packed
    kernels take widened: a MatMulNBits, or a MatMulNBitsGroup of one weight (one member, or
    members joined at load: fusion.pack_nbits_groups)."""
    if int(ctx.attrs.get("bits", 4)) != 4 or ctx.attrs.get(PREPACKED_ATTR):
        return None
    block = int(ctx.attrs.get("block_size", 0))
    if (ctx.op_type, ctx.domain) not in _NBITS_OPS or block <= 0:
        return None
    widths = ctx.attrs.get("widths")
    if widths and len(widths) > 1 and not ctx.attrs.get("packed_weight"):
        return None  # members apart: input 3 is the first member's zero points only
    return _weight_rows(ctx), -(-int(ctx.attrs.get("K", 0)) // block)


PREPACKED_ATTR = "onnxgen_int4pack"  # set by prepack_int4: B and scales are the int4 GEMM's layout


def prepack_int4(program: Any) -> int:
    """On the CPU, every MatMulNBits that torch's int4 GEMM will serve (quant_forms, the options in
    force) gets its packed weight at load, in place of its codes, scales and zero points, which are
    dropped where nothing else reads them: the session then holds the 4-bit weight once (the
    lazily made plan kept a second copy beside the originals). Returns the nodes prepacked."""
    from onnxgen.runtime.fusion import _drop_unread, _readers

    if _INT4PACK_OP is None or not int4pack_enabled(options.current()):
        return 0
    readers = _readers(program)
    fed = {vi.name for vi in program.inputs} | {vi.name for vi in program.outputs}
    done = 0
    for node in program.nodes:
        ctx = node.ctx
        if ctx.op_type != "MatMulNBits" or ctx.domain != MS_DOMAIN or ctx.attrs.get(PREPACKED_ATTR):
            continue
        names = list(node.inputs[1:4]) + [""] * (3 - len(node.inputs[1:4]))
        g_idx = node.inputs[4] if len(node.inputs) > 4 else ""
        b, scales, zero = (program.initializers.get(name) if name else None for name in names)
        if g_idx or b is None or scales is None or (names[2] and zero is None) or fed & set(filter(None, names)):
            continue
        if not isinstance(b, torch.Tensor) or b.dtype != torch.uint8 or not scales.is_floating_point():
            continue
        k, n, block = int(ctx.attrs.get("K", 0)), int(ctx.attrs.get("N", 0)), int(ctx.attrs.get("block_size", 0))
        bits = int(ctx.attrs.get("bits", 4))
        why = int4pack_form_unserved(
            accuracy_level=int(ctx.attrs.get("accuracy_level", 0)), bits=bits, has_g_idx=False, block_size=block,
            k=k, n=n,
        )  # fmt: skip
        if why is not None or b.numel() != n * k * bits // 8:
            continue
        packed = _int4pack_weight(b, k=k, n=n, bits=bits)
        sz = _int4pack_scales_zeros(scales, zero, k=k, n=n, block_size=block, bits=bits)
        label = names[0]
        program.initializers[f"onnxgen.int4pack[{label}]"] = packed
        program.initializers[f"onnxgen.int4pack_sz[{label}]"] = sz
        node.inputs[1:4] = [f"onnxgen.int4pack[{label}]", f"onnxgen.int4pack_sz[{label}]", ""]
        ctx.attrs[PREPACKED_ATTR] = 1
        ctx.__dict__["_int4pack"] = _Int4Plan(
            packed, sz, None, k=k, n=n, block_size=block, bits=bits, packed=(packed, sz)
        )
        _drop_unread(program, readers, [name for name in names if name])
        done += 1
    return done


@implements("MatMulNBits", domain=MS_DOMAIN)
def matmul_nbits(
    ctx: NodeContext,
    a: torch.Tensor,
    b: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None = None,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    plan = ctx.__dict__.get("_int4pack")
    if plan is not None and a.is_cpu and g_idx is None and plan.serves(b, scales, zero_points):
        return plan.run(a, bias)  # the decode fast path: checked once when the plan was made
    if ctx.attrs.get(PREPACKED_ATTR):
        raise ctx.fail("its weight was packed for the CPU int4 GEMM at load and is no longer that tensor")
    k = int(ctx.require("K"))
    n = int(ctx.require("N"))
    bits = int(ctx.attr("bits", 4))
    block_size = int(ctx.require("block_size"))
    if int(ctx.attr("weight_prepacked", 0)):
        raise ctx.fail("weight_prepacked (an execution-provider-specific layout) is not supported")
    if bits not in (2, 4, 8):
        raise ctx.fail(f"bits={bits} is not supported (2, 4 or 8)")
    if a.shape[-1] != k:
        raise ctx.fail(f"A has {a.shape[-1]} columns, K is {k}")
    dtype = compute_dtype(a.dtype, a.device)
    out_dtype = a.dtype
    if b.numel() == 0:  # an omitted projection: zeros (or the bias)
        out = torch.zeros((*a.shape[:-1], n), dtype=a.dtype, device=a.device)
        return out + bias if bias is not None else out

    def build() -> torch.Tensor:
        return dequantize_nbits(b, scales, zero_points, g_idx, k=k, n=n, bits=bits, block_size=block_size, dtype=dtype)

    int8_a = _int8_activations(ctx, a, zero_points, bits, block_size)
    if not int8_a and q4_kernel_applies(a, b, scales, zero_points, g_idx, k=k, bits=bits, block_size=block_size):
        scratch = ctx.__dict__.get(SCRATCH_ATTR)
        return q4_linear(a, b, scales, zero_points, bias, n=n, k=k, block_size=block_size, bits=bits, scratch=scratch)
    if _int4pack_applies(ctx, a, b, g_idx, k=k, n=n, bits=bits, block_size=block_size):
        plan = _Int4Plan(b, scales, zero_points, k=k, n=n, block_size=block_size, bits=bits)
        ctx.__dict__["_int4pack"] = plan
        return plan.run(a, bias)
    extra = (k, n, bits, block_size, dtype, a.device)
    weight = DEQUANT_CACHE.get((b, scales, zero_points, g_idx), extra, build)
    if int8_a:
        a = fake_quantize_int8_blocks(a, block_size)
    a = a.to(dtype)
    out = split_gemv(a, weight, b_transposed=True) if bias is None else None  # fp32 CPU decode
    if out is None:
        out = F.linear(a, weight, bias.to(dtype) if bias is not None else None)
    return out.to(out_dtype)


def _q4_rows_kernel_serves(
    data: torch.Tensor,
    indices: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    bits: int,
    gather_axis: int,
    quant_axis: int,
    block_size: int,
) -> bool:
    """The one-kernel path (gpu/prelude.py gather_q4_rows) takes 4-bit rows of a 2-D table packed
    along its last axis, with per-row scales (and packed zero points) of whole blocks."""
    if bits != 4 or data.dim() != 2 or gather_axis != 0 or quant_axis != 1 or not triton_serves(data):
        return False
    n_blocks = -(-data.shape[1] * 2 // block_size) if block_size > 0 else 0
    if not n_blocks or scales.shape != (data.shape[0], n_blocks) or not scales.is_floating_point():
        return False
    if indices.dtype not in (torch.int32, torch.int64) or not (data.is_contiguous() and scales.is_contiguous()):
        return False
    if zero_points is None:
        return True
    return (
        zero_points.dtype == torch.uint8
        and zero_points.shape == (data.shape[0], -(-n_blocks // 2))
        and zero_points.is_contiguous()
    )


@implements("GatherBlockQuantized", domain=MS_DOMAIN)
def gather_block_quantized(
    ctx: NodeContext,
    data: torch.Tensor,
    indices: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None = None,
) -> torch.Tensor:
    rank = data.dim()
    gather_axis = normalize_axis(int(ctx.attr("gather_axis", 0)), rank)
    quant_axis = normalize_axis(int(ctx.attr("quantize_axis", 1)), rank)
    block_size = int(ctx.attr("block_size", 128))
    bits = int(ctx.attr("bits", 4))
    is_float8 = data.dtype in _FLOAT8
    if data.dtype != torch.uint8 and not is_float8:
        raise ctx.fail(f"data of dtype {data.dtype} is not supported (uint8 packed codes or float8)")
    if data.dtype == torch.uint8:
        if gather_axis != 0:
            raise ctx.fail("uint8 data needs gather_axis 0")
        if bits < 8 and gather_axis == quant_axis:
            raise ctx.fail("packed data needs quantize_axis different from gather_axis")

    # gather first, then dequantize only what was taken. Out-of-range indices are refused (onnxruntime
    # 1.32 gives zero rows: a token id past the vocabulary would embed as zeros); where the check
    # cannot read them (a CUDA graph recording) they still give zero rows, never a stray read.
    size = data.shape[gather_axis]
    checked_indices(ctx, indices, size, gather_axis)
    if _q4_rows_kernel_serves(data, indices, scales, zero_points, bits, gather_axis, quant_axis, block_size):
        from onnxgen.runtime.gpu.prelude import gather_q4_rows

        out = gather_q4_rows(data, indices, scales, zero_points, block_size)
        return out.reshape(*indices.shape, out.shape[-1])
    idx = indices.to(torch.long).reshape(-1)
    idx = torch.where(idx < 0, idx + size, idx)
    valid = (idx >= 0) & (idx < size)
    safe = torch.where(valid, idx, 0)
    rows = data.index_select(gather_axis, safe)
    if is_float8:
        values = rows.float()
    else:
        values = unpack_codes(rows, bits).float() if bits < 8 else rows.float()
    extent = values.shape[quant_axis]
    block = block_size or extent  # block_size 0 (float8 only): one block per row

    def per_element(param: torch.Tensor, packed: bool) -> torch.Tensor:
        if param.shape[gather_axis] != 1:
            param = param.index_select(gather_axis, safe)
        param = unpack_codes(param, bits).float() if packed else param.float()
        param = param.narrow(quant_axis, 0, -(-extent // block)) if packed and quant_axis == rank - 1 else param
        return param.repeat_interleave(block, dim=quant_axis).narrow(quant_axis, 0, extent)

    scale = per_element(scales, packed=False)
    if zero_points is not None and not is_float8:
        values = values - per_element(zero_points, packed=bits < 8)
    elif not is_float8:
        values = values - float(1 << (bits - 1))
    out = (values * scale).to(scales.dtype)
    mask_shape = [1] * rank
    mask_shape[gather_axis] = -1
    out = torch.where(valid.reshape(mask_shape), out, torch.zeros((), dtype=out.dtype, device=out.device))
    shape = list(out.shape)
    return out.reshape(shape[:gather_axis] + list(indices.shape) + shape[gather_axis + 1 :])
