"""Every fused Triton kernel compiles for the H200 (sm_90), here, without a GPU.

Triton's interpreter (tests/test_triton_kernels.py) checks what the kernels compute but not that
they compile: it accepts Python that the compiler rejects. Ahead-of-time compilation for a CUDA
target needs no device, so a kernel that would fail on the GPU fails here first.
"""

from __future__ import annotations

import re

import pytest

from bench import sass_census
from bench.sass_census import census, compile_layer, parse_layer, sass_instructions
from onnxgen.runtime.gpu.launch import triton_importable

pytestmark = pytest.mark.skipif(not triton_importable(), reason="triton is not installed")


def compiled_for_sm90(fn, signature: dict[str, str], constexprs: dict[str, object]):
    """bench.sass_census's compile with nothing marked aligned (these tests' form since they began)."""
    return sass_census.compiled_for_sm90(fn, signature, constexprs, pointers_aligned=False)


def compile_for_sm90(fn, signature: dict[str, str], constexprs: dict[str, object]) -> str:
    kernel = compiled_for_sm90(fn, signature, constexprs)
    ptx = kernel.asm["ptx"]
    # under programmatic dependent launch every kernel waits for the one before (griddepcontrol)
    assert ("griddepcontrol.wait" in ptx) == bool(constexprs.get("PDL")), "griddepcontrol.wait where PDL asks"
    return ptx


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("pdl", [False, True])
def test_rms_norm_compiles(dtype: str, skip: bool, pdl: bool) -> None:
    from onnxgen.runtime.gpu import rms_norm

    ptr = f"*{dtype}"
    sig = dict.fromkeys(["x_ptr", "skip_ptr", "bias_ptr", "gamma_ptr", "y_ptr", "sum_ptr"], ptr)
    sig.update(inv_ptr="*fp32", hidden="i32", x_heads="i32", x_outer_stride="i32", x_head_stride="i32", eps="fp32")
    const = dict(HAS_SKIP=skip, HAS_BIAS=False, WRITE_SUM=skip, WRITE_INV=not skip, BLOCK=1024, PDL=pdl)
    assert compile_for_sm90(rms_norm._rms_norm_kernel, sig, const)


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
@pytest.mark.parametrize(
    ("rotary", "interleaved", "positions"), [(True, False, False), (True, True, True), (False, False, False)]
)
@pytest.mark.parametrize(("pdl", "early"), [(False, False), (True, False), (True, True)])
def test_gqa_decode_kernels_compile(
    dtype: str, rotary: bool, interleaved: bool, positions: bool, pdl: bool, early: bool
) -> None:
    from onnxgen.runtime.gpu import gqa_decode

    ptr = f"*{dtype}"
    sig = dict.fromkeys(["q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr", "key_cache_ptr", "value_cache_ptr"], ptr)
    sig.update(dict.fromkeys(["part_max_ptr", "part_sum_ptr", "part_acc_ptr"], "*fp32"), seqlens_ptr="*i32")
    ints = ["q_row_stride", "k_row_stride", "v_row_stride", "cache_batch_stride", "cache_head_stride"]
    sig.update(dict.fromkeys([*ints, "num_heads", "head_size", "num_splits", "window"], "i32"))
    sig.update(pos_ptr="*i64" if positions else "*i32", scale="fp32")
    const = dict(HAS_POSITIONS=positions, DO_ROTARY=rotary, INTERLEAVED=interleaved, HALF_ROT=32 if rotary else 1)
    sig.update(ticket_ptr="*i32", out_ptr=ptr)
    const.update(GROUP=7, BLOCK_G=16, BLOCK_N=64, BLOCK_D=64, BLOCK_S=8, IEEE=dtype == "fp32", PDL=pdl, EARLY=early)
    ptx = compile_for_sm90(gqa_decode._attend_split, sig, const)
    # the merge ticket is an acquire-release atomic, and the partials it merges are read from L2
    assert "atom.global.gpu.acq_rel" in ptx and "ld.global.cg" in ptx
    if pdl:  # early: the settled inputs (the row index first) are read before the wait, else after it
        assert (ptx.index("ld.global") < ptx.index("griddepcontrol.wait")) == early


@pytest.mark.parametrize("pdl", [False, True])
def test_silu_mul_compiles(pdl: bool) -> None:
    from onnxgen.runtime.gpu import silu_mul

    sig = dict(g_ptr="*fp16", u_ptr="*fp16", out_ptr="*fp16", width="i32", g_row_stride="i32", u_row_stride="i32")
    assert compile_for_sm90(silu_mul._silu_mul_kernel, sig, dict(BLOCK=1024, PDL=pdl))


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("prologue", [0, 1, 2, 3])
@pytest.mark.parametrize("pdl", [False, True])
def test_linear_row_compiles(dtype: str, prologue: int, pdl: bool) -> None:
    from onnxgen.runtime.gpu import linear_row

    sig = dict.fromkeys(["x_ptr", "x2_ptr", "gamma_ptr", "sum_ptr", "w_ptr", "bias_ptr", "out_ptr"], f"*{dtype}")
    sig.update(n="i32", k="i32", w_stride="i32", eps="fp32")
    const = dict(PROLOGUE=prologue, HAS_BIAS=True, BLOCK_N=8, BLOCK_K=128, PDL=pdl)
    ptx = compile_for_sm90(linear_row._linear_row_kernel, sig, const)
    if pdl:  # the first weight tile streams before the wait for the kernel before
        assert ptx.index("ld.global") < ptx.index("griddepcontrol.wait")


@pytest.mark.parametrize("prologue", [0, 1, 2, 3])
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("persistent", [False, True])
def test_linear_tile_compiles(prologue: int, pdl: bool, persistent: bool) -> None:
    from onnxgen.runtime.gpu import linear_row

    kernel = linear_row._linear_tile_persistent_kernel if persistent else linear_row._linear_tile_kernel

    sig = dict.fromkeys(["x_ptr", "x2_ptr", "gamma_ptr", "sum_ptr", "w_ptr", "bias_ptr", "out_ptr"], "*fp16")
    sig.update(n="i32", k="i32", w_stride="i32", eps="fp32")
    const = dict(PROLOGUE=prologue, HAS_BIAS=True, BLOCK_N=4, BLOCK_K=1024, PDL=pdl)
    ptx = compile_for_sm90(kernel, sig, const)
    if pdl:  # every weight load and the bias load stream before the wait; activations come after it
        wait = ptx.index("griddepcontrol.wait")
        assert ptx.index("ld.global") < wait and "ld.global" in ptx[wait:]


@pytest.mark.parametrize("zero_kind", [0, 1, 2])
@pytest.mark.parametrize("prologue", [0, 2, 3])
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_linear_row_q4_compiles(zero_kind: int, prologue: int, pdl: bool, split: bool, bits: int) -> None:
    from onnxgen.runtime.gpu import linear_q4

    if split and prologue == 2:
        pytest.skip("a norm prologue is never split")
    if bits == 8 and not pdl:
        pytest.skip("8-bit codes: the default form with PDL")
    sig = dict.fromkeys(["x_ptr", "x2_ptr", "gamma_ptr", "sum_ptr", "scale_ptr", "bias_ptr", "out_ptr"], "*fp16")
    sig.update(b_ptr="*u8", zero_ptr="*fp16" if zero_kind == 2 else "*u8", eps="fp32", part_ptr="*fp32")
    sig.update(ticket_ptr="*i32", **dict.fromkeys(["n", "k", "n_blocks", "row_bytes", "zp_row_bytes"], "i32"))
    const = dict(PROLOGUE=prologue, ZERO_KIND=zero_kind, HAS_BIAS=prologue == 0, QBLOCK=32, BLOCK_N=16, PDL=pdl,
                 BITS=bits)  # fmt: skip
    kernel = linear_q4._q4_split_kernel if split else linear_q4._q4_tile_kernel
    if split:
        const.update(NB=16, BLOCK_S=4)
    else:
        const.update(B0=16, B1=8, B2=4)  # 896 elements
    ptx = compile_for_sm90(kernel, sig, const)
    if pdl:  # the codes, scales and zero points stream before the wait; activations come after it
        wait = ptx.index("griddepcontrol.wait")
        assert ptx.index("ld.global") < wait and "ld.global" in ptx[wait:]
    if zero_kind == 0:  # codes become floats by the exponent trick: no integer-to-float conversion
        conversions = re.findall(r"cvt\.rn\.f32\.[su]\d+", ptx)  # (one is the norm's k, a scalar)
        assert len(conversions) <= 1, conversions


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_linear_row_q4_ready_weights_are_made_before_the_wait(split: bool, bits: int) -> None:
    """Option q4_row_ready: in the SASS, every fp16 weight product (code - zero) * scale comes before the
    PDL wait, as its point is. ptxas sinks that arithmetic past an unconditional wait; the wait guarded
    by a test of every weight (linear_q4._all_made) keeps it in place."""
    from onnxgen.runtime.gpu import linear_q4

    sig = dict.fromkeys(["x_ptr", "x2_ptr", "gamma_ptr", "sum_ptr", "scale_ptr", "bias_ptr", "out_ptr"], "*fp16")
    sig.update(b_ptr="*u8", zero_ptr="*u8", eps="fp32", part_ptr="*fp32")
    sig.update(ticket_ptr="*i32", **dict.fromkeys(["n", "k", "n_blocks", "row_bytes", "zp_row_bytes"], "i32"))
    const = dict(PROLOGUE=3 if split else 2, ZERO_KIND=1, HAS_BIAS=not split, QBLOCK=32, BLOCK_N=8, PDL=True,
                 BITS=bits, READY=True)  # fmt: skip
    const.update(dict(NB=16, BLOCK_S=16) if split else dict(B0=16, B1=8, B2=4))
    kernel = linear_q4._q4_split_kernel if split else linear_q4._q4_tile_kernel
    ins = sass_instructions(compiled_for_sm90(kernel, sig, const))
    wait = max(i for i, text in enumerate(ins) if text.startswith("ACQBULK"))
    scaled = [i for i, text in enumerate(ins) if re.search(r"\bHMUL2\b", text)]
    assert scaled and max(scaled) < wait, (len(scaled), sum(i > wait for i in scaled))


@pytest.mark.parametrize("zero_kind", [0, 1, 2])
@pytest.mark.parametrize("prologue", [0, 2, 3])
@pytest.mark.parametrize("split", [False, True])
def test_linear_row_q4_words_compiles(zero_kind: int, prologue: int, split: bool) -> None:
    from onnxgen.runtime.gpu import linear_q4_words

    if split and prologue == 2:
        pytest.skip("a norm prologue is never split")
    sig = dict.fromkeys(["x_ptr", "x2_ptr", "gamma_ptr", "sum_ptr", "scale_ptr", "bias_ptr", "out_ptr"], "*fp16")
    sig.update(w_ptr="*i32", zero_ptr="*fp16" if zero_kind == 2 else "*u8", eps="fp32", part_ptr="*fp32")
    names = ["n", "k", "n_blocks", "row_words", "zp_row_bytes", "magic_bits"]
    sig.update(ticket_ptr="*i32", **dict.fromkeys(names, "i32"))
    const = dict(PROLOGUE=prologue, ZERO_KIND=zero_kind, HAS_BIAS=prologue == 0, QBLOCK=32, BLOCK_N=16, PDL=True)
    kernel = linear_q4_words._q4w_split_kernel if split else linear_q4_words._q4w_tile_kernel
    if split:
        const.update(NB=16, BLOCK_S=4)
    else:
        const.update(B0=16, B1=8, B2=4)  # 896 elements
    ptx = compile_for_sm90(kernel, sig, const)
    wait = ptx.index("griddepcontrol.wait")  # the words, scales and zero points before the wait
    assert ptx.index("ld.global") < wait and "ld.global" in ptx[wait:]
    # codes become floats by the exponent trick; packed zero points (kind 1) convert once per block, a
    # handful per thread (a program's 16 x 28 blocks over 128 threads), never once per weight
    conversions = re.findall(r"cvt\.rn\.f32\.[su]\d+", ptx)
    assert len(conversions) <= (8 if zero_kind == 1 else 1), conversions


@pytest.mark.parametrize("zero_kind", [0, 1, 3])
@pytest.mark.parametrize("prologue", [0, 1, 2, 3])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("qblock", [32, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_linear_row_q4_half_compiles(zero_kind: int, prologue: int, split: bool, qblock: int, dtype: str) -> None:
    """gpu/linear_q4_half.py: the codes, scales and zero points load before the PDL wait; each group's
    products are fp16 pair instructions (the PTX form), with no fp64 of the interpreter's form. bf16
    activations in a few of the forms (the same kernel, another load and store type)."""
    from onnxgen.runtime.gpu import linear_q4_half

    if split and prologue in (1, 2):
        pytest.skip("a norm prologue is never split")
    if (dtype == "bf16" or qblock == 128) and (zero_kind != 1 or (dtype == "bf16" and qblock != 32)):
        pytest.skip("bf16, and blocks of 128: packed zero points only (the same code a type or a size apart)")
    sig = dict.fromkeys(["x_ptr", "x2_ptr", "gamma_ptr", "sum_ptr", "bias_ptr", "out_ptr"], f"*{dtype}")
    sig.update(scale_ptr=f"*{dtype}")
    sig.update(w_ptr="*i32", zero_ptr="*i8" if zero_kind == 3 else "*u8", eps="fp32", part_ptr="*fp32")
    sig.update(ticket_ptr="*i32", **dict.fromkeys(["n", "k", "n_blocks", "row_words", "zp_row_bytes"], "i32"))
    const = dict(PROLOGUE=prologue, ZERO_KIND=zero_kind, HAS_BIAS=prologue == 0, QBLOCK=qblock, BLOCK_N=16, PDL=True)
    if split:
        const.update(NB=512 // qblock, BLOCK_S=4)
    else:
        const.update(B0=1024 // qblock, B1=512 // qblock, B2=0)  # 1,536 elements
    kernel = linear_q4_half._q4h_split_kernel if split else linear_q4_half._q4h_tile_kernel
    ptx = compile_for_sm90(kernel, sig, const)
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.index("ld.global") < wait and "ld.global" in ptx[wait:]
    assert "fma.rn.f16x2" in ptx[wait:] and ".f64" not in ptx


@pytest.mark.parametrize(
    "layer",
    [
        "qkv:1152x896:byte:16:4:skip_rms",
        "o_proj:896x896:byte:8:4:none",
        "gate_up:9728x896:pair:16:2:skip_rms",
        "qkv:1152x896:pair:4:1:rms",
        "gate_up:17920x1536:words:16:4:skip_rms",
    ],
)
def test_one_row_q4_loads_every_part_before_a_barrier(layer: str) -> None:
    """The one-tile 4-bit kernels load every part of the row's activations (and the whole row, for a
    norm's or the pair kernel's statistics) right after the PDL wait, before any barrier: a load
    behind one part's reductions is an L2 round trip in series with them (bench/sass_census.py,
    docs/benchmarks/2026-12-07-cpu-one-row-postwait.md)."""
    counted = census(compile_layer(parse_layer(layer)))
    assert counted.counts["LDG"] >= 3, counted.counts  # x (and the prologue's inputs) of every part
    assert counted.barriers_before_loads == 0, counted


@pytest.mark.parametrize(
    ("zero_kind", "prologue", "parts"), [(1, 0, (16, 8, 4)), (3, 2, (16, 8, 4)), (1, 2, (64, 0, 0))]
)
def test_linear_row_q4_half_stream_compiles(zero_kind: int, prologue: int, parts: tuple[int, int, int]) -> None:
    """_q4h_stream_kernel (option q4_stream): the first row block's codes load before the PDL wait,
    the later ones in its loop; the products are fp16 pair instructions, with no fp64."""
    from onnxgen.runtime.gpu import linear_q4_half

    sig = dict.fromkeys(["x_ptr", "x2_ptr", "gamma_ptr", "sum_ptr", "bias_ptr", "out_ptr", "scale_ptr"], "*fp16")
    sig.update(w_ptr="*i32", zero_ptr="*i8" if zero_kind == 3 else "*u8", eps="fp32")
    sig.update(dict.fromkeys(["n", "k", "n_blocks", "row_words", "zp_row_bytes"], "i32"))
    b0, b1, b2 = parts
    const = dict(PROLOGUE=prologue, ZERO_KIND=zero_kind, HAS_BIAS=prologue == 0, QBLOCK=32, BLOCK_N=8, PDL=True,
                 B0=b0, B1=b1, B2=b2)  # fmt: skip
    ptx = compile_for_sm90(linear_q4_half._q4h_stream_kernel, sig, const)
    wait = ptx.index("griddepcontrol.wait")
    word_loads = [len(re.findall(r"ld\.global\S*\.b32", text)) for text in (ptx[:wait], ptx[wait:])]
    assert word_loads[0] == word_loads[1] > 0, word_loads  # the loop loads the next block's words as the first
    assert "fma.rn.f16x2" in ptx[wait:] and ".f64" not in ptx


@pytest.mark.parametrize("zero_kind", [0, 1, 2])
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("bits", [4, 8])
def test_dequant_q4_compiles(zero_kind: int, dtype: str, bits: int) -> None:
    from onnxgen.runtime.gpu import linear_q4

    sig = dict.fromkeys(["scale_ptr", "w_ptr"], f"*{dtype}")
    sig.update(b_ptr="*u8", zero_ptr=f"*{dtype}" if zero_kind == 2 else "*u8")
    sig.update(dict.fromkeys(["n", "k", "row_bytes", "n_blocks", "zp_row_bytes"], "i32"))
    const = dict(ZERO_KIND=zero_kind, QBLOCK=32, BLOCK_N=16, BYTES=128, BITS=bits)
    ptx = compile_for_sm90(linear_q4._q4_dequant_kernel, sig, const)
    assert "st.global" in ptx


@pytest.mark.parametrize("zero_kind", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("bits", [4, 8])
def test_dequant_q4_blocks_compiles(zero_kind: int, dtype: str, bits: int) -> None:
    """The block form of the prompts' dequantization: fp16 weights with integer zero points take the
    inline-PTX nibbles (4-bit) and 16-byte stores; no integer-to-float conversion of a code is left."""
    from onnxgen.runtime.gpu import linear_q4

    sig = dict.fromkeys(["scale_ptr", "w_ptr"], f"*{dtype}")
    sig.update(b_ptr="*u8", zero_ptr={2: f"*{dtype}", 3: "*i8"}.get(zero_kind, "*u8"))
    sig.update(dict.fromkeys(["n", "k", "row_bytes", "n_blocks", "zp_row_bytes"], "i32"))
    const = dict(ZERO_KIND=zero_kind, QBLOCK=32, BLOCK_N=16, NB=16, BITS=bits)
    ptx = compile_for_sm90(linear_q4._q4_dequant_blocks_kernel, sig, const)
    assert "st.global" in ptx
    assert_ptx_nibbles(ptx, bits == 4 and dtype == "fp16" and zero_kind != 2)


@pytest.mark.parametrize("zero_kind", [0, 1, 2])
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("bits", [4, 8])
def test_matmul_q4_compiles(zero_kind: int, dtype: str, bits: int) -> None:
    from onnxgen.runtime.gpu import linear_q4

    sig = dict.fromkeys(["a_ptr", "scale_ptr", "bias_ptr", "c_ptr"], f"*{dtype}")
    sig.update(b_ptr="*u8", zero_ptr=f"*{dtype}" if zero_kind == 2 else "*u8")
    sig.update(dict.fromkeys(["m", "n", "k", "a_stride", "c_stride", "n_blocks", "row_bytes", "zp_row_bytes"], "i32"))
    const = dict(ZERO_KIND=zero_kind, HAS_BIAS=True, QBLOCK=32, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64,
                 IEEE=dtype == "fp32", BITS=bits, SWAP=False)  # fmt: skip
    ptx = compile_for_sm90(linear_q4._q4_matmul_kernel, sig, const)
    assert ("mma" in ptx) == (dtype != "fp32")  # half types on tensor cores; fp32 in IEEE fp32, not TF32
    assert_ptx_nibbles(ptx, bits == 4 and dtype == "fp16" and zero_kind != 2)


@pytest.mark.parametrize(("zero_kind", "dtype", "bits"), [(3, "fp16", 4), (1, "bf16", 4), (0, "fp16", 8)])
def test_matmul_q4_swapped_tile_feeds_the_tensor_cores_from_registers(zero_kind: int, dtype: str, bits: int) -> None:
    """Option gemm_q4's SWAP (W @ A^T): every wgmma takes the dequantized weight tile as its A operand
    from registers ({%r...} after the accumulators), where A @ W^T passes two shared-memory
    descriptors, the weight tile stored there first."""
    from onnxgen.runtime.gpu import linear_q4

    sig = dict.fromkeys(["a_ptr", "scale_ptr", "bias_ptr", "c_ptr"], f"*{dtype}")
    sig.update(b_ptr="*u8", zero_ptr="*i8" if zero_kind == 3 else "*u8")
    sig.update(dict.fromkeys(["m", "n", "k", "a_stride", "c_stride", "n_blocks", "row_bytes", "zp_row_bytes"], "i32"))
    for swap in (False, True):
        const = dict(ZERO_KIND=zero_kind, HAS_BIAS=True, QBLOCK=32, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, IEEE=False,
                     BITS=bits, SWAP=swap)  # fmt: skip
        ptx = compile_for_sm90(linear_q4._q4_matmul_kernel, sig, const)
        products = [line.split("}", 1)[1] for line in ptx.splitlines() if "wgmma.mma_async" in line]
        assert products, "no wgmma"
        assert all(p.lstrip(", ").startswith("{") == swap for p in products), products[:2]


def assert_ptx_nibbles(ptx: str, expected: bool) -> None:
    """fp16 weights with integer zero points unpack their nibbles in linear_q4._half_nibbles_ptx's
    inline PTX (the fp16 1024 OR-ed into masked halves); other forms never reach it."""
    assert ("0x000F000F, 0x64006400" in ptx) == expected


@pytest.mark.parametrize("zero_kind", [0, 1, 2])
@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
@pytest.mark.parametrize(("words", "split", "bits"), [(True, True, 4), (False, True, 4), (True, False, 4),
                                                      (False, True, 8)])  # fmt: skip
@pytest.mark.parametrize("tile", [(16, 32), (64, 64)])  # the rule's short-prompt and wide 64-row tiles
def test_matmul_q4_split_compiles(zero_kind: int, dtype: str, words: bool, split: bool, bits: int, tile: tuple) -> None:
    from onnxgen.runtime.gpu import linear_q4_split

    sig = dict.fromkeys(["a_ptr", "scale_ptr", "bias_ptr", "c_ptr"], f"*{dtype}")
    sig.update(b_ptr="*i32" if words else "*u8", zero_ptr=f"*{dtype}" if zero_kind == 2 else "*u8")
    sig.update(part_ptr="*fp32", ticket_ptr="*i32")
    names = ["m", "n", "k", "a_stride", "c_stride", "n_blocks", "row_units", "zp_row_bytes", "tiles_per_split",
             "k_tiles", "magic_bits"]  # fmt: skip
    sig.update(dict.fromkeys(names, "i32"))
    const = dict(ZERO_KIND=zero_kind, HAS_BIAS=True, QBLOCK=32, BLOCK_M=tile[0], BLOCK_N=tile[1], BLOCK_K=128,
                 WORDS=words, SPLIT=split, IEEE=dtype == "fp32", BITS=bits)  # fmt: skip
    ptx = compile_for_sm90(linear_q4_split._q4_split_gemm_kernel, sig, const)
    assert ("mma" in ptx) == (dtype != "fp32")  # half types on tensor cores; fp32 in IEEE fp32, not TF32
    assert ("atom.global" in ptx) == split  # the ticket, only where the partials meet
    assert_ptx_nibbles(ptx, bits == 4 and not words and dtype == "fp16" and zero_kind != 2)
    if words:  # codes become floats by the exponent trick, never by an integer conversion per weight
        conversions = re.findall(r"cvt\.rn\.f32\.[su]\d+", ptx)
        assert len(conversions) <= (8 if zero_kind == 1 else 1), conversions


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
@pytest.mark.parametrize("past", [True, False])
@pytest.mark.parametrize("prompt", [False, True])
def test_causal_conv_kernels_compile(dtype: str, past: bool, prompt: bool) -> None:
    from onnxgen.runtime.gpu import causal_conv_update as conv

    sig = dict.fromkeys(["x_ptr", "w_ptr", "bias_ptr", "past_ptr", "present_ptr", "y_ptr"], f"*{dtype}")
    const = dict(KERNEL=4, HAS_BIAS=False, HAS_PAST=past, SILU=True, BLOCK=64)
    if prompt:
        names = ["channels", "length", "x_batch_stride", "x_position_stride", "x_channel_stride", "y_batch_stride",
                 "y_position_stride", "y_channel_stride", "state_channel_stride", "state_position_stride", "carry",
                 "dilation", "ends_stride"]  # fmt: skip
        # a last row per batch entry (runtime/state_rows.py) with the half types, none with fp32
        sig["ends_ptr"] = "*i64"
        kernel, const = conv._causal_conv_prompt_kernel, {**const, "BLOCK_T": 16, "HAS_END": dtype == "fp16"}
    else:
        names = ["channels", "x_row_stride", "x_channel_stride", "state_channel_stride", "state_position_stride",
                 "carry", "dilation"]  # fmt: skip
        kernel, const = conv._causal_conv_step_kernel, {**const, "PDL": True}
    sig.update(dict.fromkeys(names, "i32"))
    ptx = compile_for_sm90(kernel, sig, const)
    assert "st.global" in ptx


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
@pytest.mark.parametrize(("decay", "beta"), [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize(("chunked", "prologue"), [(False, 0), (True, 0), (False, 1), (False, 2)])
def test_gated_delta_kernels_compile(dtype: str, decay: bool, beta: bool, chunked: bool, prologue: int) -> None:
    """prologue: the q / k norm (1 or 2) and the gate folded in (FusedLinearAttention)."""
    from onnxgen.runtime.gpu import gated_delta_decode

    if prologue and not (decay and beta):
        pytest.skip("a folded gate gives both the decay and beta")
    if chunked:
        _assert_chunked_kernels_compile(dtype, decay, beta)
        return
    sig = dict.fromkeys(["q_ptr", "k_ptr", "v_ptr", "decay_ptr", "beta_ptr", "out_ptr"], f"*{dtype}")
    sig.update(past_ptr="*fp32", present_ptr="*fp32", scale="fp32")
    sig.update(dt_bias_ptr=f"*{dtype}", decay_scale_ptr=f"*{dtype}", eps="fp32")
    names = ["q_row_stride", "q_tok_stride", "k_row_stride", "k_tok_stride", "v_row_stride", "v_tok_stride",
             "decay_row_stride", "decay_tok_stride", "decay_head_stride", "decay_dim_stride", "beta_row_stride",
             "beta_tok_stride", "beta_head_stride", "tokens", "kv_heads", "d_k", "d_v", "group", "q_share",
             "k_share", "ends_stride"]  # fmt: skip
    sig.update(dict.fromkeys(names, "i32"))
    sig["ends_ptr"] = "*i64"
    # a last row per batch entry (runtime/state_rows.py) with the half types, none with fp32
    const = dict(HAS_PAST=True, HAS_DECAY=decay, HAS_BETA=beta, HAS_END=dtype == "fp16", BLOCK_K=128, BLOCK_V=32)
    const.update(PDL=True, NORM=prologue, GATE=bool(prologue))
    ptx = compile_for_sm90(gated_delta_decode._gated_delta_step_kernel, sig, const)
    assert "st.global" in ptx


def _assert_chunked_kernels_compile(dtype: str, decay: bool, beta: bool) -> None:
    """gpu/gated_delta_chunked.py's two kernels, the Qwen3.5 layer's tiles (128 key and value dims),
    their fp32 products in IEEE fp32 on the FMA units, not TF32 tensor cores."""
    from onnxgen.runtime.gpu import gated_delta_chunked as chunked

    inputs = dict.fromkeys(["q_ptr", "k_ptr", "v_ptr", "decay_ptr", "beta_ptr"], f"*{dtype}")
    scratch = dict.fromkeys(["a_ptr", "t_ptr", "u_ptr", "m_ptr", "p_ptr", "g_ptr"], "*fp32")
    ints = ["q_row_stride", "q_tok_stride", "k_row_stride", "k_tok_stride", "v_row_stride", "v_tok_stride",
            "decay_row_stride", "decay_tok_stride", "decay_head_stride", "beta_row_stride", "beta_tok_stride",
            "beta_head_stride", "tokens", "padded", "kv_heads", "d_k", "d_v", "group", "q_share", "k_share",
            "ends_stride"]  # fmt: skip
    sig = {**inputs, **scratch, **dict.fromkeys(ints, "i32"), "ends_ptr": "*i64"}
    tiles = dict(BLOCK_K=128, BLOCK_VV=128, CHUNK=chunked.CHUNK)
    const = dict(HAS_DECAY=decay, HAS_BETA=beta, HAS_END=dtype == "fp16", **tiles, BLOCK=chunked.BLOCK, SQUARINGS=3)
    ptxs = [compile_for_sm90(chunked._chunk_prepare_kernel, sig, const)]
    sig = {**inputs, **scratch, **dict.fromkeys(ints, "i32"), "ends_ptr": "*i64", "scale": "fp32"}
    sig.update(past_ptr="*fp32", present_ptr="*fp32", out_ptr=f"*{dtype}")
    const = dict(HAS_PAST=True, HAS_END=dtype == "fp16", **tiles, BLOCK_V=chunked.STATE_COLUMNS)
    ptxs.append(compile_for_sm90(chunked._chunk_state_kernel, sig, const))
    for ptx in ptxs:
        assert "st.global" in ptx
        assert "mma" not in ptx and "tf32" not in ptx


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize(("streams", "layout", "start"), [(3, 1, False), (3, 0, False), (1, 0, False), (1, 0, True)])
def test_rotary_kernel_compiles(dtype: str, streams: int, layout: int, start: bool) -> None:
    from onnxgen.runtime.gpu import rotary

    sig = dict.fromkeys(["x_ptr", "out_ptr"], f"*{dtype}")
    sig.update(pos_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32")
    names = ["seq", "heads", "x_b", "x_s", "x_n", "x_h", "o_b", "o_s", "o_n", "o_h", "pos_stream", "pos_b", "pos_s",
             "cache_rows", "cache_row_stride", "head_size", "half", "sec_t", "sec_h", "sec_w"]  # fmt: skip
    sig.update(dict.fromkeys(names, "i32"))
    const = dict(STREAMS=streams, LAYOUT=layout, INTERLEAVED=False, POS_START=start, BLOCK_N=16, BLOCK_R=8,
                 BLOCK_H=64)  # fmt: skip
    ptx = compile_for_sm90(rotary._rotary_kernel, sig, const)
    assert "st.global" in ptx


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
@pytest.mark.parametrize(("per_row", "has_x"), [(True, True), (False, False)])
def test_sigmoid_gate_compiles(dtype: str, per_row: bool, has_x: bool) -> None:
    from onnxgen.runtime.gpu import sigmoid_gate

    sig = dict.fromkeys(["y_ptr", "g_ptr", "x_ptr", "out_ptr"], f"*{dtype}")
    sig.update(dict.fromkeys(["cols", "y_row_stride", "g_row_stride", "x_row_stride"], "i32"))
    const = dict(PER_ROW=per_row, HAS_X=has_x, BLOCK=1024, PDL=True)
    assert "st.global" in compile_for_sm90(sigmoid_gate._sigmoid_gate_kernel, sig, const)


def test_one_row_kernel_policy() -> None:
    """ONNXGEN_TRITON_LINEAR: 1 forces the one-row kernels, 0 turns them off, unset they run only
    where programmatic dependent launch is (a CUDA device of sm_90 or later): never on this CPU."""
    import torch

    from onnxgen import options
    from onnxgen.runtime.gpu import launch as ts

    row = torch.zeros(8, dtype=torch.float16)
    for raw, mode in [(None, "auto"), ("1", "on"), ("0", "off"), ("auto", "auto")]:
        env = {} if raw is None else {"ONNXGEN_TRITON_LINEAR": raw}
        with options.using(options.from_env(env)):
            assert ts.linear_row_mode() == mode
            if mode != "on":
                assert not ts.linear_row_serves(row)
    assert ts.pdl_launch(row) == {"enable_fp_fusion": True, "PDL": False}
    with pytest.raises(ValueError, match="ONNXGEN_TRITON_LINEAR='yes': expected 1 .on., 0 .off. or unset"):
        options.from_env({"ONNXGEN_TRITON_LINEAR": "yes"})


def test_why_programmatic_dependent_launch_is_unavailable() -> None:
    from onnxgen.runtime.gpu.launch import pdl_unavailable

    assert pdl_unavailable((9, 0), {"launch_pdl", "num_warps"}) is None
    assert pdl_unavailable((10, 0), {"launch_pdl"}) is None
    assert "sm_80" in pdl_unavailable((8, 0), {"launch_pdl"})
    assert "launch_pdl" in pdl_unavailable((9, 0), {"num_warps"})
    assert "no CUDA backend" in pdl_unavailable((9, 0), None)


def test_settled_inputs_exclude_what_the_last_pdl_launch_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A PDL kernel may read before its wait only what the PDL kernel launched just before it does
    not write (gqa_decode reads its cache, row index and rotary tables early on that condition)."""
    import torch

    from onnxgen.runtime.gpu import launch as ts

    x, out, other = torch.zeros(4), torch.zeros(8), torch.zeros(8)
    monkeypatch.setattr(ts, "pdl_applies", lambda t: True)
    assert ts.pdl_launch(x, out, None) == {"enable_fp_fusion": True, "PDL": True, "launch_pdl": True}
    assert not ts.settled_before_launch(out) and not ts.settled_before_launch(out[2:])  # a view: same storage
    assert ts.settled_before_launch(x, other, None)
    ts.pdl_launch(x, other)  # the next launch replaces the record
    assert ts.settled_before_launch(out) and not ts.settled_before_launch(other)
    monkeypatch.setattr(ts, "pdl_applies", lambda t: False)
    # without PDL nothing overlaps: nothing is in flight
    assert ts.pdl_launch(x, out) == {"enable_fp_fusion": True, "PDL": False}
    assert ts.settled_before_launch(out, other)


@pytest.mark.parametrize("prologue", [0, 3])
@pytest.mark.parametrize("pdl", [False, True])
def test_linear_split_compiles(prologue: int, pdl: bool) -> None:
    from onnxgen.runtime.gpu import linear_row

    sig = dict.fromkeys(["x_ptr", "x2_ptr", "gamma_ptr", "sum_ptr", "w_ptr", "bias_ptr", "out_ptr"], "*fp16")
    sig.update(part_ptr="*fp32", ticket_ptr="*i32", n="i32", k="i32", w_stride="i32", eps="fp32")
    const = dict(PROLOGUE=prologue, HAS_BIAS=True, BLOCK_N=8, BLOCK_K=1024, BLOCK_S=8, PDL=pdl)
    ptx = compile_for_sm90(linear_row._linear_split_kernel, sig, const)
    assert "atom.global.gpu.acq_rel.add" in ptx  # the ticket of the partials' merge
    if pdl:  # the weight tile streams before the wait
        assert ptx.index("ld.global") < ptx.index("griddepcontrol.wait")


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("pdl", [False, True])
def test_greedy_advance_compiles(host: bool, pdl: bool) -> None:
    from onnxgen.runtime.gpu import greedy_advance

    sig = dict(row_ptr="*fp16", vocab="i32", part_val_ptr="*fp32", part_idx_ptr="*i32", part_nan_ptr="*i32")
    sig.update(ticket_ptr="*i32", ids_ptr="*i64", pos_ptr="*i64", mask_ptr="*i64", host_ptr="*i64", capacity="i32")
    ptx = compile_for_sm90(
        greedy_advance._greedy_advance_kernel, sig, dict(BLOCK=2048, BLOCK_P=128, HOST=host, PDL=pdl)
    )
    assert "atom.global.gpu.acq_rel.add" in ptx  # the ticket of the last program


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("early", [False, True])
def test_prelude_kernels_compile(pdl: bool, early: bool) -> None:
    from onnxgen.runtime.gpu import prelude

    sig = dict(x_ptr="*i64", out_ptr="*i32", width="i32", stride="i32", offset="i32")
    assert compile_for_sm90(prelude._row_sum_cast_kernel, sig, dict(BLOCK=512, PDL=pdl))
    sig = dict(table_ptr="*fp16", idx_ptr="*i64", out_ptr="*fp16", rows="i32", width="i32")
    ptx = compile_for_sm90(prelude._gather_rows_kernel, sig, dict(BLOCK=1024, EARLY=early, PDL=pdl))
    if pdl and early:  # the settled index and its row are read before the wait
        assert ptx.index("ld.global") < ptx.index("griddepcontrol.wait")
