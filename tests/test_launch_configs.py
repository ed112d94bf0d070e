"""The default Triton launch configurations per weight shape stay what the GPU sweeps chose.

The values below were recorded from gpu/linear_row.py and gpu/gqa_decode.py before the launch settings moved
into onnxgen.options (issue 16); a change to a tuning table must change this table too, on
purpose. CUDA devices are stood in by a fake SM count (the H200's 132), so this runs on the CPU.
Needs triton importable (the kernel modules define their kernels at import), not a GPU.
"""

from __future__ import annotations

import pytest
import torch

linear_row = pytest.importorskip("onnxgen.runtime.gpu.linear_row")
linear_q4 = pytest.importorskip("onnxgen.runtime.gpu.linear_q4")
gqa_decode = pytest.importorskip("onnxgen.runtime.gpu.gqa_decode")

H200_SMS = 132
CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")

# (N, K): dense (BLOCK_N, BLOCK_K, warps); split-K on a 132-SM GPU and on the CPU interpreter
# (None: the loop kernel; "tile": the row fits one tile, no split is considered); 4-bit
# (BLOCK_N, BLOCK_K, warps), the same for quantization blocks 16, 32, 64, 128 (BLOCK_K < K: split along K)
DEFAULTS = {
    # Qwen2.5-0.5B: qkv, o_proj, gate_up, down_proj, lm_head
    (1152, 896): ((4, 1024, 4), "tile", "tile", (16, 1024, 4, 0)),
    (896, 896): ((4, 1024, 4), "tile", "tile", (8, 1024, 4, 0)),
    (9728, 896): ((4, 1024, 4), "tile", "tile", (16, 1024, 2, 1)),
    (896, 4864): ((4, 1024, 8), (8, 1024, 8), (8, 1024, 8), (8, 512, 4, 0)),  # 8 rows: 2026-12-07 H100 sweep
    (151936, 896): ((4, 1024, 4), "tile", "tile", (16, 1024, 2, 1)),
    # Qwen2.5-1.5B
    (2048, 1536): ((4, 2048, 8), "tile", "tile", (16, 2048, 4, 0)),
    (1536, 1536): ((4, 2048, 8), "tile", "tile", (16, 2048, 4, 0)),
    (17920, 1536): ((4, 2048, 8), "tile", "tile", (16, 2048, 4, 1)),
    (1536, 8960): ((4, 1024, 8), None, (8, 1024, 8), (16, 512, 4, 0)),
    (151936, 1536): ((4, 2048, 8), "tile", "tile", (16, 2048, 4, 0)),
    # SmolLM2-135M
    (960, 576): ((4, 1024, 4), "tile", "tile", (8, 1024, 4, 0)),
    (576, 576): ((4, 1024, 4), "tile", "tile", (8, 1024, 4, 0)),
    (3072, 576): ((4, 1024, 4), "tile", "tile", (16, 1024, 4, 0)),
    (576, 1536): ((4, 2048, 8), "tile", "tile", (8, 2048, 4, 0)),
    (49152, 576): ((4, 1024, 4), "tile", "tile", (16, 1024, 2, 1)),
}


@pytest.fixture
def h200(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_row, "_multiprocessors", lambda index: H200_SMS)


@pytest.mark.parametrize("shape", list(DEFAULTS), ids=lambda s: f"{s[0]}x{s[1]}")
def test_default_gemv_configs(shape: tuple[int, int], h200: None) -> None:
    n, k = shape
    dense, split_cuda, split_cpu, q4 = DEFAULTS[shape]
    assert linear_row.dense_config(n, k) == dense
    if dense[1] >= k:
        assert split_cuda == split_cpu == "tile"
    else:
        assert linear_row.split_config(n, k, CUDA) == split_cuda
        assert linear_row.split_config(n, k, CPU) == split_cpu
    assert {linear_q4.q4_config(n, k, block, CUDA) for block in (16, 32, 64, 128)} == {q4}
    assert {linear_q4.q4_config(n, k, block, CPU) for block in (16, 32, 64, 128)} == {q4}  # 132 stand-in


# (N, K): the one-row 4-bit configuration where the fp16 pair kernel fits the product (fp16 / bf16
# activations, integer zero points), under q4_half=auto: the layers and tiles the H100 step sweeps of
# 2026-12-07 chose (docs/benchmarks/2026-12-07-h100-q4-half.md, -q4-stream.md): on the 0.5B shape gate_up
# and lm_head (16 x 1,024 on 2 warps), on the 1.5B shape every layer, gate_up in 8 x 2,048 tiles on 2 warps
HALF_DEFAULTS = {
    (1152, 896): (16, 1024, 4, 0),
    (896, 896): (8, 1024, 4, 0),
    (9728, 896): (16, 1024, 2, 2),
    (896, 4864): (8, 512, 4, 0),
    (151936, 896): (16, 1024, 2, 2),
    (2048, 1536): (16, 2048, 4, 2),
    (1536, 1536): (16, 2048, 4, 2),
    (17920, 1536): (8, 2048, 2, 2),
    (1536, 8960): (16, 512, 4, 2),
    (151936, 1536): (16, 2048, 4, 2),
}


@pytest.mark.parametrize("shape", list(HALF_DEFAULTS), ids=lambda s: f"{s[0]}x{s[1]}")
def test_fp16_pair_kernel_configs(shape: tuple[int, int]) -> None:
    """q4_half=auto puts the measured layers on the pair kernel (KERNEL 2); =all every layer, at the
    pair table's tiles where it has them and the byte / word table's elsewhere; =off none; and a
    product the pair kernel does not fit (half=False) keeps the byte / word table under any setting."""
    from onnxgen import options

    n, k = shape
    byte_or_word = DEFAULTS[shape][3]
    assert {linear_q4.q4_config(n, k, block, CUDA, half=True) for block in (32, 64, 128)} == {HALF_DEFAULTS[shape]}
    for setting in ("auto", "all", "off"):
        with options.override(q4_half=setting):
            assert linear_q4.q4_config(n, k, 32, CUDA, half=False) == byte_or_word
    with options.override(q4_half="off"):
        assert linear_q4.q4_config(n, k, 32, CUDA, half=True) == byte_or_word
    with options.override(q4_half="all"):
        config = linear_q4.q4_config(n, k, 32, CUDA, half=True)
    half = HALF_DEFAULTS[shape]
    assert config == (half if half[3] == 2 else (*byte_or_word[:3], 2))


# (N, K): programs per SM of the pair kernel's streaming form under q4_stream=auto (0: its tile form), at
# HALF_DEFAULTS' configuration on 132 SMs: the 1.5B gate_up (2,240 row blocks) and the 0.5B lm_head
# (9,496) at 4; the 0.5B gate_up has 608 blocks, under two per program; the 1.5B lm_head runs 4 warps
STREAM_DEFAULTS = {(9728, 896): 0, (151936, 896): 4, (2048, 1536): 0, (1536, 1536): 0, (17920, 1536): 4,
                   (151936, 1536): 0}  # fmt: skip


@pytest.mark.parametrize("shape", list(STREAM_DEFAULTS), ids=lambda s: f"{s[0]}x{s[1]}")
def test_streaming_table(shape: tuple[int, int], h200: None) -> None:
    """q4_stream=auto streams the measured layers at 4 programs per SM; a number forces every one-tile
    product (0: none), and a fifth gemv_q4 value one shape over both."""
    from onnxgen import options

    n, k = shape
    block_n, _, warps, kernel = HALF_DEFAULTS[shape]
    assert kernel == 2
    assert linear_q4.stream_programs(n, k, block_n, warps, CUDA) == STREAM_DEFAULTS[shape] * H200_SMS
    with options.override(q4_stream=2):
        assert linear_q4.stream_programs(n, k, block_n, warps, CUDA) == 2 * H200_SMS
        with options.override(gemv_q4={f"{n}x{k}": f"{block_n},1024,{warps},2,0"}):
            assert linear_q4.stream_programs(n, k, block_n, warps, CUDA) == 0
    with options.override(q4_stream=0):
        assert linear_q4.stream_programs(n, k, block_n, warps, CUDA) == 0


@pytest.mark.parametrize(
    ("n", "k", "block", "config"),
    [(1152, 896, 32, (16, 1024, 4, 0)), (896, 896, 32, (8, 1024, 4, 0)), (151936, 896, 32, (16, 1024, 4, 0)),
     (1536, 1536, 32, (16, 1024, 4, 0)), (896, 4864, 128, (16, 1024, 4, 0)), (2048, 1536, 2048, (16, 2048, 4, 0))],
)  # fmt: skip
def test_8bit_gemv_configs(n: int, k: int, block: int, config: tuple) -> None:
    """8-bit codes take the byte kernel: rows of up to 1,024 elements (as many bytes as 2,048 4-bit
    ones) in one tile, longer ones split along K in 1,024-element tiles (a block wider than that is the
    tile); never the 4-bit word kernel."""
    assert linear_q4.q4_config(n, k, block, CUDA, bits=8) == config


@pytest.mark.parametrize(
    ("n", "padded_k", "bits", "apart"),
    [(1152, 896, 4, False), (151936, 896, 4, True), (1536, 4096, 4, False), (896, 4864, 4, True),
     (2048, 1536, 8, False), (1536, 8960, 8, True), (896, 2048, 8, False), (896, 2080, 8, True)],
)  # fmt: skip
def test_norm_prologue_runs_apart_for_many_programs_or_long_rows(n: int, padded_k: int, bits: int, apart: bool):
    """A norm prologue stays in the one-row 4-/8-bit product unless the product has more programs
    than q4_norm_apart (the lm_head) or a row over twice the one-tile limit (4,096 4-bit or 2,048
    8-bit elements); q4_norm_apart=0 keeps it in everywhere."""
    from onnxgen import options

    assert linear_q4.norm_apart(n, 16, padded_k, bits) == apart
    with options.override(q4_norm_apart=0):
        assert not linear_q4.norm_apart(n, 16, padded_k, bits)


def test_default_attention_and_tile_settings() -> None:
    assert gqa_decode.decode_config() == (128, 8)
    assert gqa_decode.early_reads_enabled()
    assert linear_row.single_tile_enabled()
    assert linear_row.persistent_programs(CPU) == 0
