"""A graph rewrite that lets a step of a graph with carried states run padded rows.

A padded prompt step (rows past the prompt's end, so that a few recorded shapes serve every
length) is sound where each row depends only on the rows before it and the padding's leftovers are
dropped after the step: the KV rows it writes are masked again and overwritten. A carried state
is different: the step's present state is read by the next step, and a state that took the padding
in keeps it for good. ``stop_states_at_row`` adds an int64 graph input (shape [count]: one row for
every batch entry, or one per entry) and hands it to every op that makes one of the named present
states, as one more input after the op's own:

- LinearAttention (the ONNX form or com.microsoft's): its seventh input. The tokens after the row
  neither write nor decay the recurrent state (ops/linear_attention.py).
- CausalConvWithState (either form): its fifth input. The carry is the one that ends at the row.

The row is the last real one: the present states equal those of the unpadded step (up to the
rounding of the longer step's arithmetic); the outputs of the real rows are the step's own (every
op there is causal). A one-token step ignores it. Every named present must be output 1 of such a
node without a state window; otherwise nothing is rewritten and the reason is returned.
"""

from __future__ import annotations

import onnx
from onnx import helper

# (op type) -> the op's own input count: the row goes after them
_STATE_OPS = {"LinearAttention": 6, "CausalConvWithState": 4}
_DOMAINS = ("", "ai.onnx", "com.microsoft")


def stop_states_at_row(
    model: onnx.ModelProto, presents: list[str], row_input: str
) -> tuple[onnx.ModelProto, str | None]:
    """(a rewritten copy of ``model``, None), or (``model`` unchanged, why not). ``presents``: the
    graph outputs that carry a state to the next step."""
    graph = model.graph
    if not presents:
        return model, "the graph carries no state from step to step"
    if any(vi.name == row_input for vi in graph.input):
        return model, f"the graph already has an input named {row_input}"
    producers = {o: (i, n) for i, n in enumerate(graph.node) for o in n.output if o}
    targets: list[int] = []
    for present in presents:
        found = producers.get(present)
        if found is None:
            return model, f"the present state {present!r} is not made by a node"
        index, node = found
        own = _STATE_OPS.get(node.op_type)
        if own is None or node.domain not in _DOMAINS or list(node.output).index(present) != 1:
            return model, (f"the present state {present!r} comes from {node.op_type} node {node.name!r}, not from "
                           f"output 1 of {' or '.join(_STATE_OPS)}")  # fmt: skip
        if any(a.name == "state_window" and helper.get_attribute_value(a) for a in node.attribute):
            return model, f"{node.op_type} node {node.name!r} keeps a state window"
        if len(node.input) > own:
            return model, f"{node.op_type} node {node.name!r} has {len(node.input)} inputs; its form takes {own}"
        targets.append(index)

    new = onnx.ModelProto()
    new.CopyFrom(model)
    for index in targets:
        node = new.graph.node[index]
        node.input.extend([""] * (_STATE_OPS[node.op_type] - len(node.input)) + [row_input])
    new.graph.input.append(helper.make_tensor_value_info(row_input, onnx.TensorProto.INT64, [f"{row_input}_count"]))
    return new, None
