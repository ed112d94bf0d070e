"""The Triton kernels of hybrid decoders' steps and short prompts (gpu/gated_delta_decode.py, gpu/causal_conv_update.py)
against the torch path of the ops that dispatch to them (runtime/ops/linear_attention.py), which
tests/test_ops_extra.py and tests/test_ops_recurrent_ms.py hold to onnxruntime.

On the CPU the kernels run through Triton's interpreter, which must be on before triton defines a
kernel: test_kernels_match_the_torch_path_through_the_triton_interpreter runs this file again in a
child process with TRITON_INTERPRET=1, where the parity tests run (in a plain process they skip).
On CUDA they run directly (gpu mark), and once more on the qwen3.5-0.8b layer shape.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from onnxgen import options
from onnxgen.runtime.gpu.launch import LAUNCHES
from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.linear_attention import (
    causal_conv_with_state,
    causal_conv_with_state_ms,
    linear_attention,
    linear_attention_ms,
)
from tests.interpreted_kernels import HAS_CUDA, KERNEL_DEVICES, assert_close_to_torch_path
from tests.interpreted_runs import IN_THE_PARENT, interpreted_file, runs

MS = "com.microsoft"
# gpu/gated_delta_decode.MAX_SEQUENTIAL_TOKENS (imported there with triton; the tests check they agree)
MAX_SEQUENTIAL_TOKENS = 128


def _ctx(op: str, domain: str, device: str, num_inputs: int, **attrs: object) -> NodeContext:
    return NodeContext(
        op, op, domain, 27 if domain == "" else 1, attrs, torch.device(device), num_inputs, 2, (True, True)
    )


def _kernel_vs_torch(kernel: str, run: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``run`` (an op call) takes the fused kernel once and matches the torch path (triton off)."""
    before = LAUNCHES[kernel]
    fused = run()
    assert LAUNCHES[kernel] == before + 1, f"{kernel} did not run"
    with options.override(triton=False):
        reference = run()
    for actual, expected in zip(fused, reference, strict=True):
        assert_close_to_torch_path(actual, expected)


# ---------------------------------------------------------------- LinearAttention, one token

# (domain, q heads, kv heads, packed keys, d_k, d_v, batch, decay last dim, beta last dim)
#   decay / beta last dim: "h" per KV head, "hk" per key dim of each head, "1" shared, None absent
LA_CASES = {
    # onnxgen's builder: inverse GQA (more value heads than key heads), keys repeated per value head
    "builder": (MS, 2, 4, False, 16, 16, 2, "h", "h"),
    # onnxruntime-genai's export: keys packed per query head
    "packed_keys": (MS, 2, 4, True, 12, 20, 1, "h", "h"),
    # the standard op's GQA: two query heads per KV head; odd dims across two value tiles
    "gqa": ("", 6, 3, False, 9, 37, 3, "h", "h"),
    "per_key_dim_decay": ("", 2, 2, False, 8, 24, 2, "hk", "1"),
    "gated": (MS, 2, 2, False, 16, 8, 1, "1", None),
    "delta": (MS, 3, 3, False, 5, 7, 2, None, "h"),
    "linear": ("", 4, 2, False, 16, 16, 1, None, None),
}
_RULE = {(True, True): "gated_delta", (True, False): "gated", (False, True): "delta", (False, False): "linear"}


def _linear_attention_inputs(
    case: tuple, device: str, dtype: torch.dtype, state_dtype: torch.dtype | None, seed: int = 0, tokens: int = 1
) -> tuple[dict, list[torch.Tensor | None]]:
    domain, hq, hkv, packed, d_k, d_v, batch, decay_kind, beta_kind = case
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    q = rand(batch, tokens, hq * d_k, scale=d_k**-0.5)
    k = rand(batch, tokens, (hq if packed else hkv) * d_k, scale=d_k**-0.5)
    v = rand(batch, tokens, hkv * d_v)
    widths = {"h": hkv, "hk": hkv * d_k, "1": 1}
    decay = None
    if decay_kind is not None:  # log decays in (-1, 0): a forget factor per head or key dim
        decay = -torch.rand(batch, tokens, widths[decay_kind], generator=gen).to(device=device, dtype=dtype)
    beta = None if beta_kind is None else torch.rand(batch, tokens, widths[beta_kind], generator=gen).to(device, dtype)
    past = None
    if state_dtype is not None:
        past = torch.randn(batch, hkv, d_k, d_v, generator=gen).to(device=device, dtype=state_dtype)
    attrs = {"q_num_heads": hq, "kv_num_heads": hkv, "update_rule": _RULE[decay is not None, beta is not None]}
    return attrs, [q, k, v, past, decay, beta]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("case", list(LA_CASES))
@pytest.mark.parametrize(
    ("dtype", "state_dtype"),
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float16, torch.float32)],
)
def test_gated_delta_decode_matches_the_torch_path(
    device: str, case: str, dtype: torch.dtype, state_dtype: torch.dtype
) -> None:
    attrs, inputs = _linear_attention_inputs(LA_CASES[case], device, dtype, state_dtype)
    domain = LA_CASES[case][0]
    op = linear_attention_ms if domain == MS else linear_attention
    _kernel_vs_torch("gated_delta_decode", lambda: op(_ctx("LinearAttention", domain, device, 6, **attrs), *inputs))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(
    ("dtype", "state_dtype", "scale"),
    [(torch.bfloat16, torch.bfloat16, 0.0), (torch.float32, torch.float16, 0.3), (torch.bfloat16, None, 0.0)],
)
def test_gated_delta_decode_state_dtypes_scale_and_no_past(
    device: str, dtype: torch.dtype, state_dtype: torch.dtype | None, scale: float
) -> None:
    """bf16, a state narrower than the activations, the scale attribute, no past state (zeros;
    the present then takes the activations' dtype)."""
    attrs, inputs = _linear_attention_inputs(LA_CASES["builder"], device, dtype, state_dtype, seed=1)
    attrs["scale"] = scale
    _kernel_vs_torch("gated_delta_decode", lambda: linear_attention_ms(_ctx("LinearAttention", MS, device, 6, **attrs),
                                                                       *inputs))  # fmt: skip


# ---------------------------------------------------------------- prologues folded in (FusedLinearAttention)


def _folded_node(case: str, device: str, dtype: torch.dtype, tokens: int, norm: int):
    """FusedLinearAttention's node context and inputs for a LA_CASES case: the query and key as the
    per-head views [B, T, heads, d_k] the norms read (unnormalised: the op normalises them; a zero
    key head where ``norm`` is 2, LpNormalization's case), and the gate's a, b, dt_bias, decay_scale
    in place of decay and beta."""
    attrs, (q, k, v, past, _, _) = _linear_attention_inputs(LA_CASES[case], device, dtype, torch.float32, seed=7,
                                                            tokens=tokens)  # fmt: skip
    domain, hq, hkv, _, d_k = LA_CASES[case][:5]
    gen = torch.Generator().manual_seed(8)
    batch = q.shape[0]
    q4, k4 = q.reshape(batch, tokens, -1, d_k) * 3.0, k.reshape(batch, tokens, -1, d_k) * 3.0
    if norm == 2:
        k4[:, 0, 0] = 0.0
    a = torch.randn(batch, tokens, hkv, generator=gen).to(device, dtype)
    b = torch.randn(batch, tokens, hkv, generator=gen).to(device, dtype)
    dt_bias = torch.randn(hkv, generator=gen).to(device, dtype)
    decay_scale = -torch.rand(hkv, generator=gen).to(device, dtype)
    from onnxgen.runtime.ops.fused import FUSED_DOMAIN

    attrs = {**attrs, "inner_domain": domain, "qk_norm": norm, "qk_epsilon": 1e-6 if norm == 1 else 0.0}
    ctx = NodeContext("fused", "FusedLinearAttention", FUSED_DOMAIN, 1, attrs, torch.device(device), 10, 2,
                      (True, True))  # fmt: skip
    return ctx, [q4, k4, v, past, None, None, a, b, dt_bias, decay_scale]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("case", ["builder", "packed_keys"])
@pytest.mark.parametrize("norm", [1, 2])
@pytest.mark.parametrize(("dtype", "tokens"), [(torch.float32, 1), (torch.float16, 1), (torch.float16, 5)])
def test_folded_prologues_match_the_ops_one_by_one(
    device: str, case: str, norm: int, dtype: torch.dtype, tokens: int
) -> None:
    """The recurrence kernel with the q / k norms and the gate inside, against the ops it replaces
    run one after another (the L2 norm, LinearAttentionGate, then LinearAttention's torch path)."""
    from onnxgen.runtime.ops.fused_linear_attention import fused_linear_attention

    ctx, inputs = _folded_node(case, device, dtype, tokens, norm)
    _kernel_vs_torch("gated_delta_prologue", lambda: fused_linear_attention(ctx, *inputs))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_folded_prologues_of_a_long_prompt_run_the_ops_first(device: str) -> None:
    """Past the sequential kernel's run (by default the torch path's prompts), the folded ops run first
    as they would unfused: the prologue kernel does not run, and the result matches the torch path."""
    from onnxgen.runtime.ops.fused_linear_attention import fused_linear_attention

    ctx, inputs = _folded_node("builder", device, torch.float32, MAX_SEQUENTIAL_TOKENS + 1, 1)
    before = LAUNCHES["gated_delta_prologue"]
    fused = fused_linear_attention(ctx, *inputs)
    assert LAUNCHES["gated_delta_prologue"] == before
    with options.override(triton=False):
        reference = fused_linear_attention(ctx, *inputs)
    for actual, expected in zip(fused, reference, strict=True):
        assert_close_to_torch_path(actual, expected)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_unfolded_prompt_prologues_run_first(device: str) -> None:
    """Option gdn_prompt_fold off: a prompt runs the norms and the gate first and the sequential
    kernel without them (the prologue kernel does not run, the plain one does), matching the ops
    one by one; a one-token step keeps the folded kernel."""
    from onnxgen.runtime.ops.fused_linear_attention import fused_linear_attention

    ctx, inputs = _folded_node("builder", device, torch.float16, 5, 1)
    step_ctx, step = _folded_node("builder", device, torch.float16, 1, 1)
    launches = lambda: (LAUNCHES["gated_delta_prologue"], LAUNCHES["gated_delta_decode"])  # noqa: E731
    with options.override(gdn_prompt_fold=False):
        before = launches()
        fused = fused_linear_attention(ctx, *inputs)
        assert launches() == (before[0], before[1] + 1)
        fused_linear_attention(step_ctx, *step)
        assert launches()[0] == before[0] + 1  # (it counts as a gated_delta_decode launch too)
    with options.override(triton=False):
        reference = fused_linear_attention(ctx, *inputs)
    for actual, expected in zip(fused, reference, strict=True):
        assert_close_to_torch_path(actual, expected)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("tile", [(4, 1), (8, 2), (128, 8)])
def test_short_prompt_tiles_match_the_torch_path(device: str, tile: tuple[int, int]) -> None:
    """The prompt tile the gdn_prompt option forces (value columns per program, warps), narrower and
    wider than the step's, against the torch path."""
    from onnxgen import options

    attrs, inputs = _linear_attention_inputs(LA_CASES["builder"], device, torch.float16, torch.float16, tokens=7)
    with options.override(gdn_prompt=tile):
        _kernel_vs_torch("gated_delta_decode", lambda: linear_attention_ms(_ctx("LinearAttention", MS, device, 6,
                                                                                 **attrs), *inputs))  # fmt: skip


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("case", ["builder", "gqa", "per_key_dim_decay"])
@pytest.mark.parametrize("tokens", [2, 9])  # the longest run: the GPU test below (slow interpreted)
def test_short_prompts_take_the_kernel_and_match_the_torch_path(device: str, case: str, tokens: int) -> None:
    """A short prompt (T tokens, state in registers from token to token) against the torch path,
    whose chunked form computes T > 1 otherwise (per-key-dim decay: its sequential form)."""
    from onnxgen.runtime.gpu import gated_delta_decode

    assert gated_delta_decode.MAX_SEQUENTIAL_TOKENS == MAX_SEQUENTIAL_TOKENS
    attrs, inputs = _linear_attention_inputs(LA_CASES[case], device, torch.float32, torch.float32, tokens=tokens)
    domain = LA_CASES[case][0]
    op = linear_attention_ms if domain == MS else linear_attention
    _kernel_vs_torch("gated_delta_decode", lambda: op(_ctx("LinearAttention", domain, device, 6, **attrs), *inputs))
    attrs, inputs = _linear_attention_inputs(LA_CASES[case], device, torch.float16, torch.float16, tokens=tokens)
    _kernel_vs_torch("gated_delta_decode", lambda: op(_ctx("LinearAttention", domain, device, 6, **attrs), *inputs))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_long_prompts_take_the_chunked_kernel_windows_keep_the_torch_path(device: str) -> None:
    """Prompts longer than MAX_SEQUENTIAL_TOKENS take the chunked kernels where options
    gdn_chunked_from / gdn_chunked_to ask (by default from 17 tokens, with no upper bound); a state
    window and decays per key dim keep the torch path."""
    tokens = MAX_SEQUENTIAL_TOKENS + 1
    attrs, (q, k, v, past, decay, beta) = _linear_attention_inputs(LA_CASES["builder"], device, torch.float32,
                                                                   torch.float32, tokens=tokens)  # fmt: skip
    ctx = _ctx("LinearAttention", MS, device, 6, **attrs)
    launches = lambda: (LAUNCHES["gated_delta_decode"], LAUNCHES["gated_delta_chunked"])  # noqa: E731
    before = launches()
    with options.override(gdn_chunked_from=tokens, gdn_chunked_to=0):
        out, _ = linear_attention_ms(ctx, q, k, v, past, decay, beta)
        assert launches() == (before[0], before[1] + 1) and out.shape[1] == tokens
    with options.override(gdn_chunked_to=tokens - 1):  # bounded below the prompt: the torch path
        linear_attention_ms(ctx, q, k, v, past, decay, beta)
    one = [x[:, :1] for x in (q, k, v, decay, beta)]
    windowed = {**attrs, "state_window": 1}
    _, present = linear_attention_ms(_ctx("LinearAttention", MS, device, 6, **windowed), *one[:3], past[None],
                                     *one[3:])  # fmt: skip
    assert launches() == (before[0], before[1] + 1) and present.dim() == 5
    attrs, inputs = _linear_attention_inputs(LA_CASES["per_key_dim_decay"], device, torch.float32, torch.float32,
                                             tokens=tokens)  # fmt: skip
    linear_attention(_ctx("LinearAttention", "", device, 6, **attrs), *inputs)
    assert launches() == (before[0], before[1] + 1)


def test_prompt_lengths_route_to_the_kernels_that_won_them() -> None:
    """By default 2-16 tokens take the sequential kernel and every longer prompt the chunked kernels
    (the faster there: docs/benchmarks/2026-12-06-h200-gdn-chunked.md up to 128 tokens, beyond that
    2026-12-06-h100-memory-and-chunked.md against the torch path); gdn_chunked_to bounds them, and
    0 turns either bound off."""
    from onnxgen.runtime.ops.linear_attention import chunked_kernel_takes

    opts = options.current()
    taken = [chunked_kernel_takes(t, opts) for t in (1, 16, 17, 100, 128, 129, 1000)]
    assert taken == [False, False, True, True, True, True, True]
    with options.override(gdn_chunked_to=128):
        bounded = [chunked_kernel_takes(t, options.current()) for t in (17, 128, 129, 1000)]
        assert bounded == [True, True, False, False]
    with options.override(gdn_chunked_from=0, gdn_chunked_to=0):
        assert not any(chunked_kernel_takes(t, options.current()) for t in (2, 17, 1000))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("case", [case for case in LA_CASES if case != "per_key_dim_decay"])
@pytest.mark.parametrize("tokens", [3, 40])  # one partial chunk; a whole chunk and a partial one
def test_chunked_prompts_match_the_torch_path(device: str, case: str, tokens: int) -> None:
    """The chunked kernel (forced from 2 tokens on) on every head mapping and rule it serves, fp32 and
    fp16 over an fp16 state, against the torch path (whose chunked form solves the triangular
    system by substitution where the kernel multiplies out its inverse)."""
    domain = LA_CASES[case][0]
    op = linear_attention_ms if domain == MS else linear_attention
    with options.override(gdn_chunked_from=2):
        for dtype in (torch.float32, torch.float16):
            attrs, inputs = _linear_attention_inputs(LA_CASES[case], device, dtype, dtype, seed=3, tokens=tokens)
            ctx = _ctx("LinearAttention", domain, device, 6, **attrs)
            _kernel_vs_torch("gated_delta_chunked", lambda: op(ctx, *inputs))  # noqa: B023


def _gated_delta_net_inputs(device: str, tokens: int, heads: int, d: int, seed: int) -> list[torch.Tensor]:
    """What a Gated DeltaNet layer feeds LinearAttention: unit queries and keys (its L2 norms), values,
    log decays in (-5, 0) (decay_scale * softplus), betas in (0, 1) (a sigmoid), a state from earlier
    tokens."""
    gen = torch.Generator().manual_seed(seed)
    unit = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    q = unit(torch.randn(1, tokens, heads, d, generator=gen)).reshape(1, tokens, heads * d)
    k = unit(torch.randn(1, tokens, heads, d, generator=gen)).reshape(1, tokens, heads * d)
    v = torch.randn(1, tokens, heads * d, generator=gen)
    decay = -torch.nn.functional.softplus(torch.randn(1, tokens, heads, generator=gen)) * torch.rand(
        heads, generator=gen
    )
    beta = torch.sigmoid(torch.randn(1, tokens, heads, generator=gen))
    past = torch.randn(1, heads, d, d, generator=gen) * 0.1
    return [x.to(device) for x in (q, k, v, past, decay, beta)]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_chunked_kernel_over_a_long_prompt_stays_with_the_recurrence(device: str) -> None:
    """300 tokens of a Gated DeltaNet layer's inputs (unit keys, betas near 1 among them), fp32: the
    chunked kernel's outputs and state against the token-by-token recurrence (the sequential kernel,
    forced by option gdn_chunked_from=0 and a chunk of one: no chunked form at all)."""
    heads, d = 2, 32
    inputs = _gated_delta_net_inputs(device, 300, heads, d, seed=8)
    attrs = {"q_num_heads": heads, "kv_num_heads": heads, "update_rule": "gated_delta"}
    ctx = _ctx("LinearAttention", MS, device, 6, **attrs)
    before = LAUNCHES["gated_delta_chunked"]
    with options.override(gdn_chunked_from=65, gdn_chunked_to=0):
        out, state = linear_attention_ms(ctx, *inputs)
    assert LAUNCHES["gated_delta_chunked"] == before + 1
    with options.override(triton=False):
        one_by_one = _ctx("LinearAttention", MS, device, 6, **attrs, chunk_size=1)
        ref_out, ref_state = linear_attention_ms(one_by_one, *inputs)
    assert_close_to_torch_path(out, ref_out)
    assert_close_to_torch_path(state, ref_state)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_chunked_kernel_on_the_layer_head_dims(device: str) -> None:
    """The Qwen3.5 layers' head dims (128 key and value dims: whole 128-wide tiles, four value-dim tiles
    of the state) with inverse GQA (two value heads per key head), over 70 tokens (two whole 32-token
    chunks and a partial one) whose last row is 60 (a padded prompt), fp32: outputs up to the last
    row and the state against the torch path."""
    attrs, inputs = _linear_attention_inputs((MS, 2, 4, False, 128, 128, 1, "h", "h"), device, torch.float32,
                                             torch.float32, seed=5, tokens=70)  # fmt: skip
    rows = torch.tensor([60], dtype=torch.int64, device=device)
    ctx = _ctx("LinearAttention", MS, device, 7, **attrs)
    before = LAUNCHES["gated_delta_chunked"]
    with options.override(gdn_chunked_from=2):
        out, state = linear_attention_ms(ctx, *inputs, rows)
    assert LAUNCHES["gated_delta_chunked"] == before + 1
    with options.override(triton=False):
        ref_out, ref_state = linear_attention_ms(ctx, *inputs, rows)
    assert_close_to_torch_path(state, ref_state)
    assert_close_to_torch_path(out[:, :61], ref_out[:, :61])


# ---------------------------------------------------------------- CausalConvWithState, one position

# (domain, channels_last, channel axes, kernel width, dilation, batch, bias, activation)
CONV_CASES = {
    # onnxgen's builder and onnxruntime-genai: channels-last states [B, k - 1, C], SiLU, no bias
    "builder": (MS, True, (40,), 4, 1, 2, False, "silu"),
    "channels_last_axes": (MS, True, (3, 5), 3, 2, 1, True, "none"),
    "channels_first": (MS, False, (37,), 4, 1, 3, True, "swish"),
    "channels_first_dilated": (MS, False, (200,), 2, 3, 1, False, "silu"),
    "standard_op": ("", False, (24,), 4, 1, 2, True, "silu"),
}


def _conv_inputs(
    case: tuple, device: str, dtype: torch.dtype, state_dtype: torch.dtype | None, seed: int = 0, tokens: int = 1
) -> tuple[dict, list[torch.Tensor | None]]:
    domain, channels_last, axes, kernel, dilation, batch, has_bias, activation = case
    gen = torch.Generator().manual_seed(seed)
    channels = int(torch.tensor(axes).prod())
    carry = (kernel - 1) * dilation
    if channels_last:
        x = torch.randn(batch, tokens, *axes, generator=gen)
    else:
        x = torch.randn(batch, channels, tokens, generator=gen)
    weight = torch.randn(channels, 1, kernel, generator=gen) * 0.5
    bias = torch.randn(channels, generator=gen) if has_bias else None
    past = None
    if state_dtype is not None:
        shape = (batch, carry, *axes) if channels_last else (batch, channels, carry)
        past = torch.randn(*shape, generator=gen).to(device=device, dtype=state_dtype)
    attrs: dict = {"activation": activation}
    if domain == MS:
        attrs.update(channels_last=int(channels_last), dilation=dilation)
    on = [None if t is None else t.to(device=device, dtype=dtype) for t in (x, weight, bias)]
    return attrs, [*on, past]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("case", list(CONV_CASES))
@pytest.mark.parametrize(
    ("dtype", "state_dtype"),
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.float32)],
)
def test_causal_conv_update_matches_the_torch_path(
    device: str, case: str, dtype: torch.dtype, state_dtype: torch.dtype
) -> None:
    attrs, inputs = _conv_inputs(CONV_CASES[case], device, dtype, state_dtype)
    domain = CONV_CASES[case][0]
    op = causal_conv_with_state_ms if domain == MS else causal_conv_with_state
    _kernel_vs_torch("causal_conv_update", lambda: op(_ctx("CausalConvWithState", domain, device, 4, **attrs), *inputs))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("case", ["builder", "channels_first"])
def test_causal_conv_update_without_a_past_state(device: str, case: str) -> None:
    attrs, inputs = _conv_inputs(CONV_CASES[case], device, torch.float16, None, seed=2)
    ctx = _ctx("CausalConvWithState", MS, device, 4, **attrs)
    _kernel_vs_torch("causal_conv_update", lambda: causal_conv_with_state_ms(ctx, *inputs))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("case", list(CONV_CASES))
@pytest.mark.parametrize("tokens", [2, 37])
@pytest.mark.parametrize(("dtype", "state_dtype"), [(torch.float32, torch.float32), (torch.float16, torch.float32)])
def test_causal_conv_prompt_matches_the_torch_path(
    device: str, case: str, tokens: int, dtype: torch.dtype, state_dtype: torch.dtype
) -> None:
    """A prompt of several positions in one kernel (fewer positions than the carry: 2; several
    position blocks: 37)."""
    attrs, inputs = _conv_inputs(CONV_CASES[case], device, dtype, state_dtype, seed=4, tokens=tokens)
    domain = CONV_CASES[case][0]
    op = causal_conv_with_state_ms if domain == MS else causal_conv_with_state
    _kernel_vs_torch("causal_conv_prompt", lambda: op(_ctx("CausalConvWithState", domain, device, 4, **attrs), *inputs))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("case", ["builder", "channels_first_dilated"])
@pytest.mark.parametrize("past", [True, False])
def test_causal_conv_prompt_equals_its_steps_bit_for_bit(device: str, case: str, past: bool) -> None:
    """The prompt kernel sums each position's taps in the step kernel's order: its outputs and new
    carry equal those of the prompt's positions fed one step at a time."""
    tokens = 6
    attrs, (x, weight, bias, state) = _conv_inputs(
        CONV_CASES[case], device, torch.float16, torch.float16 if past else None, seed=5, tokens=tokens
    )
    ctx = _ctx("CausalConvWithState", MS, device, 4, **attrs)
    axis = 1 if attrs["channels_last"] else 2
    y, present = causal_conv_with_state_ms(ctx, x, weight, bias, state)
    steps = []
    for t in range(tokens):
        y_t, state = causal_conv_with_state_ms(ctx, x.narrow(axis, t, 1), weight, bias, state)
        steps.append(y_t)
    assert torch.equal(y, torch.cat(steps, dim=axis)) and torch.equal(present, state)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_causal_conv_windows_keep_the_torch_path(device: str) -> None:
    """A prompt that asks for a window of carries (state_window) is the torch path's: no kernel runs."""
    attrs, (x, weight, bias, past) = _conv_inputs(CONV_CASES["channels_first"], device, torch.float16, torch.float16,
                                                  tokens=5)  # fmt: skip
    ctx = _ctx("CausalConvWithState", MS, device, 4, **attrs, state_window=2)
    carries = torch.stack([past, past])  # (W, B, C, L): the carry after each of the last W positions
    before = LAUNCHES["causal_conv_prompt"] + LAUNCHES["causal_conv_update"]
    y, present = causal_conv_with_state_ms(ctx, x, weight, bias, carries)
    assert LAUNCHES["causal_conv_prompt"] + LAUNCHES["causal_conv_update"] == before
    assert y.shape == x.shape and present.shape == carries.shape


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_conv_prompt_switched_off_runs_the_torch_path(device: str) -> None:
    """ONNXGEN_CONV_PROMPT=0: a prompt's conv takes the torch path; a one-position step keeps its kernel."""
    attrs, prompt = _conv_inputs(CONV_CASES["builder"], device, torch.float16, torch.float16, tokens=5)
    _, step = _conv_inputs(CONV_CASES["builder"], device, torch.float16, torch.float16)
    ctx = _ctx("CausalConvWithState", MS, device, 4, **attrs)
    before = (LAUNCHES["causal_conv_prompt"], LAUNCHES["causal_conv_update"])
    with options.override(conv_prompt=False):
        causal_conv_with_state_ms(ctx, *prompt)
        causal_conv_with_state_ms(ctx, *step)
    assert (LAUNCHES["causal_conv_prompt"], LAUNCHES["causal_conv_update"]) == (before[0], before[1] + 1)


# ---------------------------------------------------------------- a last row per batch entry (runtime/state_rows.py)


def _rows_of(batch: int, device: str) -> torch.Tensor:
    """Last rows for a padded prompt of 7 tokens: one for every entry, or one per entry."""
    return torch.tensor([4] if batch == 1 else [4, 6, 1][:batch], dtype=torch.int64, device=device)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(("kernel", "chunked_from"), [("gated_delta_decode", 0), ("gated_delta_chunked", 2)])
@pytest.mark.parametrize("case", ["builder", "gqa", "linear"])
def test_recurrence_kernels_stop_at_the_last_row(device: str, kernel: str, chunked_from: int, case: str) -> None:
    """The sequential and chunked kernels with a last row per batch entry (the tokens after it
    neither write nor decay the state) against the torch path given the same rows, which
    tests/test_state_rows.py holds to the unpadded prompt."""
    attrs, inputs = _linear_attention_inputs(LA_CASES[case], device, torch.float32, torch.float32, seed=11, tokens=7)
    rows = _rows_of(inputs[0].shape[0], device)
    domain = LA_CASES[case][0]
    op = linear_attention_ms if domain == MS else linear_attention
    ctx = _ctx("LinearAttention", domain, device, 7, **attrs)
    with options.override(gdn_chunked_from=chunked_from):
        _kernel_vs_torch(kernel, lambda: op(ctx, *inputs, rows))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_folded_prologues_stop_at_the_last_row(device: str) -> None:
    """The sequential kernel with the gate and norms inside, and a last row per batch entry,
    against the ops one by one with the same rows."""
    import dataclasses

    from onnxgen.runtime.ops.fused_linear_attention import fused_linear_attention

    ctx, inputs = _folded_node("builder", device, torch.float32, 7, 1)
    rows = _rows_of(inputs[0].shape[0], device)
    ctx = dataclasses.replace(ctx, num_inputs=11)
    _kernel_vs_torch("gated_delta_prologue", lambda: fused_linear_attention(ctx, *inputs, rows))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("case", ["builder", "channels_first_dilated", "channels_first"])
def test_causal_conv_prompt_stops_at_the_last_row(device: str, case: str) -> None:
    """The prompt kernel's carry ends at each entry's last row (row 1: fewer real positions than
    the carry, the rest from the past), against the torch path given the same rows."""
    attrs, inputs = _conv_inputs(CONV_CASES[case], device, torch.float16, torch.float32, seed=6, tokens=7)
    rows = _rows_of(inputs[0].shape[0], device)
    domain = CONV_CASES[case][0]
    ctx = _ctx("CausalConvWithState", domain, device, 5, **attrs)
    _kernel_vs_torch("causal_conv_prompt", lambda: causal_conv_with_state_ms(ctx, *inputs, rows))


# ---------------------------------------------------------------- the drivers


# The nine-token prompt of the GQA case takes half a minute interpreted; CI keeps its two-token
# prompt and the nine-token prompts of the other cases (the same loop, the same head mapping).
_LONGEST_AGAIN = "short_prompts_take_the_kernel_and_match_the_torch_path[9-gqa-cpu]"


@IN_THE_PARENT
@runs(KERNELS := interpreted_file(__file__, f"through_the_triton_interpreter or {_LONGEST_AGAIN}"))
def test_kernels_match_the_torch_path_through_the_triton_interpreter() -> None:
    KERNELS.launches()


@pytest.mark.slow
@IN_THE_PARENT
@runs(EVERY_CASE := interpreted_file(__file__, "through_the_triton_interpreter"))
def test_every_case_through_the_triton_interpreter() -> None:
    EVERY_CASE.launches()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_kernels_on_the_qwen35_08b_layer_shape() -> None:
    """One Gated DeltaNet layer of the qwen3.5-0.8b shape (16 key and value heads of 128 dims, a
    6144-channel conv of width 4, one step and prompts), fp16 activations and states as onnxgen's fp16
    package holds them;
    bf16 and fp32 activations over an fp32 state on the same layer."""
    conv = (MS, True, (6144,), 4, 1, 1, False, "silu")
    attrs, inputs = _conv_inputs(conv, "cuda", torch.float16, torch.float16)
    ctx = _ctx("CausalConvWithState", MS, "cuda", 4, **attrs)
    _kernel_vs_torch("causal_conv_update", lambda: causal_conv_with_state_ms(ctx, *inputs))
    for tokens in (16, 64, 1000):  # prompts: one position block, several, and a long one
        attrs, inputs = _conv_inputs(conv, "cuda", torch.float16, torch.float16, tokens=tokens)
        _kernel_vs_torch("causal_conv_prompt", lambda: causal_conv_with_state_ms(ctx, *inputs))  # noqa: B023
    # the 0.8B layer at batch 1 and 4, and the 35B-A3B layer's 32 value heads over 16 key heads
    for batch, value_heads in ((1, 16), (4, 16), (1, 32)):
        layer = (MS, 16, value_heads, False, 128, 128, batch, "h", "h")
        attrs, inputs = _linear_attention_inputs(layer, "cuda", torch.float16, torch.float16)
        ctx = _ctx("LinearAttention", MS, "cuda", 6, **attrs)
        _kernel_vs_torch("gated_delta_decode", lambda: linear_attention_ms(ctx, *inputs))  # noqa: B023
    for dtype in (torch.bfloat16, torch.float32):
        attrs, inputs = _linear_attention_inputs((MS, 16, 16, False, 128, 128, 2, "h", "h"), "cuda", dtype,
                                                 torch.float32)  # fmt: skip
        ctx = _ctx("LinearAttention", MS, "cuda", 6, **attrs)
        _kernel_vs_torch("gated_delta_decode", lambda: linear_attention_ms(ctx, *inputs))  # noqa: B023
    # prompts of the layer: the bench's 16 tokens and the longest run the kernel takes (from 17 tokens
    # the chunked kernels' by default)
    with options.override(gdn_chunked_from=0):
        for tokens in (16, MAX_SEQUENTIAL_TOKENS):
            attrs, inputs = _linear_attention_inputs((MS, 16, 16, False, 128, 128, 1, "h", "h"), "cuda",
                                                     torch.float16, torch.float16, tokens=tokens)  # fmt: skip
            ctx = _ctx("LinearAttention", MS, "cuda", 6, **attrs)
            _kernel_vs_torch("gated_delta_decode", lambda: linear_attention_ms(ctx, *inputs))  # noqa: B023
    # the chunked kernels' default prompts, and long prompts through them (beyond their default bound),
    # fp16 over an fp16 state
    for tokens in (17, MAX_SEQUENTIAL_TOKENS):
        attrs, inputs = _linear_attention_inputs((MS, 16, 16, False, 128, 128, 1, "h", "h"), "cuda", torch.float16,
                                                 torch.float16, tokens=tokens)  # fmt: skip
        ctx = _ctx("LinearAttention", MS, "cuda", 6, **attrs)
        _kernel_vs_torch("gated_delta_chunked", lambda: linear_attention_ms(ctx, *inputs))  # noqa: B023
    with options.override(gdn_chunked_from=MAX_SEQUENTIAL_TOKENS + 1, gdn_chunked_to=0):
        for tokens in (MAX_SEQUENTIAL_TOKENS + 1, 1000):
            attrs, inputs = _linear_attention_inputs((MS, 16, 16, False, 128, 128, 1, "h", "h"), "cuda",
                                                     torch.float16, torch.float16, tokens=tokens)  # fmt: skip
            ctx = _ctx("LinearAttention", MS, "cuda", 6, **attrs)
            _kernel_vs_torch("gated_delta_chunked", lambda: linear_attention_ms(ctx, *inputs))  # noqa: B023
    # a Gated DeltaNet layer's own inputs (unit keys) over 1,000 tokens against the token recurrence:
    # the default path (the torch path's chunked form), then the chunked kernel
    inputs = _gated_delta_net_inputs("cuda", 1000, 16, 128, seed=9)
    attrs = {"q_num_heads": 16, "kv_num_heads": 16, "update_rule": "gated_delta"}
    out, state = linear_attention_ms(_ctx("LinearAttention", MS, "cuda", 6, **attrs), *inputs)
    with options.override(gdn_chunked_from=2, gdn_chunked_to=0):
        kernel_out, kernel_state = linear_attention_ms(_ctx("LinearAttention", MS, "cuda", 6, **attrs), *inputs)
    with options.override(triton=False):
        ref_out, ref_state = linear_attention_ms(_ctx("LinearAttention", MS, "cuda", 6, **attrs, chunk_size=1), *inputs)
    for got_out, got_state in ((out, state), (kernel_out, kernel_state)):
        assert_close_to_torch_path(got_out, ref_out)
        assert_close_to_torch_path(got_state, ref_state)
