"""onnxgen's switches, declared once: one ``Options`` object, read from the environment on first use.

Every ``ONNXGEN_*`` switch (and ``TRITON_INTERPRET``) is a field of ``Options`` and a ``Knob`` in
``KNOBS``: its variable, default, accepted values and what it trades. The environment is parsed
once, at the first ``current()``; a bad value is one ``OptionError`` naming the variable and what
it accepts (every knob is checked then, not only the one a run happens to reach).

Lifetimes: ``session`` knobs are read when an ``InferenceSession`` is built (it keeps the object);
``launch`` knobs when a kernel runs or a CUDA graph records it (launch configurations are resolved
once per weight shape and cached for the options object in force, so the hot path reads no
environment and parses nothing); ``process`` knobs are fixed for the process (``override`` refuses
them: triton reads ``TRITON_INTERPRET`` itself when the kernels are defined).

``override(**changes)`` replaces the options object in force for the code run inside the ``with``
block, in every thread of the process (the benches sweep kernel settings with it; tests use it
instead of setting variables and clearing caches). It is not meant for threads that override
different values at the same time. Defaults are the measured-fastest paths; the launch tables
themselves live next to their kernels (gpu/linear_row.py, gpu/gqa_decode.py): a per-shape
override here replaces a table entry, the tables are not copied here.

Read elsewhere, on purpose: ``ONNXGEN_HOME`` (models/fetch.py, at each lookup, so a changed
environment applies to the next pull), ``OMP_*`` (threads.py, which must run before torch loads).
This module imports nothing heavy, so ``onnxgen.runtime`` and the CLI may import it early.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from onnxgen.errors import OptionError

Config = tuple[int, ...]
Shape = tuple[int, int]
SPLIT_OFF: Config = ()  # a split-K "configuration" that turns the split kernel off


@dataclass(frozen=True)
class ShapeOverrides:
    """Launch configurations forced by weight shape [N, K]: ``shapes`` per shape, which wins over
    ``every`` (all shapes). Empty (the default): the kernel's own table decides."""

    every: Config | None = None
    shapes: tuple[tuple[Shape, Config], ...] = ()

    def lookup(self, n: int, k: int) -> Config | None:
        for shape, config in self.shapes:
            if shape == (n, k):
                return config
        return self.every

    def __bool__(self) -> bool:
        return self.every is not None or bool(self.shapes)


NO_OVERRIDES = ShapeOverrides()


@dataclass(frozen=True, slots=True)
class Options:
    """The switches in force; see ``KNOBS`` for each field's variable and trade-off."""

    fuse: bool = True
    fuse_skip: frozenset[str] = frozenset()
    triton: bool = True
    triton_interpret: bool = False
    triton_linear: Literal["auto", "on", "off"] = "auto"
    triton_q4: bool = True
    q4_zero_bytes: bool = True
    moe_zero_bytes: bool = True
    pdl: bool = True
    gemv_persist: int = 0
    gemv_tile: bool = True
    gemv_dense: ShapeOverrides = NO_OVERRIDES
    gemv_q4: ShapeOverrides = NO_OVERRIDES
    gemm_q4: ShapeOverrides = NO_OVERRIDES
    gemm_q4_split: ShapeOverrides = NO_OVERRIDES
    q4_prompt: Literal["auto", "dequant", "gemm", "split"] = "auto"
    q4_dequant: Literal["bytes", "blocks"] = "blocks"
    q4_dequant_chunk_rows: int = 0
    q4_dequant_ahead: bool = False
    q4_row_ready: bool = False
    q4_half: Literal["auto", "all", "off"] = "auto"
    q4_stream: int | Literal["auto"] = "auto"
    q4_norm_apart: int = 4096
    gemv_split: ShapeOverrides = NO_OVERRIDES
    gqa_decode: tuple[int, int] | None = None
    gqa_early: bool = True
    dequant_cache_mb: float | None = None
    int8_activations: Literal["none", "cpu", "all"] = "none"
    cpu_int4_gemm: bool = True
    conv_prompt: bool = True
    gdn_chunked_from: int = 17
    gdn_chunked_to: int = 0
    gdn_prompt_fold: bool = True
    moe_pairs_per_expert: float = 0.25
    moe_grouped: tuple[int, int, int, int, int, int, int] | None = None
    moe_per_pair: tuple[int, int, int, int, int] | None = None
    gdn_prompt: tuple[int, int] | None = None
    prefill_pieces: Literal["pad", "split"] = "pad"
    prefill_sizes: Literal["pow2", "fine"] = "fine"

    @property
    def dequant_cache_bytes(self) -> int | None:
        """The dequantized-weight cache's cap in bytes (None: no cap)."""
        return None if self.dequant_cache_mb is None else int(self.dequant_cache_mb * 2**20)


# -- parsers: environment text -> field value; ValueError(accepted values) on anything else -----------


def _flag(on: str = "1", off: str = "0") -> Callable[[str], bool]:
    def parse(raw: str) -> bool:
        if raw.strip() not in (on, off):
            raise ValueError(f"expected {on} or {off}")
        return raw.strip() == on

    return parse


def _choice(*values: str) -> Callable[[str], str]:
    """A parser that takes exactly one of ``values`` (as written: no case folding)."""
    expected = f"{', '.join(values[:-1])} or {values[-1]}"

    def parse(raw: str) -> str:
        if raw not in values:
            raise ValueError(f"expected {expected}")
        return raw

    return parse


def _ints(raw: str, count: int, what: str) -> Config:
    try:
        values = tuple(int(v) for v in raw.split(","))
    except ValueError:
        values = ()
    if len(values) != count or min(values) < 1:
        raise ValueError(f"expected {what} ({count} positive integers)")
    return values


def _names(raw: str) -> frozenset[str]:
    """Comma-separated names (runtime/fusion.py checks them against its rewrites)."""
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    if not all(n.replace("_", "").isalnum() for n in names):
        raise ValueError("expected rewrite names separated by commas, e.g. delta_prologues,sigmoid_gates")
    return names


def _triton_flag(raw: str) -> bool:
    """Triton's own variable: onnxgen takes exactly ``1`` as on and leaves validation to triton."""
    return raw == "1"


def _triton_linear(raw: str) -> str:
    modes = {"1": "on", "0": "off", "auto": "auto"}
    if raw not in modes:
        raise ValueError("expected 1 (on), 0 (off) or unset (auto)")
    return modes[raw]


def _persist(raw: str) -> int:
    if not raw.isdigit():
        raise ValueError("expected a number of programs per SM (0: off)")
    return int(raw)


def _stream(raw: str) -> int | str:
    if raw == "auto":
        return raw
    if not raw.isdigit():
        raise ValueError("expected auto (the kernel's table) or a number of programs per SM (0: off)")
    return int(raw)


def _count(unit: str, zero: str = "never") -> Callable[[str], int]:
    """A parser of a number of ``unit`` (digits only; 0 means ``zero``)."""

    def parse(raw: str) -> int:
        if not raw.isdigit():
            raise ValueError(f"expected a number of {unit} (0: {zero})")
        return int(raw)

    return parse


def _tile_rows(raw: str) -> int:
    """A number of weight rows that keeps cuBLAS's operands 16-byte aligned (a multiple of 64; 0: unset)."""
    if not raw.isdigit() or int(raw) % 64:
        raise ValueError("expected a number of rows, a multiple of 64 (0: the scratch's size)")
    return int(raw)


def _pairs_per_expert(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ValueError("expected a number of (token, expert) pairs per expert, 0 or more (0: every prompt grouped)")
    return value


def _moe_grouped(raw: str) -> tuple[int, int, int, int, int, int, int]:
    try:
        values = tuple(int(v) for v in raw.split(","))
    except ValueError:
        values = ()
    if len(values) in (5, 6):
        values = (*values, 0, 0)[:7]
    if len(values) != 7:
        raise ValueError("expected BLOCK_M,BLOCK_N1,BLOCK_N2,K_STEP,WARPS[,SWAP[,STAGES]] (five to seven integers; "
                         "BLOCK_M 0: the rule; STAGES 0: the kernels' own)")  # fmt: skip
    block_m, n1, n2, k_step, warps, swap, stages = values
    powers = all(v > 0 and not v & (v - 1) for v in (n1, n2, k_step))
    if block_m not in (0, 16, 32, 64, 128) or not powers or not (16 <= n1 <= 256 and 16 <= n2 <= 256):
        raise ValueError("BLOCK_M must be 0, 16, 32, 64 or 128; BLOCK_N1 and BLOCK_N2 powers of two 16-256")
    # 32 and up: the compiled kernels summed wrong with 16-element K steps (gpu/moe_grouped.MIN_K_STEP)
    if not 32 <= k_step <= 512 or warps not in (1, 2, 4, 8):
        raise ValueError("K_STEP must be a power of two 32-512, WARPS 1, 2, 4 or 8")
    if swap not in (0, 1):
        raise ValueError("SWAP must be 0 (pairs as the product's rows) or 1 (weight rows)")
    if not 0 <= stages <= 8:
        raise ValueError("STAGES must be 0 (the kernels' own) to 8")
    return values  # type: ignore[return-value]


def _moe_per_pair(raw: str) -> tuple[int, int, int, int, int]:
    try:
        values = tuple(int(v) for v in raw.split(","))
    except ValueError:
        values = ()
    if len(values) != 5:
        raise ValueError("expected FC1_ROWS,FC1_BYTES,FC2_ROWS,FC2_BYTES,WARPS (five integers; FC2_ROWS 0: the rule)")
    fc1_rows, fc1_bytes, fc2_rows, fc2_bytes, warps = values
    power = lambda v, lo, hi: lo <= v <= hi and not v & (v - 1)  # noqa: E731
    if not (power(fc1_rows, 2, 64) and (fc2_rows == 0 or power(fc2_rows, 2, 32))):
        raise ValueError("FC1_ROWS must be a power of two 2-64, FC2_ROWS 0 or a power of two 2-32")
    if not (power(fc1_bytes, 1024, 65536) and power(fc2_bytes, 1024, 65536)) or warps not in (1, 2, 4, 8, 16):
        raise ValueError("FC1_BYTES and FC2_BYTES must be powers of two 1024-65536, WARPS 1, 2, 4, 8 or 16")
    return values  # type: ignore[return-value]


def _gqa_decode(raw: str) -> tuple[int, int]:
    try:
        block_n, warps = (int(v) for v in raw.split(","))
    except ValueError:
        raise ValueError("expected BLOCK_N,WARPS (two integers)") from None
    if block_n < 16 or block_n & (block_n - 1) or warps not in (1, 2, 4, 8, 16):
        raise ValueError("BLOCK_N must be a power of two >= 16, WARPS 1-16")
    return block_n, warps


def _gdn_prompt(raw: str) -> tuple[int, int]:
    block_v, warps = _ints(raw, 2, "BLOCK_V,WARPS")
    if not 4 <= block_v <= 128 or block_v & (block_v - 1) or warps not in (1, 2, 4, 8):
        raise ValueError("BLOCK_V must be a power of two 4-128, WARPS 1, 2, 4 or 8")
    return block_v, warps


def _cache_mb(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError("expected a size in MB (0: no cache; unset: no cap)")
    return value


def _int8(raw: str) -> str:
    value = raw.strip().lower()
    if value not in ("none", "cpu", "all"):
        raise ValueError("expected none, cpu or all")
    return value


def _dense(raw: str) -> Config:
    return _ints(raw, 3, "BLOCK_N,BLOCK_K,WARPS")


def _q4(raw: str) -> Config:
    """BLOCK_N,BLOCK_K,WARPS and optional KERNEL and STREAM: KERNEL 0 (the default) the byte kernel, 1
    the kernel over 32-bit words of codes (gpu/linear_q4_words.py), 2 the fp16 pair kernel
    (gpu/linear_q4_half.py); STREAM P: the pair kernel's one-tile products as P programs per SM (its
    streaming form, option q4_stream, for this shape alone; 0: the tile form)."""
    parts = raw.split(",")
    what = "BLOCK_N,BLOCK_K,WARPS[,KERNEL[,STREAM]] (KERNEL 0: bytes, 1: words, 2: fp16 pairs; STREAM: programs per SM)"
    if len(parts) in (4, 5):
        try:
            extra = [int(p) for p in parts[3:]]
        except ValueError:
            extra = [-1]
        if extra[0] not in (0, 1, 2) or (len(extra) == 2 and (extra[1] < 0 or extra[0] != 2)):
            raise ValueError(f"expected {what}")
        return (*_ints(",".join(parts[:3]), 3, what), *extra)
    return (*_ints(raw, 3, what), 0)


def _gemm_q4(raw: str) -> Config:
    """BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES and an optional sixth value SWAP: 0 (the default) A times
    the weight tile, 1 the weight tile times A (the dequantized tile then feeds the tensor cores from
    registers)."""
    what = "BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES[,SWAP] (SWAP 0 or 1)"
    parts = raw.split(",")
    if len(parts) == 6:
        if parts[5] not in ("0", "1"):
            raise ValueError(f"expected {what}")
        return (*_ints(",".join(parts[:5]), 5, what), int(parts[5]))
    return (*_ints(raw, 5, what), 0)


def _gemm_q4_split(raw: str) -> Config:
    """BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES,SPLITS,WORDS: SPLITS 0 keeps the kernel's own count, WORDS 0
    or 1 (the codes as bytes or as 32-bit words)."""
    what = "BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES,SPLITS,WORDS (SPLITS 0: the kernel's count; WORDS 0 or 1)"
    try:
        values = tuple(int(v) for v in raw.split(","))
    except ValueError:
        values = ()
    if len(values) != 7 or min(values[:5]) < 1 or values[5] < 0 or values[6] not in (0, 1):
        raise ValueError(f"expected {what}")
    return values


def _split(raw: str) -> Config:
    if raw == "off":
        return SPLIT_OFF
    try:
        return _ints(raw, 3, "BLOCK_N,BLOCK_K,WARPS")
    except ValueError:
        raise ValueError("expected off or BLOCK_N,BLOCK_K,WARPS (3 positive integers)") from None


@dataclass(frozen=True)
class Knob:
    """One switch: ``field`` of Options, read from ``env``; ``per_shape``: also ``<env>_<N>x<K>``."""

    field: str
    env: str
    parse: Callable[[str], Any]
    values: str  # the accepted values, as the docs and errors say them
    trades: str  # one line: what turning it trades
    lifetime: Literal["session", "launch", "process"] = "launch"
    audience: Literal["user", "tuning"] = "tuning"
    per_shape: bool = False
    default_text: str | None = None  # the default as the docs say it (None: from Options())

    @property
    def default(self) -> Any:
        return getattr(Options(), self.field)


KNOBS: tuple[Knob, ...] = (
    Knob("fuse", "ONNXGEN_FUSE", _flag(), "`1` / `0`",
         "`0`: no graph rewrites (GEMM groups, prologues, attention): more kernels per step, the graph as written",
         lifetime="session", audience="user"),
    Knob("fuse_skip", "ONNXGEN_FUSE_SKIP", _names, "rewrite names, comma-separated",
         "leaves those graph rewrites out and runs the others (`onnxgen show --capture` names what each matched): "
         "to time one rewrite against the graph without it", lifetime="session", default_text="none"),
    Knob("triton", "ONNXGEN_TRITON", _flag(), "`1` / `0`",
         "`0`: no Triton kernels at all; torch's unfused kernels run (slower CUDA decode)", audience="user"),
    Knob("dequant_cache_mb", "ONNXGEN_DEQUANT_CACHE_MB", _cache_mb, "MB (unset: no cap)",
         "caps the cache of dequantized weights (`0`: no cache): memory against dequantizing on every call",
         audience="user"),
    Knob("cpu_int4_gemm", "ONNXGEN_CPU_INT4_GEMM", _flag(), "`1` / `0`",
         "`0`: no torch int4 GEMM (bf16 activations) for 4- and 8-bit MatMulNBits at accuracy_level >= 3 on "
         "the CPU: the exact fp32 path over a dequantized copy (8x / 4x the packed size)", audience="user"),
    Knob("triton_interpret", "TRITON_INTERPRET", _triton_flag, "`1` (anything else: off)",
         "`1`: Triton's interpreter (the tests run the kernels on the CPU); read by triton when the kernels "
         "are defined", lifetime="process"),
    Knob("triton_linear", "ONNXGEN_TRITON_LINEAR", _triton_linear, "unset (auto) / `1` / `0`",
         "one-row Triton GEMVs (norm or SiLU-mul fused in) always / never (cuBLAS); auto: where PDL is"),
    Knob("triton_q4", "ONNXGEN_TRITON_Q4", _flag(), "`1` / `0`",
         "`0`: 4- and 8-bit MatMulNBits on a Triton device multiply a cached fp16 copy of each weight (4x / 2x "
         "the packed size) instead of the packed codes: more device memory, a faster decode step on the H200",
         audience="user"),
    Knob("q4_zero_bytes", "ONNXGEN_Q4_ZERO_BYTES", _flag(), "`1` / `0`",
         "`0`: a session keeps 4-bit MatMulNBits' packed zero points as they are instead of a byte per block "
         "(half a byte less per block; the prompt GEMMs then stage each weight tile through shared memory)",
         lifetime="session"),
    Knob("moe_zero_bytes", "ONNXGEN_MOE_ZERO_BYTES", _flag(), "`1` / `0`",
         "`0`: a session on a Triton device keeps a block-wise 4-bit QMoE's packed expert zero points as they are "
         "instead of a byte per block (half a byte less per block; slower expert kernels in decode)",
         lifetime="session"),
    Knob("pdl", "ONNXGEN_PDL", _flag(), "`1` / `0`",
         "`0`: no programmatic dependent launch between the step's Triton kernels (Hopper+)"),
    Knob("gemv_persist", "ONNXGEN_GEMV_PERSIST", _persist, "`P` (programs per SM; `0`: off)",
         "one-tile GEMVs with more row blocks than P programs per SM run as P programs per SM, each looping"),
    Knob("gemv_tile", "ONNXGEN_GEMV_TILE", _flag(), "`1` / `0`",
         "`0`: rows that fit one tile run the loop kernel instead of the one-tile kernel"),
    Knob("gemv_dense", "ONNXGEN_GEMV_DENSE", _dense, "`BLOCK_N,BLOCK_K,WARPS`",
         "forces the dense GEMV's launch configuration (all shapes, or `_<N>x<K>` one weight shape)", per_shape=True,
         default_text="unset: the kernel's table"),
    Knob("gemv_q4", "ONNXGEN_GEMV_Q4", _q4, "`BLOCK_N,BLOCK_K,WARPS[,KERNEL[,STREAM]]`",
         "forces the one-row 4-bit GEMV's launch configuration (BLOCK_K < K: split along K; KERNEL 1: the kernel "
         "over 32-bit words of codes, 2: the fp16 pair kernel; STREAM P with KERNEL 2: its streaming form at P "
         "programs per SM, as q4_stream for this shape; all shapes, or `_<N>x<K>`)", per_shape=True,
         default_text="unset: the kernel's table"),
    Knob("gemm_q4", "ONNXGEN_GEMM_Q4", _gemm_q4, "`BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES[,SWAP]`",
         "forces the several-row 4-bit GEMM's launch configuration (prompts; SWAP 1: the weight tile as the "
         "tensor cores' first operand, from registers; all shapes, or `_<N>x<K>`)",
         per_shape=True, default_text="unset: the kernel's table"),
    Knob("gemm_q4_split", "ONNXGEN_GEMM_Q4_SPLIT", _gemm_q4_split,
         "`BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES,SPLITS,WORDS`",
         "forces the split-K 4-bit GEMM's launch configuration (`ONNXGEN_Q4_PROMPT=split`; SPLITS 0: the kernel's "
         "count; WORDS 1: the codes as 32-bit words; all shapes, or `_<N>x<K>`)", per_shape=True,
         default_text="unset: the kernel's rule"),
    Knob("q4_prompt", "ONNXGEN_Q4_PROMPT", _choice("auto", "dequant", "gemm", "split"),
         "`auto` / `dequant` / `gemm` / `split`",
         "4-bit weights times several rows (a prompt): dequantize each layer's weight into a transient "
         "buffer and run cuBLAS, or the Triton GEMM that dequantizes tiles in registers (no buffer); split: "
         "the split-K GEMM (gpu/linear_q4_split.py) for prompts of at most 128 rows, else dequant; auto: today the "
         "same as split (16-row tiles up to 16 rows, 64-row tiles above: docs/benchmarks/2026-12-05-h200-day.md, "
         "docs/benchmarks/2026-12-05-h100-peers.md; up to 128 rows since "
         "docs/benchmarks/2026-12-06-h100-grouped-swap-ttft.md); split stays fixed if auto's bound moves"),
    Knob("q4_dequant", "ONNXGEN_Q4_DEQUANT", _choice("bytes", "blocks"), "`bytes` / `blocks`",
         "the kernel that dequantizes a long prompt's 4-bit weights for cuBLAS (q4_prompt's dequant path), the "
         "same weights either way: per code byte, or per quantization block (each block's scale and zero point "
         "loaded once; the 1.5B int4 TTFT at 1,024 tokens 7.9 against 8.4 ms on an H100: "
         "docs/benchmarks/2026-12-07-h100-ready-and-blocks.md)"),
    Knob("q4_dequant_chunk_rows", "ONNXGEN_Q4_DEQUANT_CHUNK_ROWS", _tile_rows,
         "`R` (rows, a multiple of 64; `0`: the scratch's size)",
         "a long prompt's 4-bit weight of more than R rows is dequantized and multiplied R rows at a time (or "
         "fewer, in equal chunks), each product written into its columns of the result: chunks small enough to "
         "stay in L2 between the dequantization that writes them and the GEMM that reads them, wide enough to fill "
         "the GPU. Unset, a weight that fits the session's scratch goes whole"),
    Knob("q4_dequant_ahead", "ONNXGEN_Q4_DEQUANT_AHEAD", _flag(), "`1` / `0`",
         "`1`: a long prompt's 4-bit weights are dequantized a chunk ahead on a second CUDA stream, into the "
         "other half of the session's scratch, while the main stream multiplies the current chunk (what comes "
         "next is learned from earlier runs; gpu/dequant_ahead.py). Same scratch memory, chunks of at most half "
         "of it; the same bits. Untimed, so off"),
    Knob("q4_row_ready", "ONNXGEN_Q4_ROW_READY", _flag(), "`1` / `0`",
         "`1`: the one-row 4- and 8-bit byte kernels (qkv, o_proj, down_proj) dequantize their weights to the "
         "activations' dtype (fp32 for bf16) before the PDL wait, so that after it they only multiply and sum, "
         "as the dense fp16 kernel does; fp16 weights are then rounded as the prompt path's are (off: +2% on "
         "the 0.5B int4 step, -1.4% on the 1.5B one on an H100, docs/benchmarks/2026-12-07-h100-ready-and-blocks.md)"),
    Knob("q4_half", "ONNXGEN_Q4_HALF", _choice("auto", "all", "off"), "`auto` / `all` / `off`",
         "which one-row 4-bit products with fp16 or bf16 activations and integer zero points run the fp16 pair "
         "kernel (gpu/linear_q4_half.py: codes less zero points and their products in fp16x2 arithmetic, eight "
         "products per fp16 lane, then fp32): `auto` the layers of its table (rows over 1,024 elements, and the "
         "wide non-vocabulary layer; both shapes' int4 steps 1.05x `off`'s on an H100), `all` every one, "
         "`off` none (the byte and word kernels; docs/benchmarks/2026-12-07-h100-q4-half.md)"),
    Knob("q4_stream", "ONNXGEN_Q4_STREAM", _stream, "`auto` / `P` (programs per SM; `0`: off)",
         "one-tile products on the fp16 pair kernel (q4_half) with more row blocks than P programs per SM run "
         "as P programs per SM, each making the activation pairs once and loading its next row block while it "
         "sums this one (gpu/linear_q4_half.py, _q4h_stream_kernel; the same bits); `auto` its table: 4 per SM "
         "for 2-warp products with at least two row blocks per program (the 1.5B gate_up, the 0.5B lm_head: "
         "int4 steps 1.12x and 1.03x the tile form's on an H100, docs/benchmarks/2026-12-07-h100-q4-stream.md)"),
    Knob("conv_prompt", "ONNXGEN_CONV_PROMPT", _flag(), "`1` / `0`",
         "`0`: a prompt's CausalConvWithState on a Triton device runs the torch path (about ten kernels) instead "
         "of one Triton kernel (gpu/causal_conv_update.py); one-position steps keep their kernel"),
    Knob("gdn_chunked_from", "ONNXGEN_GDN_CHUNKED_FROM", _count("tokens"), "`T` (tokens; `0`: never)",
         "a LinearAttention prompt of T to gdn_chunked_to tokens on a Triton device runs the chunked kernels "
         "(gpu/gated_delta_chunked.py: each chunk's own work in parallel, then a short chain of chunk steps); "
         "shorter ones the sequential kernel; `0`: never the chunked kernels. From 17 tokens they beat the "
         "sequential kernel on the qwen3.5 shapes, up to 16 they lose to it "
         "(docs/benchmarks/2026-12-06-h200-gdn-chunked.md)"),
    Knob("gdn_chunked_to", "ONNXGEN_GDN_CHUNKED_TO", _count("tokens", "no bound"), "`T` (tokens; `0`: no bound)",
         "the longest LinearAttention prompt the chunked kernels take under gdn_chunked_from; longer ones the "
         "sequential kernel up to 128 tokens, the torch path's chunked form beyond. By default no bound: at "
         "300 and 1,024 tokens the kernels took a third to a quarter of the torch path's TTFT "
         "(docs/benchmarks/2026-12-06-h100-memory-and-chunked.md)"),
    Knob("gdn_prompt_fold", "ONNXGEN_GDN_PROMPT_FOLD", _flag(), "`1` / `0`",
         "`0`: a FusedLinearAttention prompt of 2 or more tokens on a Triton device runs its q / k norms and gate "
         "as their own kernels first, and the sequential kernel without them (about half its instructions per "
         "token step when compiled for sm_90); `1` (the default) folds them into the kernel, as for one-token "
         "steps, which keep it either way. Unfolded, the kernel was faster at 64-128 tokens and slower at 16 "
         "(docs/benchmarks/2026-12-06-h200-gdn-chunked.md); the chunked kernels now take those prompts"),
    Knob("moe_pairs_per_expert", "ONNXGEN_MOE_PAIRS_PER_EXPERT", _pairs_per_expert,
         "`P` ((token, expert) pairs per expert, a number such as `0.25`; `0`: every prompt)",
         "a MoE / QMoE prompt of more than P (token, expert) pairs per expert on a Triton device runs the grouped "
         "expert kernels (gpu/moe_grouped.py: each chosen expert read once per tile of its pairs); fewer pairs the "
         "per-pair kernels (gpu/moe_experts.py: each pair reads its expert); one-token steps always the per-pair "
         "kernels. Default 0.25: on the 35B-A3B expert layer the grouped kernels (their 2026-12-06 tiles) beat the "
         "per-pair ones at 8 tokens (0.25 pairs per expert, within 6%) and clearly from 16 up: 8 tokens stay "
         "per-pair, 9 and more go grouped (docs/benchmarks/2026-12-06-h100-moe-bound-peers.md)"),
    Knob("moe_grouped", "ONNXGEN_MOE_GROUPED", _moe_grouped,
         "`BLOCK_M,BLOCK_N1,BLOCK_N2,K_STEP,WARPS[,SWAP[,STAGES]]`",
         "forces the grouped expert kernels' tiles (gpu/moe_grouped.py): pairs per tile (0: the kernel's rule), "
         "fc1's and fc2's output columns per program, K elements per step (32 or more, and at least one quantization "
         "block), warps, SWAP 1: each product as weight rows times pairs (the weights as the tensor cores' "
         "first operand, as the rule has it since docs/benchmarks/2026-12-06-h100-grouped-swap-ttft.md; 0 or "
         "omitted: pairs as the rows), and the software pipeline's stages (0: the kernels' own)",
         default_text="unset: the kernels' rule"),
    Knob("moe_per_pair", "ONNXGEN_MOE_PER_PAIR", _moe_per_pair, "`FC1_ROWS,FC1_BYTES,FC2_ROWS,FC2_BYTES,WARPS`",
         "forces the per-pair expert kernels' tiles (gpu/moe_experts.py: decode steps and short prompts): fc1's "
         "weight rows per program (SwiGLU: gate and up rows together), its bytes per K chunk, fc2's rows per "
         "expert and program (0: the rule), its bytes per K chunk, warps (for a sweep: bench/moe_prompt.py)",
         default_text="unset: `16,16384,0,8192,8` for 4-bit experts (4 fc1 rows for dense ones)"),
    Knob("gdn_prompt", "ONNXGEN_GDN_PROMPT", _gdn_prompt, "`BLOCK_V,WARPS`",
         "the sequential Gated DeltaNet kernel's value columns per program and warps on prompts of 2 "
         "or more tokens (gpu/gated_delta_decode.py); one-token steps keep their tile",
         default_text="unset: `8,1`"),
    Knob("prefill_pieces", "ONNXGEN_PREFILL_PIECES", _choice("pad", "split"), "`pad` / `split`",
         "how a hybrid decoder's prompt chunk runs over a static cache (genai/engine.py): `pad` one step padded "
         "like a dense one on CUDA, its carried states stopping at the last real row (runtime/state_rows.py; "
         "whole on the CPU), where the graph's state ops allow it, else split; `split` unpadded pieces, one pass "
         "over the weights each (56 = 32 + 16 + 8)"),
    Knob("prefill_sizes", "ONNXGEN_PREFILL_SIZES", _choice("pow2", "fine"), "`pow2` / `fine`",
         "the rows of a padded prompt chunk and of a split one's pieces (genai/engine.py padded_rows, "
         "prompt_pieces): `pow2` powers of two; `fine` also 1.5 times a power of two from 24 on (20 rows padded "
         "to 24, 40 to 48; 56 split as 48 + 8): less padding, 13 recorded chunk shapes up to 1,024 rows instead "
         "of 7"),
    Knob("q4_norm_apart", "ONNXGEN_Q4_NORM_APART", _count("programs"), "`P` (programs; `0`: never)",
         "a 4- or 8-bit one-row product of more than P programs (the lm_head), or of rows over twice the one-tile "
         "limit, runs its norm prologue as a kernel of its own instead of once per program"),
    Knob("gemv_split", "ONNXGEN_GEMV_SPLIT", _split, "`off` / `BLOCK_N,BLOCK_K,WARPS`",
         "`off`: long rows run the loop kernel; a configuration: the split-K kernel wherever it applies "
         "(all shapes, or `_<N>x<K>`)", per_shape=True,
         default_text="unset: split where the loop kernel has < 2 programs per SM"),
    Knob("gqa_decode", "ONNXGEN_GQA_DECODE", _gqa_decode, "`BLOCK_N,WARPS`",
         "forces the decode attention kernel's keys per program and warps", default_text="unset: `128,8`"),
    Knob("gqa_early", "ONNXGEN_GQA_EARLY", _flag(), "`1` / `0`",
         "`0`: attention reads its settled inputs after the PDL wait, not before"),
    Knob("int8_activations", "ONNXGEN_INT8_ACTIVATIONS", _int8, "`none` / `cpu` / `all`",
         "at MatMulNBits accuracy_level 4, round A to int8 per block as onnxruntime's CPU kernel does "
         "(single-op parity checks; whole models drift more)"),
)  # fmt: skip

_BY_FIELD = {knob.field: knob for knob in KNOBS}
assert set(_BY_FIELD) == {f.name for f in dataclasses.fields(Options)}, "every Options field is one Knob"


def _per_shape_pattern(knob: Knob) -> re.Pattern[str]:
    return re.compile(re.escape(knob.env) + r"_(\d+)x(\d+)")


def _invalid(name: str, raw: str, why: str) -> OptionError:
    return OptionError(f"{name}={raw!r}: {why}")


def from_env(env: Mapping[str, str], base: Options | None = None) -> Options:
    """The options ``env`` (an environment mapping) asks for, over ``base`` (default: the defaults).
    Empty values count as unset; names no knob declares are ignored."""
    changes: dict[str, Any] = {}
    for knob in KNOBS:
        raw = env.get(knob.env, "")
        value: Any = None
        if raw.strip():
            try:
                value = knob.parse(raw)
            except ValueError as exc:
                raise _invalid(knob.env, raw, str(exc)) from None
        if knob.per_shape:
            pattern = _per_shape_pattern(knob)
            shapes = []
            for name, text in sorted(env.items()):
                match = pattern.fullmatch(name)
                if match and text.strip():
                    try:
                        shapes.append(((int(match[1]), int(match[2])), knob.parse(text)))
                    except ValueError as exc:
                        raise _invalid(name, text, str(exc)) from None
            if value is not None or shapes:
                changes[knob.field] = ShapeOverrides(value, tuple(shapes))
        elif value is not None:
            changes[knob.field] = value
    return dataclasses.replace(base or Options(), **changes)


def env_names(name: str) -> bool:
    """Whether ``name`` is a variable some knob reads (per-shape names included)."""
    return any(name == k.env or (k.per_shape and _per_shape_pattern(k).fullmatch(name)) for k in KNOBS)


_FROM_ENV: list[Options] = []  # the options of the process environment, parsed at the first current()
_current: Options | None = None  # the options in force: an override's, else _FROM_ENV[0]


def current() -> Options:
    """The options in force (the environment's, read once, unless an ``override`` is active).
    Called per kernel launch: one global read once loaded."""
    return _current or _load()


def _load() -> Options:
    global _current
    if not _FROM_ENV:
        _FROM_ENV.append(from_env(os.environ))
    _current = _FROM_ENV[0]
    return _current


def _env_text(value: Any) -> str:
    """A field value as its variable would spell it (for checking an override with the same parser)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value) if value else "off"
    return str(value)


_SCALAR_TYPES: dict[str, tuple[type, ...]] = {
    "gemv_persist": (int,),
    "q4_stream": (int, str),  # "auto" or programs per SM, as the variable spells them
    "q4_norm_apart": (int,),
    "q4_dequant_chunk_rows": (int,),
    "gdn_chunked_from": (int,),
    "gdn_chunked_to": (int,),
    "moe_pairs_per_expert": (int, float),
    "dequant_cache_mb": (int, float),
}
_NAMED_VALUES = {
    "triton_linear": ("auto", "on", "off"),
    "int8_activations": ("none", "cpu", "all"),
    "q4_prompt": ("auto", "dequant", "gemm", "split"),
    "q4_dequant": ("bytes", "blocks"),
    "q4_half": ("auto", "all", "off"),
    "prefill_pieces": ("pad", "split"),
    "prefill_sizes": ("pow2", "fine"),
}


def _checked(knob: Knob, value: Any) -> Any:
    """``value`` for ``knob``'s field, or OptionError saying what the field takes."""
    field = knob.field
    if field in _NAMED_VALUES:
        if value not in _NAMED_VALUES[field]:
            raise OptionError(f"option {field}={value!r}: expected one of {', '.join(_NAMED_VALUES[field])}")
        return value
    if isinstance(knob.default, bool):
        if not isinstance(value, bool):
            raise OptionError(f"option {field}={value!r}: expected True or False")
        return value
    if isinstance(knob.default, frozenset):  # names: a set of them, or the variable's text
        try:
            text = value if isinstance(value, str) else ",".join(sorted(value))
            return knob.parse(text)
        except (TypeError, ValueError) as exc:
            raise OptionError(f"option {field}={value!r}: {exc}") from None
    if value is None and knob.default is None:
        return None
    ok = isinstance(value, tuple) or (isinstance(value, _SCALAR_TYPES.get(field, ())) and not isinstance(value, bool))
    try:
        if not ok:
            raise ValueError(f"expected {knob.values}")
        return knob.parse(_env_text(value))
    except ValueError as exc:
        raise OptionError(f"option {field}={value!r}: {exc}") from None


def _config(knob: Knob, config: Any) -> Config:
    """One per-shape configuration given to ``override``: a tuple, or the variable's text."""
    text = config if isinstance(config, str) else _env_text(tuple(config))
    try:
        return knob.parse(text)
    except ValueError as exc:
        raise OptionError(f"option {knob.field}={config!r}: {exc}") from None


def _coerce(field: str, value: Any) -> Any:
    """A value given to ``override``, checked, in the field's own type. Per-shape fields take one
    configuration (every shape: a tuple or the variable's text) or a mapping {"NxK" or (N, K) or "*":
    configuration}; ``gemv_split`` also takes "off"."""
    knob = _BY_FIELD.get(field)
    if knob is None:
        raise OptionError(f"no option {field!r}; options: {', '.join(_BY_FIELD)}")
    if knob.lifetime == "process" and value != getattr(current(), field):
        raise OptionError(f"{knob.env} is fixed for the process (set it in the environment before starting Python)")
    if not knob.per_shape:
        return _checked(knob, value)
    if isinstance(value, ShapeOverrides):
        return value
    if value is None:
        return NO_OVERRIDES
    if not isinstance(value, Mapping):
        return ShapeOverrides(_config(knob, value))
    every, shapes = None, []
    for key, config in value.items():
        if key == "*":
            every = _config(knob, config)
        else:
            try:
                n, k = (int(v) for v in key.split("x")) if isinstance(key, str) else key
            except ValueError:
                raise OptionError(
                    f"option {field}: shape {key!r} is not N x K, like '9728x896' or (9728, 896)"
                ) from None
            shapes.append(((n, k), _config(knob, config)))
    return ShapeOverrides(every, tuple(shapes))


@contextmanager
def using(opts: Options) -> Iterator[Options]:
    """``opts`` in force for the code run inside the block (then whatever was before)."""
    global _current
    before = _current
    _current = opts
    try:
        yield opts
    finally:
        _current = before


@contextmanager
def override(**changes: Any) -> Iterator[Options]:
    """The options in force with ``changes`` (field=value) for the code run inside the block."""
    opts = dataclasses.replace(current(), **{f: _coerce(f, v) for f, v in changes.items()})
    with using(opts):
        yield opts


def markdown_table(audience: str | None = None) -> str:
    """The knobs (of one audience, or all) as the Markdown table docs/options.md and README carry."""
    rows = ["| variable | option | values | default | lifetime | what it trades |", "|---" * 6 + "|"]
    for knob in KNOBS:
        if audience is None or knob.audience == audience:
            name = f"`{knob.env}`" + (f", `{knob.env}_<N>x<K>`" if knob.per_shape else "")
            default = _default_text(knob)
            rows.append(f"| {name} | `{knob.field}` | {knob.values} | {default} | {knob.lifetime} | {knob.trades} |")
    return "\n".join(rows) + "\n"


def _default_text(knob: Knob) -> str:
    if knob.default_text is not None:
        return knob.default_text
    value = knob.default
    if isinstance(value, bool):
        return "`1`" if value else "`0`"
    if value is None or value == NO_OVERRIDES:
        return "unset"
    return f"`{value}`"


if __name__ == "__main__":
    print(markdown_table(), end="")
