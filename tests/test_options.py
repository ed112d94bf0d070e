"""onnxgen.options: every switch declared once, parsed with one clear error, overridable in scope.

The environment is read once (the first ``current()``); tests and benches change switches with
``override``/``using`` instead of setting variables and clearing private caches, so these tests
check that an override reaches the code that reads the switch, and that it ends with the block.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from onnxgen import options
from onnxgen.errors import OnnxgenError, OptionError
from onnxgen.options import KNOBS, Options, ShapeOverrides, from_env

ROOT = Path(__file__).resolve().parents[1]


def test_every_field_is_one_knob_with_its_own_variable() -> None:
    fields = [f.name for f in dataclasses.fields(Options)]
    assert sorted(k.field for k in KNOBS) == sorted(fields)
    assert len({k.env for k in KNOBS}) == len(KNOBS)
    assert all(k.trades and k.values for k in KNOBS)
    assert from_env({}) == Options()  # no variable set: the defaults


def test_environment_values_parse_to_fields() -> None:
    env = {
        "ONNXGEN_FUSE": "0",
        "ONNXGEN_TRITON": "0",
        "ONNXGEN_TRITON_LINEAR": "1",
        "ONNXGEN_TRITON_Q4": "0",
        "ONNXGEN_Q4_PROMPT": "gemm",
        "ONNXGEN_Q4_NORM_APART": "0",
        "ONNXGEN_PDL": "0",
        "ONNXGEN_GEMV_PERSIST": "2",
        "ONNXGEN_GEMV_TILE": "0",
        "ONNXGEN_GQA_DECODE": "16,2",
        "ONNXGEN_GQA_EARLY": "0",
        "ONNXGEN_DEQUANT_CACHE_MB": " 1.5 ",
        "ONNXGEN_INT8_ACTIVATIONS": " CPU",
        "ONNXGEN_CPU_INT4_GEMM": "0 ",
        "ONNXGEN_HOME": "/elsewhere",  # not a knob here (models/fetch.py reads it): ignored
    }
    opts = from_env(env)
    assert (opts.fuse, opts.triton, opts.triton_linear, opts.triton_q4, opts.pdl) == (False, False, "on", False, False)
    assert (opts.q4_prompt, opts.q4_norm_apart) == ("gemm", 0)
    assert (opts.gemv_persist, opts.gemv_tile, opts.gqa_decode, opts.gqa_early) == (2, False, (16, 2), False)
    assert (opts.dequant_cache_mb, opts.dequant_cache_bytes) == (1.5, int(1.5 * 2**20))
    assert (opts.int8_activations, opts.cpu_int4_gemm) == ("cpu", False)
    assert from_env({"ONNXGEN_TRITON_LINEAR": "auto"}).triton_linear == "auto"
    assert from_env({"ONNXGEN_DEQUANT_CACHE_MB": ""}).dequant_cache_mb is None  # empty: unset
    assert from_env({"TRITON_INTERPRET": "1"}).triton_interpret
    assert not from_env({"TRITON_INTERPRET": "true"}).triton_interpret  # as before: exactly 1 is on


def test_per_shape_variables_become_one_field() -> None:
    env = {
        "ONNXGEN_GEMV_DENSE": "4,32,4",
        "ONNXGEN_GEMV_DENSE_9728x896": "8,1024,8",
        "ONNXGEN_GEMV_SPLIT_896x4864": "off",
        "ONNXGEN_GEMV_Q4_151936x896": "16,8,4",
        "ONNXGEN_GEMV_DENSE_1x2": "",  # empty: unset, as before
    }
    opts = from_env(env)
    assert opts.gemv_dense.lookup(9728, 896) == (8, 1024, 8)  # the shape's own wins
    assert opts.gemv_dense.lookup(896, 896) == (4, 32, 4)
    assert opts.gemv_dense.lookup(1, 2) == (4, 32, 4)
    assert opts.gemv_split.lookup(896, 4864) == options.SPLIT_OFF and opts.gemv_split.lookup(1, 2) is None
    assert opts.gemv_q4 == ShapeOverrides(None, (((151936, 896), (16, 8, 4, 0)),))
    assert not Options().gemv_dense and options.env_names("ONNXGEN_GEMV_SPLIT_1x2")
    assert not options.env_names("ONNXGEN_HOME")


@pytest.mark.parametrize(
    "name,raw,accepted",
    [
        ("ONNXGEN_FUSE", "false", "expected 1 or 0"),
        ("ONNXGEN_TRITON_LINEAR", "yes", "expected 1 (on), 0 (off) or unset (auto)"),
        ("ONNXGEN_GEMV_PERSIST", "-1", "expected a number of programs per SM"),
        ("ONNXGEN_GEMV_DENSE", "4,32", "expected BLOCK_N,BLOCK_K,WARPS (3 positive integers)"),
        ("ONNXGEN_GEMV_DENSE_9728x896", "a,b,c", "expected BLOCK_N,BLOCK_K,WARPS"),
        ("ONNXGEN_GEMV_SPLIT", "on", "expected off or BLOCK_N,BLOCK_K,WARPS"),
        ("ONNXGEN_GEMV_Q4_151936x896", "16,1024,2,3", "(KERNEL 0: bytes, 1: words, 2: fp16 pairs;"),
        ("ONNXGEN_GEMM_Q4", "128,128,64,8,3,2", "BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES[,SWAP] (SWAP 0 or 1)"),
        ("ONNXGEN_GEMM_Q4_SPLIT", "16,32,128,4,3,4,2", "SPLITS 0: the kernel's count; WORDS 0 or 1"),
        ("ONNXGEN_GEMM_Q4_SPLIT_2048x1536", "16,32,128,4,3", "BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES,SPLITS,WORDS"),
        ("ONNXGEN_Q4_PROMPT", "fast", "expected auto, dequant, gemm or split"),
        ("ONNXGEN_GDN_CHUNKED_FROM", "-1", "expected a number of tokens (0: never)"),
        ("ONNXGEN_GDN_CHUNKED_TO", "all", "expected a number of tokens (0: no bound)"),
        ("ONNXGEN_CONV_PROMPT", "yes", "expected 1 or 0"),
        ("ONNXGEN_MOE_PAIRS_PER_EXPERT", "-0.5", "expected a number of (token, expert) pairs per expert"),
        ("ONNXGEN_MOE_PAIRS_PER_EXPERT", "half", "expected a number of (token, expert) pairs per expert"),
        ("ONNXGEN_MOE_GROUPED", "16,32,64,64", "expected BLOCK_M,BLOCK_N1,BLOCK_N2,K_STEP,WARPS"),
        ("ONNXGEN_MOE_PER_PAIR", "16,16384,0,8192", "expected FC1_ROWS,FC1_BYTES,FC2_ROWS,FC2_BYTES,WARPS"),
        ("ONNXGEN_MOE_PER_PAIR", "12,16384,0,8192,8", "FC1_ROWS must be a power of two 2-64"),
        ("ONNXGEN_MOE_PER_PAIR", "16,16384,3,8192,8", "FC2_ROWS 0 or a power of two 2-32"),
        ("ONNXGEN_MOE_PER_PAIR", "16,512,0,8192,8", "FC1_BYTES and FC2_BYTES must be powers of two 1024-65536"),
        ("ONNXGEN_MOE_PER_PAIR", "16,16384,0,8192,3", "WARPS 1, 2, 4, 8 or 16"),
        ("ONNXGEN_MOE_GROUPED", "24,32,64,64,4", "BLOCK_M must be 0, 16, 32, 64 or 128"),
        ("ONNXGEN_MOE_GROUPED", "0,32,64,8,4", "K_STEP must be a power of two 32-512"),
        ("ONNXGEN_MOE_GROUPED", "0,32,64,16,4", "K_STEP must be a power of two 32-512"),
        ("ONNXGEN_MOE_GROUPED", "0,32,64,32,4,2", "SWAP must be 0 (pairs as the product's rows) or 1"),
        ("ONNXGEN_MOE_GROUPED", "0,32,64,32,4,0,9", "STAGES must be 0 (the kernels' own) to 8"),
        ("ONNXGEN_GQA_DECODE", "100,8", "BLOCK_N must be a power of two >= 16"),
        ("ONNXGEN_GQA_DECODE", "128", "expected BLOCK_N,WARPS (two integers)"),
        ("ONNXGEN_DEQUANT_CACHE_MB", "-3", "expected a size in MB"),
        ("ONNXGEN_INT8_ACTIVATIONS", "some", "expected none, cpu or all"),
    ],
)
def test_a_bad_value_is_one_error_naming_the_variable(name: str, raw: str, accepted: str) -> None:
    with pytest.raises(OptionError) as caught:
        from_env({name: raw})
    assert str(caught.value) == f"{name}={raw!r}: " + str(caught.value).split(": ", 1)[1]
    assert accepted in str(caught.value) and str(caught.value).startswith(f"{name}={raw!r}")
    assert isinstance(caught.value, OnnxgenError) and isinstance(caught.value, ValueError)


def test_override_holds_inside_the_block_only() -> None:
    before = options.current()
    assert options.current() is before  # read once, the same object after
    with options.override(fuse=not before.fuse, gemv_dense={"9728x896": (8, 1024, 8), "*": "4,32,4"}) as inner:
        assert options.current() is inner and inner.fuse is not before.fuse
        assert inner.gemv_dense.lookup(9728, 896) == (8, 1024, 8) and inner.gemv_dense.lookup(2, 2) == (4, 32, 4)
        with options.override(gemv_dense=None, gemv_split="off"):
            assert not options.current().gemv_dense and options.current().fuse is inner.fuse
        assert options.current() is inner
    assert options.current() is before
    with pytest.raises(RuntimeError), options.override(pdl=False):
        raise RuntimeError("the block fails")
    assert options.current() is before  # restored on the way out of a failing block too


def test_override_refuses_unknown_fields_and_process_knobs() -> None:
    with pytest.raises(OptionError, match="no option 'fusion'"), options.override(fusion=False):
        pass
    flipped = not options.current().triton_interpret
    with pytest.raises(OptionError, match="TRITON_INTERPRET is fixed for the process"):
        with options.override(triton_interpret=flipped):
            pass


def test_overrides_reach_the_kernels_launch_tables() -> None:
    """The kernel modules read the options in force, and their per-shape plan cache follows it."""
    torch = pytest.importorskip("torch")
    linear_row = pytest.importorskip("onnxgen.runtime.gpu.linear_row")
    from onnxgen.runtime.gpu import gqa_decode, launch

    cpu = torch.device("cpu")
    default_plan = linear_row._row_plan(896, 4864, True, cpu)
    assert (default_plan.block_k, default_plan.split, default_plan.tile) == (1024, (8, 1024, 8), False)
    with options.override(gemv_split="off", gemv_dense={(896, 896): (2, 1024, 4)}, gemv_persist=3):
        assert linear_row._row_plan(896, 4864, True, cpu).split is None
        small = linear_row._row_plan(896, 896, True, cpu)
        assert (small.block_n, small.tile, small.resident) == (2, True, 3)
    linear_q4 = pytest.importorskip("onnxgen.runtime.gpu.linear_q4")
    from onnxgen.runtime.gpu import linear_q4_split

    row = torch.zeros(8, dtype=torch.float16)
    assert options.current().triton_q4 and launch.q4_kernels_serve(row) == launch.triton_serves(row)
    with options.override(triton_q4=False):
        assert not launch.q4_kernels_serve(row)
    with options.override(gemv_tile=False, gqa_decode=(16, 2), gqa_early=False, triton_q4=True):
        assert not linear_row._row_plan(896, 896, True, cpu).tile
        assert gqa_decode.decode_config() == (16, 2) and not gqa_decode.early_reads_enabled()
        assert launch.q4_kernels_serve(row) == launch.triton_serves(row)
    with options.override(gemv_q4="8,512,2", gemm_q4="32,64,64,4,2"):
        assert linear_q4._q4_plan(896, 896, 32, cpu)[0] == (8, 512, 2, 0)
        assert linear_q4.gemm_q4_config(100, 896, 896) == (32, 64, 64, 4, 2, 0)
    with options.override(gemm_q4="128,128,64,8,3,1"):
        assert linear_q4.gemm_q4_config(1024, 896, 896) == (128, 128, 64, 8, 3, 1)
    with options.override(gemm_q4_split={"2048x1536": "16,64,256,8,2,3,0"}):
        assert linear_q4_split.split_gemm_config(16, 2048, 1536, 32, 132, True) == (16, 64, 256, 8, 2, 3, 0)
    with options.override(gemm_q4_split="16,64,256,8,2,0,0"):
        # SPLITS 0 keeps the rule's count: 32 column tiles on 132 SMs want 9 splits, 6 K tiles allow 6
        assert linear_q4_split.split_gemm_config(16, 2048, 1536, 32, 132, True) == (16, 64, 256, 8, 2, 6, 0)
    # the rule: 32 tiles want 9 splits of 12 K tiles, evened out to 6 of 2; 96 tiles want 3 splits;
    # a quantization block wider than the K tile widens the tile; words only where forced and the
    # layout allows them. Above 16 rows: 64-row tiles, 32 wide on a narrow layer (32 x 12 units of
    # work, under 8 per SM), 64 wide on a long K (48 x 70 units; 24 tiles want 11 splits of 70 K
    # tiles, evened out to 10 of 7)
    assert linear_q4_split.split_gemm_config(16, 1024, 1536, 32, 132, True) == (16, 32, 128, 4, 3, 6, 0)
    assert linear_q4_split.split_gemm_config(40, 1024, 1536, 256, 132, False) == (64, 32, 256, 4, 3, 6, 0)
    assert linear_q4_split.split_gemm_config(64, 1536, 8960, 32, 132, False) == (64, 64, 128, 4, 3, 10, 0)
    with options.override(gemm_q4_split="16,32,128,4,3,0,1"):
        assert linear_q4_split.split_gemm_config(16, 1024, 1536, 32, 132, True)[6] == 1
        assert linear_q4_split.split_gemm_config(16, 1024, 1536, 32, 132, False)[6] == 0
    with options.override(gemv_q4="8,512,2,1"):  # the fourth value picks the kernel over 32-bit words
        assert linear_q4._q4_plan(896, 896, 32, cpu) == ((8, 512, 2, 1), 0)
        assert linear_q4._q4_plan(896, 896, 32, cpu, 8) == ((8, 512, 2, 0), 0)  # the word kernel is 4-bit only
    # a fifth value streams the pair kernel for that shape alone, over option q4_stream
    with options.override(gemv_q4={"151936x896": "16,1024,2,2,3", "9728x896": "16,1024,2,2,0"}, q4_stream=2):
        assert linear_q4._q4_plan(151936, 896, 32, cpu, half=True) == ((16, 1024, 2, 2), 3)
        assert [linear_q4.stream_programs(n, 896, 16, 2, cpu) for n in (151936, 9728, 4864)] == [3, 0, 2]
    # auto (the default) on the CPU interpreter: 4 programs on 2 warps where each gets two row blocks
    assert [linear_q4.stream_programs(n, 896, 16, w, cpu) for n, w in ((128, 2), (112, 2), (128, 4))] == [4, 0, 0]
    with options.override(triton=False):
        assert not launch.triton_importable()
    assert linear_row._row_plan(896, 4864, True, cpu) == default_plan
    assert linear_q4._q4_plan(896, 896, 32, cpu)[0] == linear_q4.q4_config(896, 896, 32, cpu)


def test_overrides_reach_the_quantized_kernels_and_the_dequant_cap() -> None:
    pytest.importorskip("torch")
    from onnxgen.runtime.ops.contrib_quant import DEQUANT_CACHE

    with options.override(dequant_cache_mb=0):
        assert DEQUANT_CACHE.budget == 0
    with options.override(dequant_cache_mb=None):
        assert DEQUANT_CACHE.budget is None


def test_docs_carry_the_declared_table() -> None:
    """docs/options.md holds the table as ``python -m onnxgen.options`` prints it; README the user part."""
    assert options.markdown_table() in (ROOT / "docs" / "options.md").read_text()
    assert options.markdown_table("user") in (ROOT / "README.md").read_text()


def test_bench_variants_apply_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/step_sweep.py (and step_anatomy.py, which shares apply_env) put a variant in force with
    options.using; the two loop switches go to the decode engine as arguments, never the environment."""
    pytest.importorskip("torch")
    step_sweep = pytest.importorskip("bench.step_sweep")
    for key in step_sweep.LOOP_SWITCHES:
        monkeypatch.delenv(key, raising=False)
    before = options.current()
    name, env = step_sweep.parse_variant("split:ONNXGEN_GEMV_SPLIT=4,32,4,ONNXGEN_GQA_EARLY=0,ONNXGEN_HOST_TOKENS=0")
    assert (name, env["ONNXGEN_GEMV_SPLIT"]) == ("split", "4,32,4")
    try:
        step_sweep.apply_env(env)
        assert options.current().gemv_split.lookup(1, 2) == (4, 32, 4) and not options.current().gqa_early
        assert "ONNXGEN_HOST_TOKENS" not in step_sweep.os.environ
        assert step_sweep.engine_switches(None, env) == {"sample_in_graph": True, "host_tokens": False}
        step_sweep.apply_env({})  # the next variant: nothing of the last one leaks
        assert not options.current().gemv_split and options.current().gqa_early
        assert "ONNXGEN_HOST_TOKENS" not in step_sweep.os.environ
        with pytest.raises(SystemExit, match="unknown switch.*ONNXGEN_GEMV_SPLT"):
            step_sweep.apply_env({"ONNXGEN_GEMV_SPLT": "off"})
        with pytest.raises(OptionError, match="ONNXGEN_PDL='2'"):
            step_sweep.check_variant({"ONNXGEN_PDL": "2"})
    finally:
        step_sweep._IN_FORCE.close()
    assert options.current() is before


@pytest.mark.parametrize(
    "field,value,accepted",
    [
        ("triton_linear", "yes", "expected one of auto, on, off"),
        ("fuse", 0, "expected True or False"),
        ("gemv_persist", -1, "expected a number of programs per SM"),
        ("gqa_decode", (100, 8), "BLOCK_N must be a power of two"),
        ("gdn_prompt", (12, 4), "BLOCK_V must be a power of two 4-128"),
        ("gdn_prompt", (16, 3), "WARPS 1, 2, 4 or 8"),
        ("dequant_cache_mb", "big", "expected MB"),
        ("gemv_dense", (4, 32), "expected BLOCK_N,BLOCK_K,WARPS"),
        ("gemv_q4", {"9728x896": "1,2"}, "expected BLOCK_N,BLOCK_K,WARPS"),
        ("gemv_q4", "16,1024,2,1,4", r"STREAM: programs per SM"),  # streams the pair kernel only
        ("gemv_q4", "16,1024,2,2,-1", r"STREAM: programs per SM"),
        ("gemv_q4", "16,1024,2,2,4,1", "expected BLOCK_N,BLOCK_K,WARPS"),
        ("gemm_q4", (16, 64, 128), "expected BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES"),
        ("gemv_split", {"9728-896": "off"}, "is not N x K"),
    ],
)
def test_an_override_is_checked_like_the_environment(field: str, value: object, accepted: str) -> None:
    with pytest.raises(OptionError, match=f"option {field}.*{accepted}"), options.override(**{field: value}):
        pass


def test_override_values_in_their_own_types() -> None:
    with options.override(gqa_decode=(64, 4), gemv_persist=2, dequant_cache_mb=0.5, triton_linear="off") as o:
        assert (o.gqa_decode, o.gemv_persist, o.dequant_cache_mb, o.triton_linear) == ((64, 4), 2, 0.5, "off")
    with options.override(gqa_decode=None, dequant_cache_mb=None, gemv_split={"*": "off", (1, 2): (4, 32, 4)}) as o:
        assert o.gqa_decode is None and o.dequant_cache_mb is None
        assert o.gemv_split.lookup(3, 4) == options.SPLIT_OFF and o.gemv_split.lookup(1, 2) == (4, 32, 4)
