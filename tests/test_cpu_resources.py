"""CPU resources: threads under contention, memory kept, long prompts (chunked prefill), long generations
(KV growth in place). Real SmolLM2 packages (session fixture); the model oracle is onnxruntime."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from onnxgen.errors import InvalidInputError
from onnxgen.genai import Generator, SamplingParams
from onnxgen.models.builder import build_package
from onnxgen.models.random_source import TINY_CONFIGS, RandomSource
from onnxgen.threads import ThreadOptions, default_threads
from tests.conftest import onnxruntime_prompt_logits
from tests.test_capture_runtime import write_word_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter (torch's thread state is per process); its stdout."""
    drop = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY")
    full = {k: v for k, v in os.environ.items() if k not in drop}
    full.update(env, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


# -- threads -------------------------------------------------------------------------------------

_APPLY = (
    "import torch; from onnxgen.threads import ThreadOptions; "
    "{pre}print(ThreadOptions({args}).apply(), torch.get_num_threads())"
)


def test_default_threads_are_half_the_cores():
    assert default_threads(1) == 1 and default_threads(2) == 1 and default_threads(16) == 8
    cores = len(os.sched_getaffinity(0))
    assert _python(_APPLY.format(pre="", args="")) == f"{default_threads(cores)} {default_threads(cores)}"


def test_a_default_of_all_cores_yields_to_the_user_too():
    """ThreadOptions(default="all") (the batching server on the CPU): every usable core where nobody
    chose; the environment and an explicit count still win."""
    cores = len(os.sched_getaffinity(0))
    assert _python(_APPLY.format(pre="", args="default='all'")) == f"{cores} {cores}"
    assert _python(_APPLY.format(pre="", args="default='all'"), OMP_NUM_THREADS="1") == "1 1"
    assert _python(_APPLY.format(pre="", args="num_threads=1, default='all'")) == "1 1"
    with pytest.raises(InvalidInputError, match="'half' or 'all'"):
        ThreadOptions(default="most")


def test_the_batching_server_on_the_cpu_defaults_to_all_cores():
    from onnxgen.cli import serve_threads
    from onnxgen.server.options import ServeOptions

    given = ThreadOptions()
    assert serve_threads(given, ServeOptions(model_name="m")).default == "all"  # CPU: 8 at once by default
    assert serve_threads(given, ServeOptions(model_name="m", max_num_seqs=1)) is given  # one at a time
    assert serve_threads(given, ServeOptions(model_name="m", device="cuda", max_num_seqs=8)) is given


def test_user_thread_choices_win():
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("one core: the user's count and the default cannot differ")
    # the environment (torch caps OMP_NUM_THREADS at the cores, so ask for all of them: not the default)
    assert _python(_APPLY.format(pre="", args=""), OMP_NUM_THREADS=str(cores)) == f"{cores} {cores}"
    assert _python(_APPLY.format(pre="torch.set_num_threads(3); ", args="")) == "3 3"  # torch.set_num_threads
    assert _python(_APPLY.format(pre="", args="num_threads=2"), OMP_NUM_THREADS="3") == "2 2"  # explicit beats env
    # a later torch.set_num_threads is the user's too
    code = _APPLY.format(pre="ThreadOptions().apply(); torch.set_num_threads(3); ", args="")
    assert _python(code) == "3 3"


def test_generator_applies_thread_options(smollm2_packages):
    before = torch.get_num_threads()
    try:
        Generator(smollm2_packages["int4-gqa"], threads=ThreadOptions(num_threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_wait_policy_set_before_torch_loads(tmp_path):
    # the CLI prepares the environment before any command imports torch; a bad package then fails
    code = (
        "import os, sys; from onnxgen.cli import main; "
        f"rc = main(['generate', '-p', 'x', '-m', {str(tmp_path)!r}, '--omp-wait-policy', 'passive']); "
        "print(rc, os.environ.get('OMP_WAIT_POLICY'))"
    )
    assert _python(code) == "2 PASSIVE"
    # after torch is imported the policy cannot change: said once on stderr, environment untouched
    late = (
        "import torch, os; from onnxgen.threads import ThreadOptions; "
        "ThreadOptions(wait_policy='passive').prepare(); print(os.environ.get('OMP_WAIT_POLICY'))"
    )
    full = dict(os.environ, PYTHONPATH=str(ROOT))
    full.pop("OMP_WAIT_POLICY", None)
    done = subprocess.run([sys.executable, "-c", late], capture_output=True, text=True, env=full, timeout=120)
    assert done.stdout.strip() == "None" and "not applied: torch was imported" in done.stderr


def test_bad_thread_options_are_refused():
    with pytest.raises(InvalidInputError, match="num_threads must be a positive integer"):
        ThreadOptions(num_threads=0)
    with pytest.raises(InvalidInputError, match="wait_policy must be one of"):
        ThreadOptions(wait_policy="spin")


# -- memory --------------------------------------------------------------------------------------


def test_cpu_session_does_not_load_dynamo(smollm2_packages):
    """Loading and running a CPU model must not pull in torch._dynamo/sympy/triton (~140 MiB resident)."""
    code = (
        "import sys; from onnxgen.genai import Generator, SamplingParams; "
        f"g = Generator({str(smollm2_packages['int4-gqa'])!r}); "
        "g.generate('Hi', SamplingParams(max_new_tokens=2)); "
        "print([m for m in ('torch._dynamo', 'sympy', 'triton') if m in sys.modules])"
    )
    assert _python(code, OMP_NUM_THREADS="1") == "[]"


def test_external_weights_read_without_copies(smollm2_packages, monkeypatch):
    """A large external fp32/uint8 weight is read into its tensor directly: no proto copy of its bytes."""
    import onnx

    from onnxgen.runtime import model_io

    package = smollm2_packages["fp32-gqa"]  # the int4 package's embedding is the LM head's 4-bit codes
    model, base = model_io.load_model(package / "model.onnx")
    tensor = next(t for t in model.graph.initializer if t.name == "model.embed_tokens.weight")
    copies = []
    original = onnx.TensorProto.CopyFrom
    monkeypatch.setattr(onnx.TensorProto, "CopyFrom", lambda self, other: copies.append(1) or original(self, other))
    value = model_io.tensor_to_value(tensor, base)
    assert not copies
    # the oracle: numpy reading the span its external_data entries name
    info = {e.key: e.value for e in tensor.external_data}
    count = int(np.prod(tensor.dims))
    expected = np.fromfile(base / info["location"], dtype="<f4", count=count, offset=int(info.get("offset", 0)))
    assert value.dtype == torch.float32 and list(value.shape) == list(tensor.dims)
    np.testing.assert_array_equal(value.numpy().reshape(-1), expected)


def test_int4_packing_is_row_separable():
    """_int4pack_weight packs slices of _PACK_ROWS rows; the layout of a slice must not depend on the
    rows of other slices. torch's packing works in tiles of output rows whose height depends on the
    CPU (64 rows where AVX-512 is, fewer elsewhere), so _PACK_ROWS is a multiple of 64 and the slices
    here are 64 rows, the last one short (176 = 2 * 64 + 48) as an odd-sized lm_head's is."""
    from onnxgen.runtime.ops import contrib_quant

    assert contrib_quant._PACK_ROWS % 64 == 0
    codes = torch.randint(0, 16, (176, 128), dtype=torch.int32)
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)  # MatMulNBits' B, low nibble first
    old = contrib_quant._PACK_ROWS
    try:
        contrib_quant._PACK_ROWS = 64
        assert torch.equal(contrib_quant._int4pack_weight(packed, k=128, n=176), whole)
    finally:
        contrib_quant._PACK_ROWS = old


def test_8bit_planes_pack_in_row_slices():
    """8-bit codes as two 4-bit planes, [high nibbles' rows; low nibbles' rows], packed in slices of
    _PACK_ROWS rows of the stacked planes (64 here; 176 rows a plane, so a slice spans both): the
    same bytes as packing the two planes as one weight."""
    from onnxgen.runtime.ops import contrib_quant

    codes = torch.randint(0, 256, (176, 128), dtype=torch.int32)
    planes = torch.cat((codes >> 4, codes & 15))
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(planes.contiguous(), 1)
    old = contrib_quant._PACK_ROWS
    try:
        contrib_quant._PACK_ROWS = 64
        got = contrib_quant._int4pack_weight(codes.to(torch.uint8), k=128, n=176, bits=8)
    finally:
        contrib_quant._PACK_ROWS = old
    assert torch.equal(got, whole)


def test_8bit_planes_scales_and_zeros():
    """The planes' pairs: (16 s, (136 - zero_point) * s) for the high nibbles h and (s, 0) for the low
    ones l, so that (16 s) (h - 8) + (136 - z) s + s (l - 8) = (16 h + l - z) s; one byte per packed
    zero point, and 128 where there are none."""
    from onnxgen.runtime.ops import contrib_quant

    n, k, block = 176, 96, 32
    gen = torch.Generator().manual_seed(4)
    scales = torch.rand(n * 3, generator=gen) + 0.1
    zp = torch.randint(0, 256, (n, 3), generator=gen)
    old = contrib_quant._PACK_ROWS
    try:
        contrib_quant._PACK_ROWS = 64
        got = contrib_quant._int4pack_scales_zeros(
            scales, zp.to(torch.uint8).reshape(-1), k=k, n=n, block_size=block, bits=8
        )
        plain = contrib_quant._int4pack_scales_zeros(scales, None, k=k, n=n, block_size=block, bits=8)
    finally:
        contrib_quant._PACK_ROWS = old
    assert got.shape == (3, 2 * n, 2) and got.dtype == torch.bfloat16
    for row in (0, 63, 64, 130, 175):
        for b in range(3):
            scale = float(scales[row * 3 + b])
            high = torch.tensor([16 * scale, (136 - int(zp[row, b])) * scale]).to(torch.bfloat16)
            low = torch.tensor([scale, 0.0]).to(torch.bfloat16)
            assert torch.equal(got[b, row], high) and torch.equal(got[b, n + row], low), (row, b)
            assert torch.equal(plain[b, row], torch.tensor([16 * scale, 8 * scale]).to(torch.bfloat16)), (row, b)


def test_int4_scales_and_zeros_in_row_slices():
    """_int4pack_scales_zeros, made _PACK_ROWS rows at a time (64 here: 176 rows, the last slice
    short), is MatMulNBits' dequantization (code - zero_point) * scale as the kernel's pair (scale,
    (8 - zero_point) * scale) in bf16, [K / block, N, 2], for every row: packed 4-bit zero points
    (low nibble first, rows padded to whole bytes) and none (zero point 8)."""
    from onnxgen.runtime.ops import contrib_quant

    n, k, block = 176, 96, 32  # three blocks a row: the packed zero points pad each row to two bytes
    gen = torch.Generator().manual_seed(3)
    scales = torch.rand(n * 3, generator=gen) + 0.1
    zp = torch.randint(0, 16, (n, 4), generator=gen)
    zp[:, 3] = 0
    packed_zp = (zp[:, 0::2] | (zp[:, 1::2] << 4)).to(torch.uint8).reshape(-1)
    old = contrib_quant._PACK_ROWS
    try:
        contrib_quant._PACK_ROWS = 64
        got = contrib_quant._int4pack_scales_zeros(scales, packed_zp, k=k, n=n, block_size=block)
        plain = contrib_quant._int4pack_scales_zeros(scales, None, k=k, n=n, block_size=block)
    finally:
        contrib_quant._PACK_ROWS = old
    assert got.shape == (3, n, 2) and got.dtype == torch.bfloat16
    for row in (0, 63, 64, 130, 175):
        for b in range(3):
            scale = float(scales[row * 3 + b])
            want = torch.tensor([scale, (8 - int(zp[row, b])) * scale]).to(torch.bfloat16)
            assert torch.equal(got[b, row], want), (row, b)
            assert torch.equal(plain[b, row], torch.tensor([scale, 0.0]).to(torch.bfloat16)), (row, b)


def test_no_dequantized_copy_on_the_int4_path(smollm2_packages):
    from onnxgen.runtime.ops.contrib_quant import DEQUANT_CACHE

    DEQUANT_CACHE.clear()
    generator = Generator(smollm2_packages["int4-gqa"])
    generator.generate("Hi", SamplingParams(max_new_tokens=2))
    assert DEQUANT_CACHE.used == 0


# -- long prompts: chunked prefill ---------------------------------------------------------------


def _prompt_ids(generator: Generator, n: int) -> list[int]:
    text = "The quick brown fox jumps over the lazy dog while the river runs to the sea. " * 40
    ids = generator.encode(text)
    assert len(ids) >= n
    return ids[:n]


def test_chunked_prefill_matches_onnxruntime(smollm2_packages, capsys):
    pytest.importorskip("onnxruntime")
    package = smollm2_packages["fp32-gqa"]
    generator = Generator(package)
    generator.prefill_chunk = 128
    generator.prefill_progress_tokens = 200
    ids = _prompt_ids(generator, 300)  # chunks of 128, 128, 44
    rows = []
    run = generator.session.run_torch

    def spy(feeds, output_names=None):
        out = run(feeds, output_names)
        rows.append((feeds["input_ids"].shape[1], out["logits"].shape[1]))
        return out

    generator.session.run_torch = spy
    sequence = generator.engine.new_sequence(ids, SamplingParams(max_new_tokens=1))
    sequence.kv = generator.engine._new_kv(len(ids) + 1)
    with torch.inference_mode():
        ours = generator.engine._prefill(sequence, torch.tensor([ids])).float().numpy()
    # never more than a chunk of rows at once, and the logits of one row each (engine_model)
    assert rows == [(128, 1), (128, 1), (44, 1)]
    err = capsys.readouterr().err
    assert "prefill" in err and "300 tok" in err

    # the oracle: onnxruntime, the whole prompt in one pass of the same graph
    expected = onnxruntime_prompt_logits(package, ids)[-1]
    # fp32 tolerance: chunking changes the order of the attention's sums, onnxruntime its kernels
    scale = float(np.abs(expected).max())
    assert float(np.abs(ours - expected).max()) <= 2e-4 * scale


# -- long generations: dynamic KV grows in place -------------------------------------------------


def test_dynamic_kv_grows_in_place_with_same_tokens(tmp_path):
    """On a tiny random-weights package: the growth is the cache's, not the weights' (a real model's
    300 steps took most of this file's time on two cores)."""
    config = TINY_CONFIGS["tiny-llama"]
    package = build_package(RandomSource(config), tmp_path / "tiny", attention="gqa")
    write_word_tokenizer(package, config.vocab_size)
    generator = Generator(package, kv="dynamic")
    ids = list(range(3, 15))  # 12 prompt tokens
    params = SamplingParams(max_new_tokens=150, ignore_eos=True)
    storages = set()
    run = generator.session.run_torch

    def spy(feeds, output_names=None):
        storages.add(feeds["past_key_values.0.key"].untyped_storage().data_ptr())
        return run(feeds, output_names)

    generator.session.run_torch = spy
    grown = list(generator.generate_ids(ids, params))
    # 162 rows from a capacity of 64: 64 -> 128 -> 256, so three buffers over 150 steps
    assert len(storages) <= 3, f"{len(storages)} past buffers for {len(grown)} steps: the cache was copied"
    # the same tokens as the concatenating cache (present = cat(past, new), the onnxruntime-like layout)
    generator.engine._in_place = False
    assert list(generator.generate_ids(ids, params)) == grown
