"""The sigmoid gates of gated decoders as one op: Sigmoid(g) -> Mul(y, .) (-> Add(x, .)), each the
only reader of the last, becomes ``SigmoidGate(y, g[, x])`` in the ``onnxgen`` domain.

Qwen3.5 writes both: the gated attention output (attention * sigmoid(gate), then o_proj) in every
full-attention layer, and in every mixture-of-experts layer the shared expert behind its sigmoid
gate, added to the routed experts' sum. The op computes y * sigmoid(g) (+ x) in fp32 and rounds
once (one kernel where Triton serves, gpu/sigmoid_gate.py), where the graph as written rounds after
each of its two or three ops, so results move within the type's rounding. Broadcasting is the
Mul's and the Add's: the kernel takes g of y's shape or one gate per row, x of y's shape; any
other broadcast runs the op's torch form. A Sigmoid whose Mul multiplies its own input is SiLU
(fusion.py's SiluMul) and is left alone.
"""

from __future__ import annotations

from typing import Any

import onnx
from onnx import helper

from onnxgen.runtime.fusion import DEFAULT_DOMAINS, FUSED_DOMAIN


def _other(node: onnx.NodeProto, value: str) -> str | None:
    """The input of a two-input node that is not ``value`` (None: both are, or the node is not binary)."""
    if len(node.input) != 2 or list(node.input).count(value) != 1:
        return None
    return node.input[1] if node.input[0] == value else node.input[0]


def fuse_sigmoid_gates(rewriter: Any) -> int:
    consumers = rewriter._consumers()
    index = {id(n): i for i, n in enumerate(rewriter.graph.node)}
    replace: dict[int, onnx.NodeProto | None] = {}
    count = 0
    for sigmoid in rewriter.graph.node:
        if sigmoid.op_type != "Sigmoid" or sigmoid.domain not in DEFAULT_DOMAINS or index[id(sigmoid)] in replace:
            continue
        gate, s = sigmoid.input[0], sigmoid.output[0]
        mul = rewriter._sole_consumer(s, consumers)
        if mul is None or mul.op_type != "Mul" or mul.domain not in DEFAULT_DOMAINS or index[id(mul)] in replace:
            continue
        y = _other(mul, s)
        if y is None or y == gate:  # y == gate: SiLU
            continue
        inputs, last = [y, gate], mul
        add = rewriter._sole_consumer(mul.output[0], consumers)
        if add is not None and add.op_type == "Add" and add.domain in DEFAULT_DOMAINS and index[id(add)] not in replace:
            x = _other(add, mul.output[0])
            if x is not None:
                inputs, last = [y, gate, x], add
        fused = helper.make_node("SigmoidGate", inputs, [last.output[0]], name=f"{last.name or mul.name}/SigmoidGate",
                                 domain=FUSED_DOMAIN)  # fmt: skip
        replace[index[id(sigmoid)]] = None
        if last is not mul:
            replace[index[id(mul)]] = None
        replace[index[id(last)]] = fused  # the last node's place: y, g and x exist there
        count += 1
    rewriter._apply(replace)
    return count
