"""Folding a Gated DeltaNet layer's per-token prologues into its LinearAttention.

Before the recurrence a Gated DeltaNet layer normalises its queries and keys per head (L2) and
computes its log decay and write strength from two narrow projections (LinearAttentionGate). On
the GPU each of those is one small kernel launched once per layer and step, and each waits for the
one before: three of a layer's few launches. The recurrence kernel already holds a head's whole
key vector and the head's gate values when it needs them, so it can compute them itself.

The rewrite (``delta_prologues``) replaces LinearAttention (either domain) whose

- query and key are each ``Reshape*(L2Normalize(s))`` (onnxgen's fused L2 norm, fusion_hybrid.py)
  or ``Reshape*(LpNormalization(s, p=2, axis=-1))`` (onnxruntime-genai's export), both the same
  form and epsilon, ``s`` made by a Reshape whose shape starts ``[0, 0, ...]`` (so its leading
  axes are the batch and the tokens), and/or
- decay and beta are outputs 0 and 1 of one LinearAttentionGate

by ``FusedLinearAttention`` (onnxgen domain). Its inputs are LinearAttention's, with ``s`` in place
of the normalised query / key and the gate's inputs (a, b, dt_bias, decay_scale) in place of decay
and beta, then (input 10) the last row runtime/state_rows.py adds as LinearAttention's seventh
input; attributes ``inner_domain`` (the LinearAttention's), ``qk_norm`` (0: none, 1: L2Normalize,
2: LpNormalization, which maps a zero vector to zero) and ``qk_epsilon``. The removed
Reshapes never reorder elements, so the normalised query is ``s`` normalised over its last axis and
read as [batch, tokens, -1] (runtime/ops/fused_linear_attention.py).

Every removed value must be read by the chain alone (and be no graph output); otherwise that part
stays as written.
"""

from __future__ import annotations

from typing import Any

import onnx
from onnx import helper

from onnxgen.runtime.fusion import FUSED_DOMAIN, node_attr
from onnxgen.runtime.fusion_hybrid import _Chains

MS = "com.microsoft"
NORM_L2 = 1  # L2Normalize(epsilon)
NORM_LP = 2  # LpNormalization(p=2): x / ||x||, a zero vector stays zero


def _normalized(chains: _Chains, value: str) -> tuple[str, int, float, list[onnx.NodeProto]] | None:
    """(s, norm kind, epsilon, the nodes from the norm to ``value``) where ``value`` is
    Reshape*(norm(s)), every value on the way read by the chain alone, else None."""
    removed: list[onnx.NodeProto] = []
    if chains.sole(value) is None:
        return None
    while (reshape := chains.op(value, "Reshape")) is not None:
        if chains.sole(reshape.input[0]) is not reshape:
            return None
        removed.append(reshape)
        value = reshape.input[0]
    norm = chains.op(value, "L2Normalize", (FUSED_DOMAIN,)) or chains.op(value, "LpNormalization")
    if norm is None:
        return None
    if norm.op_type == "LpNormalization":
        if int(node_attr(norm, "p", 2)) != 2 or int(node_attr(norm, "axis", -1)) != -1:
            return None
        kind, eps = NORM_LP, 0.0
    else:
        kind, eps = NORM_L2, float(node_attr(norm, "epsilon", 0.0))
    source = norm.input[0]
    split = chains.op(source, "Reshape")  # the per-head view [B, T, heads, d]: leading axes kept
    shape = chains.ints(split.input[1]) if split is not None else None
    if shape is None or len(shape) < 3 or shape[:2] != [0, 0] or shape[-1] <= 0:
        return None
    return source, kind, eps, [norm, *removed]


def fold_delta_prologues(rewriter: Any) -> int:
    chains = _Chains(rewriter)
    index = {id(n): i for i, n in enumerate(rewriter.graph.node)}
    replace: dict[int, onnx.NodeProto | None] = {}
    count = 0
    for attention in rewriter.graph.node:
        if attention.op_type != "LinearAttention" or attention.domain not in ("", MS) or len(attention.input) < 3:
            continue
        if int(node_attr(attention, "state_window", 0) or 0):  # speculative decoding's states: left as written
            continue
        # LinearAttention's six inputs, and state_rows.py's last row as a seventh where it added one
        inputs = list(attention.input[:6]) + [""] * (6 - len(attention.input[:6]))
        last_row = list(attention.input[6:7])
        query, key = _normalized(chains, inputs[0]), _normalized(chains, inputs[1])
        norm = query is not None and key is not None and query[1:3] == key[1:3]
        gate = chains.producer.get(inputs[4]) if inputs[4] else None
        gated = (
            gate is not None and gate.op_type == "LinearAttentionGate" and gate.domain == MS
            and len(gate.output) >= 2 and list(gate.output[:2]) == inputs[4:6] and len(gate.input) >= 4
            and all(chains.sole(v) is attention for v in gate.output[:2])
        )  # fmt: skip
        if not norm and not gated:
            continue
        gone: list[onnx.NodeProto] = []
        if norm:
            assert query is not None and key is not None
            inputs[0], inputs[1] = query[0], key[0]
            gone += query[3] + key[3]
        if gated:
            assert gate is not None
            a, dt_bias, decay_scale, b = gate.input[:4]
            inputs[4:6] = ["", ""]
            inputs += [a, b, dt_bias, decay_scale]
            gone.append(gate)
        if last_row:  # FusedLinearAttention's input 10
            inputs += [""] * (10 - len(inputs)) + last_row
        attrs = {a.name: helper.get_attribute_value(a) for a in attention.attribute}
        kind, eps = (query[1], query[2]) if norm and query is not None else (0, 0.0)
        fused = helper.make_node(
            "FusedLinearAttention", inputs, list(attention.output), name=f"{attention.name}/prologues_folded",
            domain=FUSED_DOMAIN, inner_domain=attention.domain, qk_norm=kind, qk_epsilon=eps, **attrs,
        )  # fmt: skip
        replace[index[id(attention)]] = fused
        for node in gone:
            replace[index[id(node)]] = None
        count += 1
    rewriter._apply(replace)
    return count
