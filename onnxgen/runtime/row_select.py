"""A graph rewrite that computes one output at a single row of axis 1, chosen by a new graph input.

A decoder's prompt step computes its logits for every prompt row, and a caller that generates reads
one of them: the lm_head over all the other rows (and their [rows, vocab] output) is work for
nothing. ``select_row`` moves an ``onnxgen.RowSelect(x, row)`` in front of the output's last layer,
so the layer runs on row ``row[0]`` of axis 1 only and the output has one row there.

What the layer may be, so that computing it on one row gives that row's result: a MatMul or
MatMulNBits with constant weights (one row in, the same row out), optionally behind a normalization
over the last axis whose other outputs nothing reads (SimplifiedLayerNormalization, its Skip
variant, LayerNormalization, SkipLayerNormalization, RMSNormalization). RowSelect goes in front of
that normalization (on its data inputs), so that the fusion pass still finds the normalization
feeding the lm_head (its prologue) and a one-row decode step keeps its kernels: RowSelect of a
tensor with one row along axis 1 is that tensor itself (no kernel). Every data input must have
the output's row axis as its axis 1 (symbolic shapes prove it); otherwise nothing is rewritten and
the reason is returned.
"""

from __future__ import annotations

import onnx
from onnx import helper

from onnxgen.runtime.fusion import FUSED_DOMAIN
from onnxgen.runtime.shapes.infer import infer_shapes

_ROW_WISE_NORMS = {
    ("com.microsoft", "SimplifiedLayerNormalization"): 1,  # data inputs (the rest are constants)
    ("", "SimplifiedLayerNormalization"): 1,
    ("com.microsoft", "SkipSimplifiedLayerNormalization"): 2,
    ("", "LayerNormalization"): 1,
    ("com.microsoft", "SkipLayerNormalization"): 2,
    ("", "RMSNormalization"): 1,
}
_LINEAR = {("", "MatMul"), ("com.microsoft", "MatMulNBits")}


def _domain(node: onnx.NodeProto) -> str:
    return "" if node.domain in ("", "ai.onnx") else node.domain


def _head_nodes(
    output: str, producers: dict[str, onnx.NodeProto], constants: set[str]
) -> tuple[list[onnx.NodeProto], str] | str:
    """(the last layer's nodes, its input x) when ``output`` is one of the row-wise forms, else why not.

    Two forms: a MatMul or MatMulNBits of x with constant weights; or Reshape(Gemm(Reshape(x,
    [-1, hidden]), W), Concat(Shape(x)[0:2], [vocab])), a tied lm_head reading the embedding table
    (the flattening and the reshape back follow x's rows, so picking x's row picks the output's)."""
    layer = producers.get(output)
    if layer is None:
        return f"{output} is a graph input"
    if (_domain(layer), layer.op_type) in _LINEAR:
        if not all(i in constants for i in layer.input[1:] if i):
            return f"the weights of {layer.op_type} node {layer.name!r} are not constants"
        return [layer], layer.input[0]
    why = f"{output} comes from {layer.op_type} node {layer.name!r}, not a MatMul, MatMulNBits or a reshaped Gemm"
    if layer.op_type != "Reshape" or _domain(layer) != "":
        return why
    gemm, concat = producers.get(layer.input[0]), producers.get(layer.input[1])
    flat = producers.get(gemm.input[0]) if gemm is not None and gemm.op_type == "Gemm" else None
    if flat is None or flat.op_type != "Reshape" or concat is None or concat.op_type != "Concat":
        return why
    if not all(i in constants for i in gemm.input[1:] if i) or flat.input[1] not in constants:
        return why
    x = flat.input[0]
    shape = producers.get(concat.input[0]) if len(concat.input) == 2 else None
    lead = {a.name: helper.get_attribute_value(a) for a in shape.attribute} if shape is not None else {}
    if shape is None or shape.op_type != "Shape" or shape.input[0] != x or concat.input[1] not in constants:
        return why
    if lead.get("start", 0) != 0 or lead.get("end") != 2:
        return why
    return [layer, gemm, flat, concat, shape], x


def select_row(model: onnx.ModelProto, output: str, row_input: str) -> tuple[onnx.ModelProto, str | None]:
    """(a rewritten copy of ``model``, None), or (``model`` unchanged, why not). The new int64 input
    ``row_input`` of shape [1] names the row (or of shape [batch], a row per batch entry); ``output``
    then has 1 row along axis 1."""
    graph = model.graph
    if any(vi.name == row_input for vi in graph.input):
        return model, f"the graph already has an input named {row_input}"
    producers = {o: n for n in graph.node for o in n.output if o}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    outputs = {o.name for o in graph.output}
    constants = {t.name for t in graph.initializer} | {
        o for n in graph.node if n.op_type == "Constant" and _domain(n) == "" for o in n.output
    }
    head = _head_nodes(output, producers, constants)
    if isinstance(head, str):
        return model, head
    region, x = head
    region_names = {id(n) for n in region}
    if x in outputs or not all(id(c) in region_names for c in consumers.get(x, [])):
        return model, f"{x}, the input of the last layer, is read elsewhere too"
    targets, count = [n for n in region if x in n.input], 0  # nodes whose input x gets a RowSelect
    norm = producers.get(x)
    if norm is not None:
        data_inputs = _ROW_WISE_NORMS.get((_domain(norm), norm.op_type))
        others_unread = all(not o or (o not in consumers and o not in outputs) for o in norm.output[1:])
        if data_inputs and others_unread and norm.output[0] == x:
            targets, count = [norm], data_inputs
    frontier = list(targets[0].input[:count]) if count else [x]

    shapes = infer_shapes(model)
    out_info = shapes.values.get(output)
    if out_info is None or out_info.rank is None or out_info.rank < 2:
        return model, f"the shape of {output} is not known to have a row axis (axis 1)"
    rows = shapes.table.expr(out_info.shape[1])
    for name in frontier:
        info = shapes.values.get(name)
        if name in constants or info is None or info.rank != out_info.rank:
            return model, f"{name} (what the rows are picked from) does not have {output}'s rank"
        if shapes.table.expr(info.shape[1]) != rows:
            return model, f"{name} (what the rows are picked from) has another axis 1 than {output}"

    new = onnx.ModelProto()
    new.CopyFrom(model)
    graph = new.graph
    picked = {name: f"{name}/row_select" for name in frontier}
    keys = {(n.name, tuple(n.output)) for n in targets}
    first = min(i for i, n in enumerate(graph.node) if (n.name, tuple(n.output)) in keys)
    for node in graph.node:
        if (node.name, tuple(node.output)) in keys:
            for slot, name in enumerate(node.input):
                if name in picked:
                    node.input[slot] = picked[name]
    for offset, name in enumerate(frontier):
        select = helper.make_node("RowSelect", [name, row_input], [picked[name]], name=f"{name}/RowSelect",
                                  domain=FUSED_DOMAIN)  # fmt: skip
        graph.node.insert(first + offset, select)
    # [1] (one row for every batch entry) or [batch] (a row per entry): a symbol of its own
    graph.input.append(helper.make_tensor_value_info(row_input, onnx.TensorProto.INT64, [f"{row_input}_count"]))
    # the values after the RowSelects have one row now: drop their declared shapes, fix the output's
    walked = {o for n in [*targets, *region] for o in n.output if o}
    kept = [vi for vi in graph.value_info if vi.name not in walked]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    for vi in graph.output:
        if vi.name == output and vi.type.tensor_type.HasField("shape"):
            dim = vi.type.tensor_type.shape.dim[1]
            dim.Clear()
            dim.dim_value = 1
    if not any(op.domain == FUSED_DOMAIN for op in new.opset_import):
        new.opset_import.append(helper.make_opsetid(FUSED_DOMAIN, 1))
    return new, None
