"""The MoE / QMoE expert kernels (gpu/moe_experts.py) against the torch path of the ops that
dispatch to them (runtime/ops/contrib_moe.py), which tests/test_ops_moe.py holds to onnxruntime.

On the CPU the kernels run through Triton's interpreter in a child process
(test_kernels_match_the_torch_path_through_the_triton_interpreter; tests/interpreted_kernels.py);
on CUDA directly (gpu mark), and once more on the Qwen3.5-35B-A3B layer shape, eagerly and
replayed from a CUDA graph. The kernels compile for sm_90 here (test_*_compiles), without a GPU.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import pytest
import torch

from onnxgen import options
from onnxgen.runtime.gpu.launch import LAUNCHES, interpreting, triton_importable
from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.contrib_moe import moe, qmoe
from tests.interpreted_kernels import HAS_CUDA, KERNEL_DEVICES, LaunchSpy, assert_close_to_torch_path
from tests.interpreted_runs import IN_THE_PARENT, interpreted_file, runs

MS = "com.microsoft"
KERNEL = "moe_experts"


def _ctx(op: str, device: str, **attrs: object) -> NodeContext:
    return NodeContext(op, op, MS, 1, attrs, torch.device(device), 14, 1, (True,))


def _kernel_vs_torch(run: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``run`` (an op call) takes the kernels once and matches the torch path (triton off); on CUDA
    it also repeats itself bit for bit (the interpreter's numpy always does). Returns the kernels'
    output."""
    before = LAUNCHES[KERNEL]
    fused = run()
    assert LAUNCHES[KERNEL] == before + 1, "the MoE kernels did not run"
    if fused.is_cuda:
        assert torch.equal(run(), fused), "a second run differs"
    with options.override(triton=False):
        reference = run()
    assert_close_to_torch_path(fused, reference)
    return fused


def _per_pair_vs_torch(run: Callable[[], torch.Tensor]) -> torch.Tensor:
    """_kernel_vs_torch with the bound at 4 pairs per expert, so that these small prompts (up to 3
    pairs per expert) stay on the per-pair kernels, whose forms the cases cover."""
    with options.override(moe_pairs_per_expert=4):
        return _kernel_vs_torch(run)


class _Inputs:
    """Random tokens, router logits and expert tensors, made on the CPU and moved to the device."""

    def __init__(self, device: str, dtype: torch.dtype, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.device, self.dtype = device, dtype

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen) * scale).to(self.device, self.dtype)

    def codes(self, *shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, generator=self.gen, dtype=torch.uint8).to(self.device)


def _activation_attrs(activation: str, k: int, fusion: int, **extra: object) -> dict:
    return {"activation_type": activation, "k": k, "swiglu_fusion": fusion, "normalize_routing_weights": 1, **extra}


# ---------------------------------------------------------------- MoE (dense experts)

# (activation, swiglu_fusion, k, tokens, biases, extra attributes)
MOE_CASES = {
    "swiglu_interleaved": ("swiglu", 1, 2, 1, False, {}),  # the builder's layout, a decode step
    "swiglu_concatenated_bias": ("swiglu", 2, 2, 3, True, {}),
    "swiglu_fc3_limit": (
        "swiglu",
        0,
        3,
        2,
        True,
        {"swiglu_limit": 0.4, "activation_alpha": 1.702, "activation_beta": 1.0},
    ),  # fmt: skip
    "relu": ("relu", 0, 1, 2, True, {}),
    "gelu": ("gelu", 0, 3, 2, False, {"normalize_routing_weights": 0}),
    "silu": ("silu", 0, 2, 1, True, {}),
    "identity": ("identity", 0, 1, 3, False, {}),
}


def _moe_inputs(case: str, device: str, dtype: torch.dtype, experts: int = 8, hidden: int = 40, inter: int = 24):
    activation, fusion, k, tokens, biases, extra = MOE_CASES[case]
    inp = _Inputs(device, dtype, seed=len(case))
    width = 2 * inter if activation == "swiglu" and fusion else inter
    w1 = inp.randn(experts, width, hidden, scale=hidden**-0.5)
    w2 = inp.randn(experts, hidden, inter, scale=inter**-0.5)
    w3 = inp.randn(experts, inter, hidden, scale=hidden**-0.5) if activation == "swiglu" and not fusion else None
    b1 = inp.randn(experts, width, scale=0.1) if biases else None
    b2 = inp.randn(experts, hidden, scale=0.1) if biases else None
    b3 = inp.randn(experts, inter, scale=0.1) if biases and w3 is not None else None
    x, router = inp.randn(tokens, hidden), inp.randn(tokens, experts, scale=2.0)
    return _activation_attrs(activation, k, fusion, **extra), [x, router, w1, b1, w2, b2, w3, b3]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("case", list(MOE_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_moe_kernels_match_the_torch_path(device: str, case: str, dtype: torch.dtype) -> None:
    attrs, inputs = _moe_inputs(case, device, dtype)
    _per_pair_vs_torch(lambda: moe(_ctx("MoE", device, **attrs), *inputs))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_moe_kernels_bf16(device: str) -> None:
    attrs, inputs = _moe_inputs("swiglu_concatenated_bias", device, torch.bfloat16)
    _per_pair_vs_torch(lambda: moe(_ctx("MoE", device, **attrs), *inputs))


# ---------------------------------------------------------------- QMoE (integer experts)


def _quantized(inp: _Inputs, experts: int, n: int, k: int, bits: int, block: int, zero_points: bool):
    """(codes [E, N, K * bits / 8], scales [E, N, K / block] or per row [E, N], packed zero points or
    None): random codes; scales that keep a row's product near unit size."""
    codes = inp.codes(experts, n, k * bits // 8)
    step = (1 << (bits - 1)) * k**0.5
    if block:
        scales = (torch.rand(experts, n, k // block, generator=inp.gen) + 0.5) / step
        zeros = inp.codes(experts, n, -(-(k // block) * bits // 8)) if zero_points else None
    else:
        scales = (torch.rand(experts, n, generator=inp.gen) + 0.5) / step
        zeros = inp.codes(experts, -(-n * bits // 8)) if zero_points else None
    return codes, scales.to(inp.device, inp.dtype), zeros


# (bits, block (0: per row), zero points, swiglu_fusion, k, tokens, biases)
QMOE_CASES = {
    "int4_blocks": (4, 16, False, 1, 2, 1, False),  # the builder's form (without zero points), a decode step
    "int4_blocks_zero_points": (4, 32, True, 1, 2, 3, True),  # the builder's form (with them), T > 1
    "int4_blocks_concatenated": (4, 16, True, 2, 3, 2, False),
    "int4_rows_zero_points_fc3": (4, 0, True, 0, 2, 2, True),
    "int4_rows": (4, 0, False, 2, 1, 3, False),
    "int8_blocks_zero_points": (8, 16, True, 1, 2, 2, True),
    "int8_rows": (8, 0, False, 0, 3, 1, False),
    "int8_rows_zero_points": (8, 0, True, 2, 2, 2, False),
}


def _qmoe_inputs(case: str, device: str, dtype: torch.dtype, *, tokens: int | None = None,
                 activation: str = "swiglu"):  # fmt: skip
    """QMoE over 8 experts, hidden 64, intermediate 48 (fc2's K: three blocks of 16; 32 for blocks of
    32), in the case's form; other activations than SwiGLU take fc1 alone."""
    bits, block, zero_points, fusion, k, t, biases = QMOE_CASES[case]
    experts, hidden, inter = 8, 64, 32 if block == 32 else 48
    inp = _Inputs(device, dtype, seed=len(case) + len(activation))
    swiglu = activation == "swiglu"
    width = 2 * inter if swiglu and fusion else inter
    fc1 = _quantized(inp, experts, width, hidden, bits, block, zero_points)
    fc2 = _quantized(inp, experts, hidden, inter, bits, block, zero_points)
    fc3 = (None, None, None)
    if swiglu and not fusion:
        fc3 = _quantized(inp, experts, inter, hidden, bits, block, zero_points)
    b1 = inp.randn(experts, width, scale=0.1) if biases else None
    b2 = inp.randn(experts, hidden, scale=0.1) if biases else None
    b3 = inp.randn(experts, inter, scale=0.1) if biases and fc3[0] is not None else None
    t = t if tokens is None else tokens
    x, router = inp.randn(t, hidden), inp.randn(t, experts, scale=2.0)
    attrs = _activation_attrs(activation, k, fusion if swiglu else 0, expert_weight_bits=bits)
    if block:
        attrs["block_size"] = block
    inputs = [x, router, fc1[0], fc1[1], b1, fc2[0], fc2[1], b2, fc3[0], fc3[1], b3, fc1[2], fc2[2], fc3[2]]
    return attrs, inputs


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("case", list(QMOE_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qmoe_kernels_match_the_torch_path(device: str, case: str, dtype: torch.dtype) -> None:
    attrs, inputs = _qmoe_inputs(case, device, dtype)
    _per_pair_vs_torch(lambda: qmoe(_ctx("QMoE", device, **attrs), *inputs))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("activation", ["relu", "gelu", "silu", "identity"])
def test_qmoe_kernels_plain_activations(device: str, activation: str) -> None:
    """fc1 alone (no up projection): 4-bit per-row scales with zero points and biases."""
    attrs, inputs = _qmoe_inputs("int4_rows_zero_points_fc3", device, torch.float32, activation=activation)
    _per_pair_vs_torch(lambda: qmoe(_ctx("QMoE", device, **attrs), *inputs))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_tokens_sharing_an_expert_and_prompts(device: str) -> None:
    """Two tokens whose top k overlap (an expert serves both); a prompt of more pairs than experts
    (the kernels take up to moe_pairs_per_expert * E pairs in place of the grouped torch path)."""
    attrs, inputs = _qmoe_inputs("int4_blocks_zero_points", device, torch.float32, tokens=2)
    router = inputs[1]
    router[1] = router[0] * 0.5  # the same top k, other routing weights
    chosen = router.float().softmax(-1).topk(2, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(chosen[0], chosen[1]), chosen
    _per_pair_vs_torch(lambda: qmoe(_ctx("QMoE", device, **attrs), *inputs))
    attrs, inputs = _qmoe_inputs("int4_blocks", device, torch.float16, tokens=12)  # 24 pairs over 8 experts
    _per_pair_vs_torch(lambda: qmoe(_ctx("QMoE", device, **attrs), *inputs))


def _widened(inputs: list) -> list:
    """The QMoE inputs with each packed 4-bit per-block zero point tensor [E, N, ceil(blocks / 2)] as
    int8 [E, N, blocks], a byte per block (what contrib_quant.widen_zero_points makes at load)."""
    out = list(inputs)
    for zero_at, scale_at in ((11, 3), (12, 6), (13, 9)):
        zero, scales = out[zero_at], out[scale_at]
        if zero is not None:
            nibbles = torch.stack((zero & 0xF, zero >> 4), dim=-1).flatten(-2)
            out[zero_at] = nibbles[..., : scales.shape[-1]].to(torch.int8).contiguous()
    return out


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("grouped", [False, True])
def test_widened_expert_zero_points_match_packed(device: str, grouped: bool) -> None:
    """Block-wise 4-bit expert zero points a byte per block (int8, ZERO_KIND 3 with per-block scales)
    give the packed form's output bit for bit, on the per-pair kernels (a decode step and a short
    prompt) and on the grouped ones (a long prompt), and match the torch path, which reads them too."""
    k = QMOE_CASES["int4_blocks_zero_points"][4]
    tokens = _prompt_tokens(k) if grouped else 3
    attrs, inputs = _qmoe_inputs("int4_blocks_zero_points", device, torch.float16, tokens=tokens)
    wide = _widened(inputs)
    assert wide[11].dtype == torch.int8 and wide[11].shape == inputs[3].shape
    (_grouped_vs_torch if grouped else _per_pair_vs_torch)(lambda: qmoe(_ctx("QMoE", device, **attrs), *wide))
    with options.override(**({} if grouped else {"moe_pairs_per_expert": 4})):
        packed = qmoe(_ctx("QMoE", device, **attrs), *inputs)
        assert torch.equal(qmoe(_ctx("QMoE", device, **attrs), *wide), packed)


def _qmoe_constant_experts() -> tuple:
    """tests/test_ops_moe.py's 4-bit block-wise QMoE with zero points (3 tokens, fp32; fc2's K 32: two
    blocks, one byte), its expert tensors made initializers, as a package holds them: (model, every
    tensor by name, the run's feeds x and router)."""
    from onnx import numpy_helper

    from tests.test_ops_moe import _qmoe

    model, feeds = _qmoe(3, 1, bits=4, block=16, zero_points=True)
    constant = [name for name in feeds if name not in ("x", "router")]
    model.graph.initializer.extend(numpy_helper.from_array(feeds[name], name) for name in constant)
    kept = [vi for vi in model.graph.input if vi.name not in constant]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    return model, feeds, {name: feeds[name] for name in ("x", "router")}


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_expert_zero_points_widened_at_load(device: str) -> None:
    """With option moe_zero_bytes (the default), a session on a device the Triton kernels serve holds a
    block-wise 4-bit QMoE's packed zero point initializers as int8 [E, N, blocks] (the values packed,
    the padding nibble gone), and its output matches onnxruntime's on the same model; with the option
    off, or with q4_zero_bytes off, they stay packed."""
    from onnxgen.runtime import InferenceSession
    from tests.conftest import ort_run

    model, feeds, runtime_feeds = _qmoe_constant_experts()
    expected = ort_run(model, runtime_feeds)[0]
    session = InferenceSession(model, device=device)
    for name in ("fc1_zp", "fc2_zp"):
        held = session.program.initializers[name]
        packed = torch.from_numpy(feeds[name])
        nibbles = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
        blocks = feeds[name.replace("_zp", "_s")].shape[-1]
        assert held.dtype == torch.int8 and torch.equal(held.cpu(), nibbles[..., :blocks].to(torch.int8)), name
    actual = session.run(None, runtime_feeds)[0]
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)
    with options.override(moe_zero_bytes=False):
        assert InferenceSession(model, device=device).program.initializers["fc1_zp"].dtype == torch.uint8
    with options.override(q4_zero_bytes=False, moe_zero_bytes=True):
        assert InferenceSession(model, device=device).program.initializers["fc1_zp"].dtype == torch.uint8


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_expert_zero_points_stay_packed_together(device: str) -> None:
    """A QMoE whose fc2 zero points another op reads too keeps them packed; its fc1 zero points,
    which nothing else reads, then stay packed as well (a node's zero points widen together or not at
    all), and the output still matches onnxruntime's."""
    from onnx import TensorProto, helper

    from onnxgen.runtime import InferenceSession
    from tests.conftest import ort_run

    model, _, runtime_feeds = _qmoe_constant_experts()
    model.graph.node.append(helper.make_node("Identity", ["fc2_zp"], ["fc2_zp_copy"]))
    model.graph.output.append(helper.make_tensor_value_info("fc2_zp_copy", TensorProto.UINT8, None))
    expected = ort_run(model, runtime_feeds)[0]
    session = InferenceSession(model, device=device)
    assert {name: session.program.initializers[name].dtype for name in ("fc1_zp", "fc2_zp")} == {
        "fc1_zp": torch.uint8, "fc2_zp": torch.uint8}  # fmt: skip
    np.testing.assert_allclose(session.run(None, runtime_feeds)[0], expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- long prompts (gpu/moe_grouped.py)

GROUPED = "moe_grouped"


def _grouped_vs_torch(run: Callable[[], torch.Tensor]) -> None:
    """``run`` takes the grouped kernels once (not the per-pair ones) and matches the torch path
    within the tolerance of its roundings (fp16 / bf16: the weights and h rounded to the activation
    dtype for the tensor cores, each one ulp, as a GEMM over dequantized weights rounds them); on
    CUDA it repeats itself bit for bit."""
    before, per_pair = LAUNCHES[GROUPED], LAUNCHES[KERNEL]
    fused = run()
    assert LAUNCHES[GROUPED] == before + 1 and LAUNCHES[KERNEL] == per_pair, "the grouped kernels did not run"
    if fused.is_cuda:
        assert torch.equal(run(), fused), "a second run differs"
    with options.override(triton=False):
        reference = run()
    assert_close_to_torch_path(fused, reference)


def _prompt_tokens(k: int) -> int:
    """Tokens whose pairs exceed what the per-pair kernels take over 8 experts, and leave a partial
    last tile."""
    return int(8 * options.current().moe_pairs_per_expert // k) + 7


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("case", list(QMOE_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_qmoe_kernels_match_the_torch_path(device: str, case: str, dtype: torch.dtype) -> None:
    k = QMOE_CASES[case][4]
    attrs, inputs = _qmoe_inputs(case, device, dtype, tokens=_prompt_tokens(k))
    _grouped_vs_torch(lambda: qmoe(_ctx("QMoE", device, **attrs), *inputs))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("case", list(MOE_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_moe_kernels_match_the_torch_path(device: str, case: str, dtype: torch.dtype) -> None:
    attrs, inputs = _moe_inputs(case, device, dtype)
    k = attrs["k"]
    tokens = _prompt_tokens(k)
    inp = _Inputs(device, dtype, seed=tokens)
    inputs[0], inputs[1] = inp.randn(tokens, inputs[0].shape[1]), inp.randn(tokens, inputs[1].shape[1], scale=2.0)
    _grouped_vs_torch(lambda: moe(_ctx("MoE", device, **attrs), *inputs))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", ["swiglu_concatenated_bias", "gelu"])
def test_grouped_moe_kernels_bf16(case: str) -> None:
    """bf16 on CUDA only: Triton's interpreter multiplies bf16 operands of tl.dot wrongly (a 16 x 16
    product comes out ~1e10 off; fp16 and fp32 are right)."""
    test_grouped_moe_kernels_match_the_torch_path("cuda", case, torch.bfloat16)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_pairs_per_expert_option_picks_the_kernels(device: str) -> None:
    """moe_pairs_per_expert moves the bound between the per-pair and the grouped kernels (more pairs
    per expert than the bound: grouped). Over 8 experts at k = 2: a prompt of 2 tokens (4 pairs)
    takes the per-pair kernels at a bound of 0.5 pairs per expert and the grouped ones at the
    default 0.25; a prompt of 3 (6 pairs) the grouped ones at 0.5 and the per-pair ones at 1; a
    one-token step keeps the per-pair kernels whatever the bound, 0 included."""
    attrs, inputs = _qmoe_inputs("int4_blocks", device, torch.float16, tokens=2)
    three = _qmoe_inputs("int4_blocks", device, torch.float16, tokens=3)
    assert options.current().moe_pairs_per_expert == 0.25
    _grouped_vs_torch(lambda: qmoe(_ctx("QMoE", device, **attrs), *inputs))
    with options.override(moe_pairs_per_expert=0.5):
        _kernel_vs_torch(lambda: qmoe(_ctx("QMoE", device, **attrs), *inputs))
        _grouped_vs_torch(lambda: qmoe(_ctx("QMoE", device, **three[0]), *three[1]))
    with options.override(moe_pairs_per_expert=1):
        _kernel_vs_torch(lambda: qmoe(_ctx("QMoE", device, **three[0]), *three[1]))
    with options.override(moe_pairs_per_expert=0):
        attrs, inputs = _qmoe_inputs("int4_blocks", device, torch.float16, tokens=1)
        _kernel_vs_torch(lambda: qmoe(_ctx("QMoE", device, **attrs), *inputs))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("swap", [0, 1])
def test_grouped_kernels_under_a_forced_tile(device: str, swap: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Option moe_grouped's tiles (a sweep's configuration: 32 pairs per tile, narrow fc1 and fc2
    tiles, a 32-element K step of two of these 16-element blocks, two warps, four pipeline stages;
    with and without the products swapped, weights first) reach both launches, and compute what the
    torch path does."""
    from onnxgen.runtime.gpu import moe_grouped

    fc1, fc2 = LaunchSpy(moe_grouped._grouped_fc1), LaunchSpy(moe_grouped._grouped_fc2)
    monkeypatch.setattr(moe_grouped, "_grouped_fc1", fc1)
    monkeypatch.setattr(moe_grouped, "_grouped_fc2", fc2)
    attrs, inputs = _qmoe_inputs("int4_blocks", device, torch.float16, tokens=_prompt_tokens(2))
    with options.override(moe_grouped=(32, 16, 32, 32, 2, swap, 4)):
        _grouped_vs_torch(lambda: qmoe(_ctx("QMoE", device, **attrs), *inputs))
    launches = (fc1.launches[0], fc2.launches[0])
    tiles = [(k["BLOCK_M"], k["BLOCK_N"], k["NB"], k["num_warps"], k["SWAP"], k["num_stages"]) for k in launches]
    assert tiles == [(32, 16, 2, 2, bool(swap), 4), (32, 32, 2, 2, bool(swap), 4)], tiles


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_per_pair_kernels_under_forced_tiles(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Option moe_per_pair's tiles (a sweep's configuration: 4 fc1 rows, so 2 SwiGLU columns, per
    program, 8 fc2 rows per expert, two warps) reach both launches, in a decode step and a short
    prompt, and compute what the torch path does; unset, the rules' tiles (8 columns, 16 rows, 8
    warps) come back."""
    from onnxgen.runtime.gpu import moe_experts

    fc1, fc2 = LaunchSpy(moe_experts._moe_fc1_kernel), LaunchSpy(moe_experts._moe_fc2_kernel)
    monkeypatch.setattr(moe_experts, "_moe_fc1_kernel", fc1)
    monkeypatch.setattr(moe_experts, "_moe_fc2_kernel", fc2)
    step = _qmoe_inputs("int4_blocks", device, torch.float16)
    prompt = _qmoe_inputs("int4_blocks", device, torch.float16, tokens=3)

    def tiles() -> set[tuple[int, ...]]:
        launched = {(a["BLOCK_I"], a["NB"], a["num_warps"], b["BLOCK_N"], b["NB"], b["num_warps"])
                    for a, b in zip(fc1.launches, fc2.launches, strict=True)}  # fmt: skip
        fc1.launches.clear()
        fc2.launches.clear()
        return launched

    with options.override(moe_per_pair=(4, 1024, 8, 1024, 2)):
        _kernel_vs_torch(lambda: qmoe(_ctx("QMoE", device, **step[0]), *step[1]))
        _per_pair_vs_torch(lambda: qmoe(_ctx("QMoE", device, **prompt[0]), *prompt[1]))
    assert tiles() == {(2, 4, 2, 8, 4, 2)}
    _kernel_vs_torch(lambda: qmoe(_ctx("QMoE", device, **step[0]), *step[1]))
    assert tiles() == {(8, 4, 8, 16, 4, 8)}


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_grouped_kernels_take_every_pair_on_one_expert(device: str) -> None:
    """Routing that sends every token to the same experts: one expert's pairs span many tiles
    (the most tiles a table can need past P / BLOCK_M), the other experts get none."""
    attrs, inputs = _qmoe_inputs("int4_blocks_zero_points", device, torch.float16, tokens=_prompt_tokens(2) * 3)
    inputs[1] = torch.zeros_like(inputs[1])
    inputs[1][:, 3], inputs[1][:, 5] = 4.0, 3.0
    _grouped_vs_torch(lambda: qmoe(_ctx("QMoE", device, **attrs), *inputs))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_quantization_blocks_past_the_grouped_limit_keep_the_torch_path(device: str) -> None:
    """Blocks of 256 (past moe_experts.GROUPED_MAX_BLOCK): a long prompt takes the torch path."""
    inp = _Inputs(device, torch.float32, seed=4)
    experts, hidden, inter = 8, 256, 256
    fc1 = _quantized(inp, experts, 2 * inter, hidden, 4, 256, False)
    fc2 = _quantized(inp, experts, hidden, inter, 4, 256, False)
    tokens = _prompt_tokens(2)
    x, router = inp.randn(tokens, hidden), inp.randn(tokens, experts, scale=2.0)
    attrs = _activation_attrs("swiglu", 2, 1, expert_weight_bits=4, block_size=256)
    inputs = [x, router, fc1[0], fc1[1], None, fc2[0], fc2[1], None, None, None, None, None, None, None]
    before = (LAUNCHES[GROUPED], LAUNCHES[KERNEL])
    qmoe(_ctx("QMoE", device, **attrs), *inputs)
    assert (LAUNCHES[GROUPED], LAUNCHES[KERNEL]) == before


if triton_importable():
    import triton
    import triton.language as tl

    from onnxgen.runtime.gpu.linear_q4 import _codes_less_zero_half

    @triton.jit
    def _half_dequant_kernel(w_ptr, zero_ptr, scale_ptr, out_ptr):
        """256 rows of 16 code bytes, one zero point and scale each, through _codes_less_zero_half."""
        rows = tl.arange(0, 256)
        w = tl.load(w_ptr + rows[:, None, None] * 16 + tl.arange(0, 16)[None, None, :])  # [256, 1, 16]
        offset = tl.load(zero_ptr + rows[:, None]).to(tl.float32) + 8388608.0  # 2^23 + zero, as loaded
        scale = tl.load(scale_ptr + rows[:, None]).to(tl.float32)
        v = tl.reshape(_codes_less_zero_half(w, offset, scale, 1, 32), (256, 32))
        tl.store(out_ptr + rows[:, None] * 32 + tl.arange(0, 32)[None, :], v)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_half_dequantization_equals_the_fp32_one_rounded(device: str) -> None:
    """The grouped kernels and the 4-bit prompt GEMMs dequantize 4-bit codes in fp16 arithmetic for
    fp16 activations (linear_q4._codes_less_zero_half); every code pair of a byte against every
    zero point, and scales from subnormal to large, must give (code - zero) * scale in fp32 rounded
    once to fp16, bit for bit (the torch path's weights)."""
    dtype = torch.float16
    gen = torch.Generator().manual_seed(5)
    codes = torch.arange(256, dtype=torch.uint8).repeat_interleave(16).view(256, 16)  # every byte, 16 times
    codes = codes[torch.randperm(256, generator=gen)]
    zeros = torch.arange(256, dtype=torch.uint8) % 16
    tiny = torch.finfo(dtype).tiny
    scales = torch.cat([torch.tensor([tiny / 8, tiny, 1.0, 1 / 3, 1e-3, 7.0e3]),
                        torch.randn(250, generator=gen).abs() * 0.02]).to(dtype)  # fmt: skip
    out = torch.empty(256, 32, dtype=dtype)
    args = [t.to(device) for t in (codes, zeros, scales, out)]
    _half_dequant_kernel[(1,)](*args)
    nibbles = torch.stack([codes & 0xF, codes >> 4], dim=-1).view(256, 32).float()
    expected = ((nibbles - zeros.float()[:, None]) * scales.float()[:, None]).to(dtype)
    assert torch.equal(args[3].cpu().view(torch.int16), expected.view(torch.int16))


def _group_pairs_by_sorting(chosen: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """group_pairs' results the other way round, with torch's stable sort, searchsorted and cumsum
    (what the torch ops of an earlier group_pairs did): the kernels' reference."""
    flat = chosen.reshape(-1).cpu()
    pairs = flat.numel()
    sorted_experts, order = torch.sort(flat, stable=True)
    bounds = torch.searchsorted(sorted_experts, torch.arange(experts + 1, dtype=flat.dtype))
    counts = bounds[1:] - bounds[:-1]
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    index = torch.arange(pairs // block_m + min(experts, pairs), dtype=tile_end.dtype)
    expert = torch.searchsorted(tile_end, index, right=True)
    e = expert.clamp(max=experts - 1)
    local = index - (tile_end[e] - tiles[e])
    rows = torch.where(expert < experts, (counts[e] - local * block_m).clamp(0, block_m), 0)
    return order, expert, bounds[e] + local * block_m, rows


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_group_pairs_tiles_by_hand(device: str) -> None:
    """The tile table of six pairs over four experts in tiles of two, worked out by hand: pairs
    sorted by expert (stable), expert 2's three pairs in two tiles, and empty tiles (expert E, no
    pairs) up to P // 2 + min(E, P) = 7."""
    from onnxgen.runtime.gpu.moe_grouped import group_pairs

    chosen = torch.tensor([[0, 2], [2, 0], [2, 1]], device=device)  # pairs 0..5: experts 0 2 2 0 2 1
    order, expert, first, rows = (t.tolist() for t in group_pairs(chosen, 4, 2))
    assert order == [0, 3, 5, 1, 2, 4]
    assert expert == [0, 1, 2, 2, 4, 4, 4]
    assert first[:4] == [0, 2, 3, 5]
    assert rows == [2, 1, 2, 1, 0, 0, 0]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_group_pairs_covers_every_pair_once(device: str) -> None:
    """Random and lopsided routings: every pair lies in exactly one tile, of its own expert, within
    the table's bound, and tiles never hold more than BLOCK_M pairs."""
    from onnxgen.runtime.gpu.moe_grouped import group_pairs

    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        experts, k, tokens, block = 16, 4, 37 + seed * 50, 16
        scores = torch.rand(tokens, experts, generator=gen) ** (1 + 3 * seed)  # later seeds favour few experts
        chosen = scores.topk(k, dim=-1).indices
        order, expert, first, rows = (t.cpu() for t in group_pairs(chosen.to(device), experts, block))
        flat = chosen.reshape(-1)
        seen = []
        for e, f, r in zip(expert.tolist(), first.tolist(), rows.tolist()):
            assert 0 <= r <= block and (r == 0) == (e == experts)
            pairs = order[f : f + r].tolist()
            assert all(flat[p] == e for p in pairs)
            seen += pairs
        assert sorted(seen) == list(range(tokens * k)), seed


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_group_pairs_matches_a_sort(device: str) -> None:
    """The grouping kernels against torch's stable sort, element for element: many pair blocks
    (the places count every earlier block), expert counts that are not powers of two, one expert
    taking every token, and the 35B-A3B layer's routing (256 experts, top 8) at a long prompt."""
    from onnxgen.runtime.gpu.moe_grouped import group_pairs

    gen = torch.Generator().manual_seed(7)
    cases = [(256, 8, 300, 16), (256, 8, 64, 64), (60, 4, 97, 32), (3, 2, 50, 16), (1, 1, 40, 16)]
    for experts, k, tokens, block in cases:
        chosen = torch.rand(tokens, experts, generator=gen).topk(k, dim=-1).indices
        if experts == 3:
            chosen[:, 0] = 2  # expert 2 in every token
        got = [t.cpu().long() for t in group_pairs(chosen.to(device), experts, block)]
        want = _group_pairs_by_sorting(chosen, experts, block)
        for name, g, w in zip(("order", "tile_expert", "tile_first", "tile_rows"), got, want, strict=True):
            assert torch.equal(g, w), (experts, k, tokens, block, name)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_long_rows_loop_over_k_and_unsettled_routing_waits_first(device: str, monkeypatch) -> None:
    """Chunk budgets small enough that rows span several K-chunks (the kernels' loop; fc1 and fc2
    both, partial last blocks in the dense case) in each weight form; and routing written by the
    PDL launch just before (EARLY off: the kernels wait first)."""
    from onnxgen.runtime.gpu import moe_experts

    monkeypatch.setattr(moe_experts, "_FC1_BYTES", 128)
    monkeypatch.setattr(moe_experts, "_FC2_BYTES", 128)
    monkeypatch.setattr(moe_experts, "_compute_block", lambda k: 16)  # per-row scales, dense
    for case in ("int4_blocks_concatenated", "int4_rows_zero_points_fc3", "int8_blocks_zero_points"):
        attrs, inputs = _qmoe_inputs(case, device, torch.float32)
        _per_pair_vs_torch(lambda: qmoe(_ctx("QMoE", device, **attrs), *inputs))  # noqa: B023
    attrs, inputs = _moe_inputs("swiglu_fc3_limit", device, torch.float16)
    _per_pair_vs_torch(lambda: moe(_ctx("MoE", device, **attrs), *inputs))
    monkeypatch.setattr(moe_experts, "settled_before_launch", lambda *tensors: False)
    attrs, inputs = _moe_inputs("swiglu_interleaved", device, torch.float32)
    _per_pair_vs_torch(lambda: moe(_ctx("MoE", device, **attrs), *inputs))


# ---------------------------------------------------------------- sm_90 compilation


def _signature(kernel, pointers: dict[str, str], floats: tuple[str, ...] = ()) -> dict[str, str]:
    return {name: pointers.get(name, "fp32" if name in floats else "i32") for name in kernel.arg_names}


@pytest.mark.skipif(interpreting() or not triton_importable(), reason="compiles the kernels (not interpreted)")
@pytest.mark.parametrize(
    ("bits", "per_row", "zero_kind", "act", "pdl", "early"),
    [(4, False, 1, 4, True, True), (4, False, 0, 4, True, True), (4, True, 3, 3, True, False),
     (8, False, 1, 4, False, False), (0, True, 0, 2, True, True), (4, False, 3, 4, True, True)],
)  # fmt: skip
def test_moe_kernels_compile(bits: int, per_row: bool, zero_kind: int, act: int, pdl: bool, early: bool) -> None:
    from onnxgen.runtime.gpu import moe_experts
    from tests.test_triton_compile import compile_for_sm90

    weight = "*fp16" if bits == 0 else "*u8"
    zeros = "*i8" if zero_kind == 3 and not per_row else "*u8"  # a byte per block (widened at load)
    ptrs = dict(x_ptr="*fp16", chosen_ptr="*i64", h_ptr="*fp32", w_ptr=weight, w3_ptr=weight, z_ptr=zeros,
                z3_ptr=zeros, route_ptr="*fp32", out_ptr="*fp16")  # fmt: skip
    ptrs.update(dict.fromkeys(["s_ptr", "s3_ptr", "b_ptr", "b3_ptr"], "*fp16"))
    form = dict(BITS=bits, PER_ROW=per_row, ZERO_KIND=zero_kind, QBLOCK=32, EARLY=early, PDL=pdl)
    fc1 = moe_experts._moe_fc1_kernel
    const = dict(ACT=act, HAS_LIMIT=True, HAS_BIAS=True, NB=16, BLOCK_I=8, **form)
    ptx1 = compile_for_sm90(fc1, _signature(fc1, ptrs, ("alpha", "beta", "limit")), const)
    fc2 = moe_experts._moe_fc2_kernel
    const = dict(HAS_BIAS=True, NB=4, KP=8, BLOCK_N=8, **form)
    ptx2 = compile_for_sm90(fc2, _signature(fc2, ptrs), const)
    for ptx in (ptx1, ptx2):
        if pdl:  # early: the routing and the weights stream before the wait, the activations after it
            wait = ptx.index("griddepcontrol.wait")
            assert (ptx.index("ld.global") < wait) == early and "ld.global" in ptx[wait:]
        if bits == 4 and zero_kind == 0:  # codes become floats by the exponent trick
            assert not re.findall(r"cvt\.rn\.f32\.[su]\d+", ptx)
        assert "atom" not in ptx  # no atomics: the sums' order is fixed


@pytest.mark.skipif(interpreting() or not triton_importable(), reason="compiles the kernels (not interpreted)")
@pytest.mark.parametrize(
    ("bits", "per_row", "zero_kind", "act", "dtype", "swap"),
    [(4, False, 1, 4, "fp16", False), (4, True, 3, 3, "bf16", False), (8, False, 0, 4, "fp16", False),
     (0, True, 0, 2, "fp32", False), (4, False, 1, 4, "fp16", True), (0, True, 0, 2, "fp32", True),
     (4, False, 3, 4, "fp16", True)],
)  # fmt: skip
def test_grouped_kernels_compile(bits: int, per_row: bool, zero_kind: int, act: int, dtype: str, swap: bool) -> None:
    """swap: option moe_grouped's SWAP, the weights as the products' first operand."""
    from onnxgen.runtime.gpu import moe_grouped
    from tests.test_triton_compile import assert_ptx_nibbles, compile_for_sm90

    weight = f"*{dtype}" if bits == 0 else "*u8"
    zeros = "*i8" if zero_kind == 3 and not per_row else "*u8"  # a byte per block (widened at load)
    ptrs = dict(x_ptr=f"*{dtype}", h_ptr=f"*{dtype}", w_ptr=weight, w3_ptr=weight, z_ptr=zeros, z3_ptr=zeros,
                route_ptr="*fp32", y_ptr="*fp32")  # fmt: skip
    ptrs.update(dict.fromkeys(["s_ptr", "s3_ptr", "b_ptr", "b3_ptr"], f"*{dtype}"))
    ptrs.update(dict.fromkeys(["order_ptr", "tile_expert_ptr", "tile_first_ptr", "tile_rows_ptr"], "*i32"))
    form = dict(BITS=bits, PER_ROW=per_row, ZERO_KIND=zero_kind, QBLOCK=32, NB=2, BLOCK_M=32,
                IEEE=dtype == "fp32", SWAP=swap)  # fmt: skip
    fc1 = moe_grouped._grouped_fc1
    const = dict(ACT=act, HAS_LIMIT=True, HAS_BIAS=True, BLOCK_N=32, **form)
    ptx1 = compile_for_sm90(fc1, _signature(fc1, ptrs, ("alpha", "beta", "limit")), const)
    fc2 = moe_grouped._grouped_fc2
    ptx2 = compile_for_sm90(fc2, _signature(fc2, ptrs), dict(HAS_BIAS=True, BLOCK_N=64, **form))
    for ptx in (ptx1, ptx2):
        assert "atom" not in ptx  # no atomics: the sums' order is fixed
        if dtype != "fp32":
            assert "mma" in ptx  # the products on tensor cores
        assert_ptx_nibbles(ptx, bits == 4 and dtype == "fp16" and zero_kind != 2)


@pytest.mark.skipif(interpreting() or not triton_importable(), reason="compiles the kernels (not interpreted)")
def test_grouping_kernels_compile() -> None:
    """The count kernel adds atomically (exact integer counts, in any order); the grouping kernel
    only reads them and writes each pair's place and the tile table."""
    from onnxgen.runtime.gpu import moe_grouped
    from tests.test_triton_compile import compile_for_sm90

    sig = dict(chosen_ptr="*i64", counts_ptr="*i32", pairs="i32")
    ptx = compile_for_sm90(moe_grouped._count_pairs_kernel, sig, dict(BLOCK=32))
    assert "atom" in ptx
    sig.update(dict.fromkeys(["order_ptr", "tile_expert_ptr", "tile_first_ptr", "tile_rows_ptr"], "*i32"))
    sig.update(dict.fromkeys(["experts", "tiles_total", "pair_programs"], "i32"))
    ptx = compile_for_sm90(moe_grouped._group_pairs_kernel, sig, dict(BLOCK_M=16, E_PAD=256, BLOCK=32))
    assert "st.global" in ptx and "atom" not in ptx


# ---------------------------------------------------------------- routing (gpu/moe_routing.py)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(("tokens", "experts", "k", "normalize"), [(5, 8, 2, True), (3, 256, 8, True),
                                                                  (4, 60, 3, False), (1, 7, 7, True)])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_routing_kernel_matches_softmax_and_top_k(
    device: str, tokens: int, experts: int, k: int, normalize: bool, dtype: torch.dtype
) -> None:
    """Softmax, top k (descending), renormalized or not, against torch's form on logits whose top k
    are well apart (no near-tie to order either way); a non-power-of-two expert count, k = E."""
    from onnxgen.runtime.gpu.moe_routing import route

    gen = torch.Generator().manual_seed(experts + k)
    # distinct logits spaced 0.05 apart, shuffled per token: every choice is clear-cut
    order = torch.stack([torch.randperm(experts, generator=gen) for _ in range(tokens)])
    logits = (order.float() * 0.05 - 3.0).to(device=device, dtype=dtype)
    before = LAUNCHES["moe_routing"]
    weights, chosen = route(logits, k, normalize)
    assert LAUNCHES["moe_routing"] == before + 1
    probs = torch.softmax(logits.float().cpu(), dim=-1)
    want_w, want_c = probs.topk(k, dim=-1)
    if normalize:
        want_w = want_w / want_w.sum(dim=-1, keepdim=True)
    assert torch.equal(chosen.cpu(), want_c)
    torch.testing.assert_close(weights.cpu(), want_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_routing_kernel_breaks_ties_by_the_lower_expert(device: str) -> None:
    """Equal probabilities come out lowest expert first (torch's top-k leaves that order open)."""
    from onnxgen.runtime.gpu.moe_routing import route

    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, 2.0]], device=device)
    weights, chosen = route(logits, 4, False)
    assert chosen.cpu().tolist() == [[1, 3, 5, 2]]
    w = weights.cpu()[0]
    assert w[0] == w[1] == w[2] and w[2] > w[3]


@pytest.mark.skipif(interpreting() or not triton_importable(), reason="compiles the kernel (not interpreted)")
@pytest.mark.parametrize("normalize", [True, False])
def test_routing_kernel_compiles(normalize: bool) -> None:
    from onnxgen.runtime.gpu import moe_routing
    from tests.test_triton_compile import compile_for_sm90

    sig = dict(logits_ptr="*fp16", weights_ptr="*fp32", chosen_ptr="*i64", experts="i32", row_stride="i32")
    ptx = compile_for_sm90(moe_routing._route_kernel, sig, dict(K=8, KP=8, NORMALIZE=normalize, BLOCK_E=256))
    assert "st.global" in ptx and "atom" not in ptx


# ---------------------------------------------------------------- the drivers


# CI interprets the per-form expert cases in fp16 and keeps fp32 for one form of each (the builder's
# zero-point blocks, the builder's interleaved SwiGLU), for the per-pair MoE cases, and in the long-row
# and shared-expert tests: the other fp32 forms run the same launches a dtype apart, for seconds each.
_FP32_AGAIN = (
    "dtype0 and (qmoe_kernels_match or grouped_moe_kernels_match)"
    " and not (int4_blocks_zero_points or swiglu_interleaved)"
)


@IN_THE_PARENT
@runs(KERNELS := interpreted_file(__file__, f"through_the_triton_interpreter or compile or ({_FP32_AGAIN})"))
def test_kernels_match_the_torch_path_through_the_triton_interpreter() -> None:
    KERNELS.launches()


@pytest.mark.slow
@IN_THE_PARENT
@runs(EVERY_CASE := interpreted_file(__file__, "through_the_triton_interpreter or compile"))
def test_every_case_through_the_triton_interpreter() -> None:
    EVERY_CASE.launches()


def _qwen35_moe_layer(tokens: int):
    """One routed-expert layer of the Qwen3.5-35B-A3B shape as onnxgen's int4 build writes it: 256
    experts, top 8 renormalized, SwiGLU interleaved, 4-bit blocks of 32 with zero points, fp16."""
    experts, hidden, inter = 256, 2048, 512
    inp = _Inputs("cuda", torch.float16, seed=0)
    fc1 = _quantized(inp, experts, 2 * inter, hidden, 4, 32, True)
    fc2 = _quantized(inp, experts, hidden, inter, 4, 32, True)
    x, router = inp.randn(tokens, hidden), inp.randn(tokens, experts, scale=2.0)
    attrs = _activation_attrs("swiglu", 8, 1, expert_weight_bits=4, block_size=32)
    inputs = [x, router, fc1[0], fc1[1], None, fc2[0], fc2[1], None, None, None, None, fc1[2], fc2[2], None]
    return attrs, inputs


def _replays_equal_eager(ctx: NodeContext, inputs: list) -> None:
    """The QMoE call recorded in a CUDA graph (after a warm-up that compiles every kernel); then,
    three times, new tokens and router logits written into the recorded inputs: each replay
    equals the eager call bit for bit."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        qmoe(ctx, *inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recorded = qmoe(ctx, *inputs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        inputs[0].copy_(torch.randn(inputs[0].shape, generator=gen))
        inputs[1].copy_(torch.randn(inputs[1].shape, generator=gen) * 2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(recorded, qmoe(ctx, *inputs))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_kernels_on_the_qwen35_35b_a3b_layer_shape() -> None:
    """An 8-token prompt (64 pairs over 256 experts: the most the per-pair kernels take by default)
    and a decode step of the layer against the torch path; then the step recorded in a CUDA graph:
    every replay equals the eager output bit for bit, with new tokens and routing written into the
    recorded inputs."""
    attrs, inputs = _qwen35_moe_layer(8)
    ctx = _ctx("QMoE", "cuda", **attrs)
    _kernel_vs_torch(lambda: qmoe(ctx, *inputs))
    inputs[0], inputs[1] = inputs[0][:1].clone(), inputs[1][:1].clone()
    _kernel_vs_torch(lambda: qmoe(ctx, *inputs))
    _replays_equal_eager(ctx, inputs)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_grouped_kernels_on_the_qwen35_35b_a3b_layer_shape() -> None:
    """A 16-token prompt (128 pairs, the bench's) and a 300-token prompt chunk (2,400 pairs) of the
    layer, both on the grouped kernels, against the torch path; then each recorded in a CUDA graph
    (the sort and the tile table included): every replay with new tokens and routing equals the
    eager call bit for bit."""
    for tokens in (16, 300):
        attrs, inputs = _qwen35_moe_layer(tokens)
        ctx = _ctx("QMoE", "cuda", **attrs)
        _grouped_vs_torch(lambda: qmoe(ctx, *inputs))  # noqa: B023 (called at once)
        _replays_equal_eager(ctx, inputs)
