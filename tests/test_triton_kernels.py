"""The fused Triton kernels (onnxgen/runtime/gpu/) against onnxruntime, on the CPU.

On CUDA the kernel tests reach them directly (`pytest -m gpu`). Here they run through Triton's
interpreter (TRITON_INTERPRET=1), which must be set before triton compiles anything, so the
onnxruntime parity tests of the ops they serve run again in a subprocess with it set, and a probe
plugin reports how often each fused kernel ran: the test fails if the fused path was not taken.
"""

from __future__ import annotations

import pytest

from onnxgen.runtime.gpu.launch import triton_importable
from tests import interpreted_runs
from tests.interpreted_runs import Interpreted, runs

pytestmark = pytest.mark.skipif(not triton_importable(), reason="triton is not installed")


PARITY_FILES = ("tests/test_ops_contrib.py", "tests/test_model_parity.py", "tests/test_fusion.py")


def interpreted(selection: str, files: tuple[str, ...] = PARITY_FILES, **env: str) -> Interpreted:
    """A child run of the parity tests (tests/interpreted_runs.py: started with the session)."""
    return interpreted_runs.interpreted(selection, files, **env)


# Whole-model decodes are the expensive part of an interpreted run: CI runs the GQA-attention models
# with the fused groups in fp16 (tiny-llama) and fp32 (tiny-qwen2, with biases), and int4 through the
# 4-bit kernels in INT4_MODELS; the full selection, default-domain attention, fp32 tiny-llama and the
# dense kernel over a dequantized copy (ONNXGEN_TRITON_Q4=0) included, is slow-marked below.
_SINGLE_OPS = (
    "gqa_shared or gqa_fp16 or layer_norm or genai_built or silu_mul or prologues or matmul_group_matches"
    " or row_sum_cast or embedding_gather or gather_block_quantized"
)
# Cases CI interprets once rather than in both float dtypes (or both layouts): each of these runs the
# same kernel and launch configuration as a case kept beside it, one float type apart, for a quarter
# to a third of a minute each. The slow-marked full run keeps them.
_INTERPRETED_TWICE = (
    # the long-K prologue rows: 2100 in fp16 and 1300 in fp32 stay
    "prologues_match_onnxruntime[True-2100-1-1-cpu] or prologues_match_onnxruntime[True-1300-10-1-cpu]"
    # the real-model heads: packed fp16 and unpacked fp32 stay
    " or decode_model_heads[False-10-cpu] or decode_model_heads[True-1-cpu]"
    # the prompt chunks of real-model heads: fp32 without a window and fp16 with one stay
    " or prompt_chunks_model_heads[-1-10-cpu] or prompt_chunks_model_heads[40-1-cpu]"
)
# The one-row groups of the GEMV variants below take one long-K row (a 1,300-element down projection,
# fp32) with them: the builder-made decoder and the other long rows run the same launches again, for
# minutes more (the slow-marked runs keep them)
_ONE_LONG_ROW = "prologues_match_onnxruntime[True-1300-1-1-cpu]"
_GROUPS = "prologues or genai_built or matmul_group_matches"
_SHORT_GROUPS = f"(prologues and not 1300 and not 2100) or matmul_group_matches or {_ONE_LONG_ROW}"
PARITY = interpreted(
    f"({_SINGLE_OPS} or (growing_kv and gqa and fused and not int4 and not (fp32 and llama)))"
    f" and not ({_INTERPRETED_TWICE})",
    ONNXGEN_TRITON_LINEAR="1",  # the one-row GEMVs (on by default only where PDL is)
)
PARITY_FULL = interpreted(f"{_SINGLE_OPS} or growing_kv", ONNXGEN_TRITON_LINEAR="1", ONNXGEN_TRITON_Q4="1")


@runs(PARITY)
def test_parity_tests_pass_through_the_triton_interpreter() -> None:
    launches = PARITY.launches()
    assert launches.get("gqa_decode", 0) >= 20 and launches.get("rms_norm", 0) >= 20, launches
    assert launches.get("silu_mul", 0) >= 10, launches
    # prompts and prompt chunks over a shared buffer (gpu/gqa_prefill.py)
    assert launches.get("gqa_prefill", 0) >= 20, launches
    # GatherBlockQuantized's 4-bit rows (onnxruntime-genai's int4 embedding)
    assert launches.get("gather_q4_rows", 0) >= 10, launches
    # the step's prelude: the mask's row sums (RowSumCast) and the embedding rows
    assert launches.get("row_sum_cast", 0) >= 7 and launches.get("gather_rows", 0) >= 15, launches
    # the one-row GEMVs with their prologues (fused whole-model decode, fp32 and fp16)
    assert launches.get("linear_row", 0) >= 100, launches


@pytest.mark.slow
@runs(PARITY_FULL)
def test_full_parity_through_the_triton_interpreter() -> None:
    """Every whole-model parity case (both attention forms, unfused graphs, int4 through the 4-bit
    kernels on the packed codes) through the interpreter: minutes more than the CI selection."""
    launches = PARITY_FULL.launches()
    assert launches.get("gqa_decode", 0) >= 20 and launches.get("linear_row", 0) >= 100, launches
    assert launches.get("linear_row_q4", 0) >= 20, launches


# The 2,100-element rows (down split along K) take a quarter of a minute each through the interpreter:
# CI keeps the fused kernels in fp16 at one row, the norm apart in fp32 at one row and the prompt path
# in fp32; the dense kernels over a copy ("copy") are the slow-marked INT4_DENSE run's.
_INT4_LONG_ROWS_TWICE = " or ".join(
    f"norm_silu_match_onnxruntime[{case}-cpu]"
    for case in (
        "packed-packed-2100-False-1-1",
        "packed-packed-2100-False-10-5",
        "apart-packed-2100-False-10-1",
        "apart-packed-2100-False-1-5",
        "apart-packed-2100-False-10-5",
    )
)


@runs(
    INT4_ROW := interpreted(
        f"matmul_nbits or int8_group or (int4_group and (packed or apart) and not copy"
        f" and not ({_INT4_LONG_ROWS_TWICE}))",
        ONNXGEN_TRITON_LINEAR="1",
        ONNXGEN_TRITON_Q4="1",
    )
)
def test_int4_kernels_parity_through_the_triton_interpreter() -> None:
    """gpu/linear_q4.py (ONNXGEN_TRITON_Q4=1) on the plain MatMulNBits op and on 4- and 8-bit groups (zero point
    kinds, block sizes, bias, prologues; one row and several: the GEMM split along K of short prompts,
    the transient dequantization of longer ones, the tiled GEMM of q4_prompt=gemm) against
    onnxruntime, with no dequantized copy kept."""
    launches = INT4_ROW.launches()
    # long prompts' weights dequantized per quantization block (option q4_dequant's default)
    assert launches.get("linear_row_q4", 0) >= 10 and launches.get("dequant_q4_blocks", 0) >= 10, launches
    assert launches.get("matmul_q4", 0) >= 3 and launches.get("matmul_q4_split", 0) >= 100, launches
    assert launches.get("linear_row_q4_split", 0) >= 1, launches


# the 4-bit MatMulNBits forms (zero point kinds, block sizes, dtypes, rows split along K) and the fused
# groups' prologues over short rows: the 2,100-element groups of the byte kernel's run add minutes here
# and no path (long rows are matmul_nbits_4bit_long_rows)
ONE_ROW_INT4_CASES = "(matmul_nbits_4bit and not prompt) or (int4_group and packed and not 2100)"


@runs(
    INT4_WORDS := interpreted(
        ONE_ROW_INT4_CASES,
        ONNXGEN_TRITON_LINEAR="1",
        ONNXGEN_TRITON_Q4="1",
        # every shape on the word kernel, 4-row tiles (rows over 1,024 elements split along K)
        ONNXGEN_GEMV_Q4="4,1024,2,1",
    )
)
def test_int4_word_kernels_parity_through_the_triton_interpreter() -> None:
    """gpu/linear_q4_words.py (the default for wide one-tile products) on the same cases as the byte
    kernel above: zero point kinds, block sizes, bias, prologues; one program per tile, and rows
    split along K."""
    launches = INT4_WORDS.launches()
    split = launches.get("linear_row_q4_words_split", 0)
    assert split >= 1, launches
    assert launches.get("linear_row_q4_words", 0) - split >= 10, launches  # one program per tile


@runs(
    INT4_HALF := interpreted(
        ONE_ROW_INT4_CASES,
        ONNXGEN_TRITON_LINEAR="1",
        ONNXGEN_TRITON_Q4="1",
        ONNXGEN_Q4_HALF="all",
        # 4-row tiles split along K every 128 elements: the plain products split, the norm prologues' whole rows
        ONNXGEN_GEMV_Q4="4,128,2,2",
    )
)
def test_int4_fp16_pair_kernels_parity_through_the_triton_interpreter() -> None:
    """gpu/linear_q4_half.py (option q4_half) on the byte kernel's one-row cases against onnxruntime:
    the fp16 (and bf16) ones with integer zero points and blocks of 32 or more take it, whole rows
    under a norm prologue and rows split along K; the others (fp32, float zero points, blocks of 16)
    keep the word kernel."""
    launches = INT4_HALF.launches()
    split = launches.get("linear_row_q4_half_split", 0)
    assert split >= 5 and launches.get("linear_row_q4_half", 0) - split >= 5, launches


@runs(
    INT4_STREAM := interpreted(
        ONE_ROW_INT4_CASES,
        ONNXGEN_TRITON_LINEAR="1",
        ONNXGEN_TRITON_Q4="1",
        ONNXGEN_Q4_HALF="all",
        ONNXGEN_Q4_STREAM="2",
        # whole rows in one tile of 4 rows: every product of more than 8 rows on 2 streaming programs
        ONNXGEN_GEMV_Q4="4,4096,2,2",
    )
)
def test_int4_streaming_pair_kernel_parity_through_the_triton_interpreter() -> None:
    """Option q4_stream (gpu/linear_q4_half.py's _q4h_stream_kernel: few programs, each over many row
    blocks with the next one's loads ahead) on the byte kernel's one-row cases against onnxruntime:
    zero point kinds, block sizes, bias, the norm and SiLU prologues, fp16 and bf16."""
    launches = INT4_STREAM.launches()
    assert launches.get("linear_row_q4_half_stream", 0) >= 10, launches


@runs(
    INT4_READY := interpreted(
        f"{ONE_ROW_INT4_CASES} or (matmul_nbits_8bit and not prompt)",
        ONNXGEN_TRITON_LINEAR="1",
        ONNXGEN_TRITON_Q4="1",
        ONNXGEN_Q4_ROW_READY="1",
        ONNXGEN_Q4_HALF="off",  # every one-row product on the byte kernels
    )
)
def test_int4_ready_weights_parity_through_the_triton_interpreter() -> None:
    """Option q4_row_ready (the byte kernels' weights made before the PDL wait) on the byte kernel's
    one-row cases, 4- and 8-bit: whole tiles with the prologues, and rows split along K."""
    launches = INT4_READY.launches()
    assert launches.get("linear_row_q4_split", 0) >= 1, launches
    assert launches.get("linear_row_q4", 0) - launches.get("linear_row_q4_split", 0) >= 10, launches


@runs(
    INT4_MODELS := interpreted(
        "growing_kv and int4 and fused and qwen2", ONNXGEN_TRITON_LINEAR="1", ONNXGEN_TRITON_Q4="1"
    )
)
def test_int4_models_take_the_4bit_kernels() -> None:
    """The whole-model int4 parity against onnxruntime through the default 4-bit kernels on the packed
    codes: one-row groups (prologues fused) in the decode steps, the split-K GEMM in the prompt. On
    tiny-qwen2 (biases, the tied head's GatherBlockQuantized); tiny-llama's int4 run is in the
    slow-marked full run."""
    launches = INT4_MODELS.launches()
    assert launches.get("linear_row_q4", 0) + launches.get("linear_row_q4_words", 0) >= 20, launches
    assert launches.get("matmul_q4_split", 0) >= 4 and launches.get("linear_row", 0) == 0, launches


@pytest.mark.slow
@runs(INT4_DENSE := interpreted("growing_kv and int4 and fused", ONNXGEN_TRITON_LINEAR="1", ONNXGEN_TRITON_Q4="0"))
def test_int4_groups_take_the_dense_row_kernel_over_the_dequantized_copy() -> None:
    """With ONNXGEN_TRITON_Q4=0, a one-row MatMulNBits group runs the dense kernel (prologue fused) over
    its dequantized weights: the whole-model int4 parity against onnxruntime."""
    launches = INT4_DENSE.launches()
    assert launches.get("linear_row", 0) >= 20 and launches.get("linear_row_q4", 0) == 0, launches


@runs(GQA_SMALL := interpreted("decode_model_heads[True-10-cpu]", ONNXGEN_GQA_DECODE="16,2"))
def test_gqa_decode_split_merge_through_the_triton_interpreter() -> None:
    """The attention kernel with 16-key blocks against onnxruntime: a decode over a 150-row buffer
    merges ten splits in one pass where the default 128-key blocks (the parity run) merge two."""
    small = GQA_SMALL.launches()
    assert small.get("gqa_decode", 0) >= 3, small  # its three decode steps


@pytest.mark.slow
@runs(GQA_LATE := interpreted("gqa_shared or gqa_fp16", ONNXGEN_GQA_EARLY="0"))
def test_gqa_decode_late_reads_through_the_triton_interpreter() -> None:
    """The opt-out setting ONNXGEN_GQA_EARLY=0 (settled inputs read after the wait) against onnxruntime."""
    late = GQA_LATE.launches()
    assert late.get("gqa_decode", 0) >= 20, late


@runs(
    PERSIST := interpreted(
        _SHORT_GROUPS,
        ONNXGEN_TRITON_LINEAR="1",
        ONNXGEN_GEMV_PERSIST="2",
    )
)
def test_persistent_one_tile_gemv_through_the_triton_interpreter() -> None:
    """The opt-in persistent one-tile GEMV (ONNXGEN_GEMV_PERSIST: fewer programs than row blocks,
    each looping over its blocks) on the fused one-row groups against onnxruntime."""
    launches = PERSIST.launches()
    assert launches.get("linear_row_persistent", 0) >= 10, launches


@runs(TAIL := interpreted("greedy_tail or generator_tail_fills", files=("tests/test_decode_tail.py",)))
def test_greedy_tail_kernel_through_the_triton_interpreter() -> None:
    """greedy_advance's argmax + position + mask kernel against torch.argmax (tests/test_decode_tail.py:
    ties across and inside blocks, NaN, an all -inf row, padded logits, a full cache), and a
    Generator's greedy tokens up to the cache's last row with it in the (CPU stand-in) graph,
    verified against eager steps and compared with eager decoding's tokens."""
    launches = TAIL.launches()
    assert launches.get("greedy_advance", 0) >= 20, launches


@runs(SAMPLED := interpreted("kernel_picks or host_tokens", files=("tests/test_sampled_decoding.py",)))
def test_sampled_draw_kernel_through_the_triton_interpreter() -> None:
    """noisy_argmax (penalties, temperature, min-p, Gumbel draw, counts, position, mask, host tokens)
    picks what the torch path picks, draw after draw, and NaN / inf / all -inf rows give -1
    (tests/test_sampled_decoding.py). Its top-k / top-p cuts (the slow-marked test there) and whole
    generations with it in the graph take minutes through the interpreter: run by hand (the
    commit's message says when), not here."""
    launches = SAMPLED.launches()
    assert launches.get("noisy_argmax", 0) >= 7 * 19 + 1, launches
    assert launches.get("noisy_argmax_cut", 0) >= 2 * 19, launches  # top-p alone's histograms


_SMALL_TILES = {"ONNXGEN_TRITON_LINEAR": "1", "ONNXGEN_GEMV_DENSE": "4,32,4"}


@runs(SPLIT := interpreted(_SHORT_GROUPS, ONNXGEN_GEMV_SPLIT="4,32,4", **_SMALL_TILES))
def test_split_k_gemvs_through_the_triton_interpreter() -> None:
    """Rows longer than one tile with small tiles (ONNXGEN_GEMV_DENSE / ONNXGEN_GEMV_SPLIT at 32):
    the long down projection runs the split-K kernel (no prologue and SiLU-mul; the norms keep the
    loop kernel) against onnxruntime."""
    split = SPLIT.launches()
    assert split.get("linear_row_split", 0) >= 1, split


@pytest.mark.slow
@runs(LOOP := interpreted(_GROUPS, ONNXGEN_GEMV_SPLIT="off", **_SMALL_TILES))
def test_loop_gemvs_through_the_triton_interpreter() -> None:
    """The same with split-K off (ONNXGEN_GEMV_SPLIT=off): the loop kernel everywhere."""
    loop = LOOP.launches()
    assert loop.get("linear_row", 0) >= 20 and loop.get("linear_row_split", 0) == 0, loop


@pytest.mark.slow
@runs(SPLIT_MODELS := interpreted("growing_kv and fused", ONNXGEN_GEMV_SPLIT="4,32,4", **_SMALL_TILES))
def test_split_k_gemvs_in_whole_model_decodes_through_the_triton_interpreter() -> None:
    """The split-K kernel in the tiny models' whole decodes against onnxruntime (minutes)."""
    split = SPLIT_MODELS.launches()
    assert split.get("linear_row_split", 0) >= 100, split


@runs(
    ROTARY := interpreted("mrope or rotary_embedding", files=("tests/test_ops_mrope.py", "tests/test_ops_contrib.py"))
)
def test_rotary_kernel_through_the_triton_interpreter() -> None:
    """RotaryEmbedding and MRotaryEmbedding (gpu/rotary.py) against onnxruntime: 3-D and 4-D inputs,
    partial rotary dims, halves and interleaved pairs, per-token and start positions, both
    multimodal section layouts with three position streams that differ."""
    launches = ROTARY.launches()
    assert launches.get("rotary", 0) >= 25, launches


# The CI runs above with their whole selections: every long row, dtype and real-model case again
INT4_ROW_FULL = interpreted(
    "matmul_nbits or (int4_group and (packed or apart))", ONNXGEN_TRITON_LINEAR="1", ONNXGEN_TRITON_Q4="1"
)
GQA_SMALL_FULL = interpreted("gqa_shared or gqa_fp16", ONNXGEN_GQA_DECODE="16,2")
SPLIT_FULL = interpreted(_GROUPS, ONNXGEN_GEMV_SPLIT="4,32,4", **_SMALL_TILES)
PERSIST_FULL = interpreted(_GROUPS, ONNXGEN_TRITON_LINEAR="1", ONNXGEN_GEMV_PERSIST="2")


@pytest.mark.slow
@runs(INT4_ROW_FULL, GQA_SMALL_FULL, SPLIT_FULL, PERSIST_FULL)
def test_every_case_of_the_ci_runs_through_the_triton_interpreter() -> None:
    int4 = INT4_ROW_FULL.launches()
    assert int4.get("linear_row_q4", 0) >= 10 and int4.get("matmul_q4_split", 0) >= 100, int4
    assert GQA_SMALL_FULL.launches().get("gqa_decode", 0) >= 20
    assert SPLIT_FULL.launches().get("linear_row_split", 0) >= 4
    assert PERSIST_FULL.launches().get("linear_row_persistent", 0) >= 20
