"""Carried states that stop at a row (runtime/state_rows.py): the ops' last-row input, the graph
rewrite that feeds it, and the engine's padded hybrid prompts.

Oracle for the ops: the same op over the unpadded prompt (each batch entry's real rows alone), whose
present state and outputs a padded call with the last row must give (up to the rounding of the
longer call). The Triton kernels are held to these torch paths with the same rows in
tests/test_hybrid_kernels.py; whole generations after padded prompts to transformers in
tests/test_builder_hybrid.py.
"""

from __future__ import annotations

import warnings

import onnx
import pytest
import torch

from onnxgen import options
from onnxgen.errors import OpError
from onnxgen.runtime.ops.linear_attention import (
    causal_conv_with_state,
    causal_conv_with_state_ms,
    linear_attention,
    linear_attention_ms,
)
from onnxgen.runtime.state_rows import stop_states_at_row
from tests.test_hybrid_kernels import CONV_CASES, LA_CASES, MS, _conv_inputs, _ctx, _linear_attention_inputs

TOKENS = 9


def _last_rows(batch: int, shared: bool) -> torch.Tensor:
    return torch.tensor([5] if shared else [5, 8, 0][:batch], dtype=torch.int64)


def _entry(inputs: list, index: int, rows: int, per_position: tuple[int, ...], seq_axis: int = 1) -> list:
    """Batch entry ``index`` of the op's inputs: the per-entry ones (the inputs ``per_position``
    and the past state, slot 3) cut to that entry, those of ``per_position`` to their first
    ``rows`` positions; weights as they are."""
    out = []
    for slot, x in enumerate(inputs):
        if x is not None and (slot in per_position or slot == 3):
            x = x[index : index + 1]
            x = x.narrow(seq_axis, 0, rows) if slot in per_position else x
        out.append(x)
    return out


@pytest.mark.parametrize("shared", [True, False], ids=["one-row", "row-per-entry"])
@pytest.mark.parametrize("case", list(LA_CASES))
def test_linear_attention_stops_at_the_last_row(case: str, shared: bool) -> None:
    """Every update rule and head mapping (per-head and per-key-dim decays; the torch path's
    chunked and sequential forms): the present state equals that of the real rows alone, and so do
    their outputs."""
    domain = LA_CASES[case][0]
    op = linear_attention_ms if domain == MS else linear_attention
    attrs, inputs = _linear_attention_inputs(LA_CASES[case], "cpu", torch.float32, torch.float32, seed=2,
                                             tokens=TOKENS)  # fmt: skip
    batch = inputs[0].shape[0]
    rows = _last_rows(batch, shared)
    with options.override(triton=False):
        out, present = op(_ctx("LinearAttention", domain, "cpu", 7, **attrs), *inputs, rows)
        for b in range(batch):
            real = int(rows[0 if shared else b]) + 1
            alone = _entry(inputs, b, real, (0, 1, 2, 4, 5))
            ref_out, ref_state = op(_ctx("LinearAttention", domain, "cpu", 6, **attrs), *alone)
            torch.testing.assert_close(present[b : b + 1], ref_state, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out[b : b + 1, :real], ref_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shared", [True, False], ids=["one-row", "row-per-entry"])
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_causal_conv_carry_ends_at_the_last_row(case: str, shared: bool) -> None:
    """Every layout (channels first and last, several channel axes, dilation): the carry equals that
    of the real positions alone (row 0: fewer than the carry, the rest from the past), bit for bit
    (a copy of positions), and so do their outputs."""
    domain, channels_last = CONV_CASES[case][:2]
    op = causal_conv_with_state_ms if domain == MS else causal_conv_with_state
    attrs, inputs = _conv_inputs(CONV_CASES[case], "cpu", torch.float32, torch.float32, seed=3, tokens=TOKENS)
    batch = inputs[0].shape[0]
    rows = _last_rows(batch, shared)
    axis = 1 if channels_last else 2
    with options.override(triton=False):
        y, present = op(_ctx("CausalConvWithState", domain, "cpu", 5, **attrs), *inputs, rows)
        for b in range(batch):
            real = int(rows[0 if shared else b]) + 1
            ref_y, ref_carry = op(_ctx("CausalConvWithState", domain, "cpu", 4, **attrs),
                                  *_entry(inputs, b, real, (0,), seq_axis=axis))  # fmt: skip
            assert torch.equal(present[b : b + 1], ref_carry), b
            # up to rounding: the CPU's vector loops and their scalar tails round the taps' sums apart
            torch.testing.assert_close(y[b : b + 1].narrow(axis, 0, real), ref_y, rtol=1e-6, atol=1e-6)


def test_the_last_row_of_a_whole_call_or_a_step_changes_nothing() -> None:
    """The last row at the call's end gives the call's own results bit for bit; a one-token step
    ignores the row (its one row is the last, whatever is fed)."""
    attrs, inputs = _linear_attention_inputs(LA_CASES["builder"], "cpu", torch.float32, torch.float32, tokens=TOKENS)
    ctx6, ctx7 = (_ctx("LinearAttention", MS, "cpu", n, **attrs) for n in (6, 7))
    with options.override(triton=False):
        plain = linear_attention_ms(ctx6, *inputs)
        ended = linear_attention_ms(ctx7, *inputs, torch.tensor([TOKENS - 1]))
        assert all(torch.equal(a, b) for a, b in zip(plain, ended, strict=True))
        step = [x if x is None or i == 3 else x[:, :1] for i, x in enumerate(inputs)]
        plain = linear_attention_ms(ctx6, *step)
        ignored = linear_attention_ms(ctx7, *step, torch.tensor([7]))
        assert all(torch.equal(a, b) for a, b in zip(plain, ignored, strict=True))


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (torch.tensor([1.0]), "int64 of shape"),
        (torch.tensor([1, 2, 3]), r"expected int64 of shape \[1\] or \[2\]"),
        (torch.tensor([[1]]), "int64 of shape"),
    ],
)
def test_a_malformed_last_row_is_refused(row: torch.Tensor, message: str) -> None:
    attrs, inputs = _linear_attention_inputs(LA_CASES["builder"], "cpu", torch.float32, torch.float32, tokens=3)
    with pytest.raises(OpError, match=message), options.override(triton=False):
        linear_attention_ms(_ctx("LinearAttention", MS, "cpu", 7, **attrs), *inputs, row)
    conv_attrs, conv = _conv_inputs(CONV_CASES["builder"], "cpu", torch.float32, torch.float32, tokens=3)
    with pytest.raises(OpError, match=message), options.override(triton=False):
        causal_conv_with_state_ms(_ctx("CausalConvWithState", MS, "cpu", 5, **conv_attrs), *conv, row)


def test_a_state_window_and_a_last_row_together_are_refused() -> None:
    attrs, inputs = _linear_attention_inputs(LA_CASES["builder"], "cpu", torch.float32, torch.float32, tokens=3)
    q, k, v, past, decay, beta = inputs
    ctx = _ctx("LinearAttention", MS, "cpu", 7, **attrs, state_window=1)
    with pytest.raises(OpError, match="state_window together"):
        linear_attention_ms(ctx, q, k, v, past[None], decay, beta, torch.tensor([1]))


# ---------------------------------------------------------------- the rewrite


def _state_op(op_type: str, name: str, present: str, *, window: int = 0) -> onnx.NodeProto:
    inputs = ["q", "k", "v", "past"] if op_type == "LinearAttention" else ["x", "w"]
    node = onnx.helper.make_node(op_type, inputs, [f"{name}_out", present], name=name, domain=MS)
    if window:
        node.attribute.append(onnx.helper.make_attribute("state_window", window))
    return node


def _graph(*nodes: onnx.NodeProto) -> onnx.ModelProto:
    outputs = [onnx.helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) for n in nodes for o in n.output]
    graph = onnx.helper.make_graph(list(nodes), "g", [], outputs)
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)])


def test_the_rewrite_hands_the_row_to_every_state_op() -> None:
    """Each op making a named present gets the row after its own inputs (LinearAttention's seventh,
    CausalConvWithState's fifth, the optional ones between left empty), and the graph a [count] input."""
    model = _graph(_state_op("LinearAttention", "la", "present.0.recurrent"),
                   _state_op("CausalConvWithState", "conv", "present.0.conv"))  # fmt: skip
    rewritten, why_not = stop_states_at_row(model, ["present.0.recurrent", "present.0.conv"], "row")
    assert why_not is None
    la, conv = rewritten.graph.node
    assert list(la.input) == ["q", "k", "v", "past", "", "", "row"]
    assert list(conv.input) == ["x", "w", "", "", "row"]
    (row,) = rewritten.graph.input
    assert row.name == "row" and row.type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert len(model.graph.node[0].input) == 4  # the caller's graph untouched


@pytest.mark.parametrize(
    ("nodes", "presents", "message"),
    [
        ([_state_op("LinearAttention", "la", "p", window=2)], ["p"], "keeps a state window"),
        ([onnx.helper.make_node("Identity", ["s"], ["p"], name="copy")], ["p"], "comes from Identity node 'copy'"),
        ([_state_op("LinearAttention", "la", "p")], ["la_out"], "not from output 1"),
        ([_state_op("LinearAttention", "la", "p")], ["q"], "is not made by a node"),
        ([_state_op("LinearAttention", "la", "p")], [], "carries no state"),
    ],
)
def test_the_rewrite_refuses_states_it_cannot_stop(nodes, presents: list[str], message: str) -> None:
    model = _graph(*nodes)
    rewritten, why_not = stop_states_at_row(model, presents, "row")
    assert rewritten is model and why_not is not None and message in why_not


@pytest.fixture(scope="module")
def hybrid_package(tmp_path_factory):
    pytest.importorskip("transformers")
    from onnxgen.models.builder import build_package
    from onnxgen.models.hf_source import HFSource
    from tests.test_builder_hybrid import tiny_checkpoint
    from tests.test_capture_runtime import write_word_tokenizer

    root = tmp_path_factory.mktemp("state-rows")
    checkpoint = tiny_checkpoint(root / "hf", value_heads=4, tied=False)
    package = build_package(HFSource(checkpoint), root / "pkg", precision="fp32")
    write_word_tokenizer(package, 128)
    return package


def test_the_engine_graph_feeds_every_state_op_and_the_fused_one_keeps_it(hybrid_package) -> None:
    """engine_model's graph: every CausalConvWithState and LinearAttention of the package reads the
    state row (one op per carried state); after the GPU's rewrites the folded Gated DeltaNet op
    (FusedLinearAttention) reads it as its input 10."""
    from onnxgen.genai.engine import STATE_ROW_INPUT
    from onnxgen.runtime.fusion import ALL_REWRITES, fuse_graph
    from tests.conftest import make_engine

    engine = make_engine(hybrid_package, kv="static")
    assert engine.state_row == STATE_ROW_INPUT and engine.carried_chunks() == "whole"  # the CPU, no recorder
    readers = [n for n in engine.session.model.graph.node if STATE_ROW_INPUT in n.input]
    assert sorted(n.op_type for n in readers) == sorted(
        "LinearAttention" if "recurrent" in s.present else "CausalConvWithState" for s in engine.config.carried
    )
    fused, _ = fuse_graph(engine.session.model, ALL_REWRITES)
    readers = [n for n in fused.graph.node if STATE_ROW_INPUT in n.input]
    folded = [n for n in readers if n.op_type == "FusedLinearAttention"]
    assert folded and len(readers) == len(engine.config.carried)
    assert all(list(n.input).index(STATE_ROW_INPUT) == 10 for n in folded)


def test_show_says_whether_a_hybrid_prompt_pads(hybrid_package, tmp_path) -> None:
    """`onnxgen show PKG --capture` names the rule a hybrid's prompt chunks follow: padded, its
    states stopping at the last real row, or unpadded pieces and why (a copy of the package whose
    recurrent state comes through an Identity)."""
    import shutil

    from tests.cli_in_process import onnxgen_in_process

    shown = onnxgen_in_process("show", str(hybrid_package), "--capture")
    assert shown.returncode == 0, shown.stderr
    assert "prompt chunks: padded, the " in shown.stdout and "carried states stopping" in shown.stdout
    copy = tmp_path / "copy"
    shutil.copytree(hybrid_package, copy)
    model = onnx.load(str(copy / "model.onnx"), load_external_data=False)
    present = next(o.name for o in model.graph.output if "recurrent" in o.name)
    (producer,) = [n for n in model.graph.node if present in n.output]
    producer.output[list(producer.output).index(present)] = present + "/made"
    model.graph.node.append(onnx.helper.make_node("Identity", [present + "/made"], [present], name="copied"))
    onnx.save(model, str(copy / "model.onnx"))
    shown = onnxgen_in_process("show", str(copy), "--capture")
    assert shown.returncode == 0, shown.stderr
    assert "prompt chunks: unpadded pieces" in shown.stdout and "Identity node 'copied'" in shown.stdout


def test_a_graph_whose_states_cannot_stop_runs_its_prompts_in_pieces(hybrid_package) -> None:
    """A present state made by an op the rewrite does not know (here a Identity after the recurrent
    state): engine_model says once why a prompt cannot be padded, and the prompt runs as unpadded
    power-of-two pieces whatever option prefill_pieces asks."""
    from onnxgen.genai.engine import DecodeEngine, engine_model
    from onnxgen.genai.graph_layout import with_graph_layout
    from onnxgen.genai.package import load_package_config
    from onnxgen.runtime.model_io import load_model
    from onnxgen.runtime.session import InferenceSession

    config = load_package_config(hybrid_package)
    proto, base = load_model(config.model_file)
    config = with_graph_layout(config, proto)
    present = config.carried[0].present
    (producer,) = [n for n in proto.graph.node if present in n.output]
    producer.output[list(producer.output).index(present)] = present + "/made"
    proto.graph.node.append(onnx.helper.make_node("Identity", [present + "/made"], [present], name="copied"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = engine_model(proto, config)
    said = [str(w.message) for w in caught if "cannot be padded" in str(w.message)]
    assert len(said) == 1 and "Identity node 'copied'" in said[0]
    engine = DecodeEngine(InferenceSession(model, base_dir=base), config, kv="static")
    assert engine.state_row is None and engine.carried_chunks() == "pieces"
    rows: list[int] = []
    forward = engine._forward
    engine._forward = lambda seq, chunk, *a, **k: rows.append(chunk.shape[1]) or forward(seq, chunk, *a, **k)
    from onnxgen.genai import SamplingParams

    ids = list(range(3, 40))  # 37 tokens
    sequence = engine.new_sequence(ids, SamplingParams(max_new_tokens=1))
    sequence.kv = engine._new_kv(len(ids) + 1)
    with torch.inference_mode():
        engine._prefill(sequence, torch.tensor([ids]))
    assert rows == [32, 4, 1]
