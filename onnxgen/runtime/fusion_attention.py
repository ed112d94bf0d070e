"""The attention of decoder graphs written with default-domain ops, rewritten as one op.

Exporters that avoid contrib ops spell attention over a growing KV cache out in ~12 nodes per layer:

    K' = Reshape(Expand(Unsqueeze(K, 2), [1, 1, G, 1, 1]), [0, H, -1, D])      (grouped heads; optional)
    S  = MatMul(Q, Transpose(K', perm 0 1 3 2))  -> Mul/Div by a scalar  -> [Cast to fp32]
    S  = Where(mask, S, fill)  or  Add(S, bias)                                  (optional)
    P  = Softmax(S, axis -1)  -> [Cast back]
    O  = MatMul(P, V')                                                           (V' like K')

Every one of these nodes reads the growing KV length, so each is an eager seam of the captured step
(and a separate kernel launch and Python dispatch everywhere). ``MaskedAttention(Q, K, V[, mask])``
in the ``onnxgen`` domain does the same in one SDPA call: attributes ``scale``, ``groups``,
``mask_kind`` (none / where / add), ``fill`` (the Where's masked value). The softmax runs in fp32
inside SDPA either way; the rewrite drops the fp16 rounding of the scaled scores, which moves
results within fp16 tolerance (tested against onnxruntime on the original graph).
"""

from __future__ import annotations

from typing import Any

import onnx
from onnx import helper, numpy_helper

from onnxgen.runtime.fusion import DEFAULT_DOMAINS, FUSED_DOMAIN, node_attr


class AttentionMatcher:
    """Finds the pattern above around every Softmax of a graph (see fuse_masked_attention)."""

    def __init__(self, rewriter: Any, consumers: dict[str, list[onnx.NodeProto]]):
        self.rw = rewriter
        self.consumers = consumers
        self.producer = {o: n for n in rewriter.graph.node for o in n.output if o}

    def _op(self, value: str, op_type: str) -> onnx.NodeProto | None:
        node = self.producer.get(value)
        return node if node is not None and node.op_type == op_type and node.domain in DEFAULT_DOMAINS else None

    def _sole(self, value: str) -> bool:
        return self.rw._sole_consumer(value, self.consumers) is not None

    def _scalar(self, name: str) -> float | None:
        t = self.rw.inits.get(name)
        if t is None:
            node = self._op(name, "Constant")
            t = node_attr(node, "value") if node is not None else None
        if t is None:
            return None
        array = numpy_helper.to_array(t)
        return float(array.reshape(-1)[0]) if array.size == 1 else None

    def _ints(self, name: str) -> list[int] | None:
        t = self.rw.inits.get(name)
        return [int(x) for x in numpy_helper.to_array(t).reshape(-1)] if t is not None else None

    def unrepeat(self, value: str, used: list[onnx.NodeProto]) -> tuple[str, int]:
        """(K, G) when ``value`` is K with each head repeated G times by Unsqueeze/Expand/Reshape."""
        reshape = self._op(value, "Reshape")
        expand = self._op(reshape.input[0], "Expand") if reshape is not None else None
        unsqueeze = self._op(expand.input[0], "Unsqueeze") if expand is not None else None
        if unsqueeze is None or not self._sole(reshape.input[0]) or not self._sole(expand.input[0]):
            return value, 1
        axes = node_attr(unsqueeze, "axes") or (self._ints(unsqueeze.input[1]) if len(unsqueeze.input) > 1 else None)
        shape = self._ints(expand.input[1])
        if axes != [2] or shape is None or len(shape) != 5 or shape[:2] != [1, 1] or shape[3:] != [1, 1]:
            return value, 1
        used += [reshape, expand, unsqueeze]
        return unsqueeze.input[0], shape[2]

    def match(self, softmax: onnx.NodeProto) -> tuple[onnx.NodeProto, list[onnx.NodeProto]] | None:
        if softmax.domain not in DEFAULT_DOMAINS or node_attr(softmax, "axis", -1) not in (-1, 3):
            return None
        used = [softmax]
        scores = softmax.input[0]
        mask, mask_kind, fill = "", "none", 0.0
        where, add = self._op(scores, "Where"), self._op(scores, "Add")
        if where is not None and self._sole(scores):
            fill_value = self._scalar(where.input[2])
            if fill_value is None:
                return None
            mask, mask_kind, fill, scores = where.input[0], "where", fill_value, where.input[1]
            used.append(where)
        elif add is not None and self._sole(scores):
            # the scores side is the one that leads back to the Q.K MatMul
            for side in (0, 1):
                if self._scores_chain(add.input[side]) is not None:
                    mask, mask_kind, scores = add.input[1 - side], "add", add.input[side]
                    used.append(add)
                    break
            else:
                return None
        chain = self._scores_chain(scores)
        if chain is None:
            return None
        q, kt, scale, chain_nodes = chain
        used += chain_nodes
        transpose = self._op(kt, "Transpose")
        if transpose is None or list(node_attr(transpose, "perm", [])) != [0, 1, 3, 2] or not self._sole(kt):
            return None
        used.append(transpose)
        key, groups = self.unrepeat(transpose.input[0], used)
        if groups > 1 and not self._sole(transpose.input[0]):
            return None
        # after the softmax: [Cast] -> MatMul(P, V')
        probs = softmax.output[0]
        after = self.rw._sole_consumer(probs, self.consumers)
        if after is not None and after.op_type == "Cast" and after.domain in DEFAULT_DOMAINS:
            used.append(after)
            probs = after.output[0]
            after = self.rw._sole_consumer(probs, self.consumers)
        if after is None or after.op_type != "MatMul" or after.domain not in DEFAULT_DOMAINS or after.input[0] != probs:
            return None
        value, value_groups = self.unrepeat(after.input[1], used)
        if value_groups != groups or (groups > 1 and not self._sole(after.input[1])):
            return None
        used.append(after)
        inputs = [q, key, value] + ([mask] if mask else [])
        fused = helper.make_node(
            "MaskedAttention", inputs, [after.output[0]], name=f"{after.name or softmax.name}/MaskedAttention",
            domain=FUSED_DOMAIN, scale=float(scale), groups=int(groups), mask_kind=mask_kind, fill=float(fill),
        )  # fmt: skip
        return fused, used

    def _scores_chain(self, value: str) -> tuple[str, str, float, list[onnx.NodeProto]] | None:
        """value = [Cast fp32]([Mul|Div by a scalar](MatMul(Q, KT))) -> (Q, KT, scale, nodes); every
        value in between is read by the next node only."""
        nodes: list[onnx.NodeProto] = []
        if not self._sole(value):
            return None
        cast = self._op(value, "Cast")
        if cast is not None and node_attr(cast, "to") == onnx.TensorProto.FLOAT:
            nodes.append(cast)
            value = cast.input[0]
            if not self._sole(value):
                return None
        scale = 1.0
        for op in ("Mul", "Div"):
            node = self._op(value, op)
            if node is None:
                continue
            for side in (1, 0) if op == "Mul" else (1,):
                c = self._scalar(node.input[side])
                if c is not None and c != 0:
                    scale = c if op == "Mul" else 1.0 / c
                    value = node.input[1 - side]
                    break
            else:
                return None  # a product with a tensor: some other computation
            nodes.append(node)
            if not self._sole(value):
                return None
            break
        matmul = self._op(value, "MatMul")
        if matmul is None:
            return None
        nodes.append(matmul)
        return matmul.input[0], matmul.input[1], scale, nodes


def fuse_masked_attention(rewriter: Any) -> int:
    consumers = rewriter._consumers()
    matcher = AttentionMatcher(rewriter, consumers)
    index = {id(n): i for i, n in enumerate(rewriter.graph.node)}
    replace: dict[int, onnx.NodeProto | None] = {}
    count = 0
    for node in list(rewriter.graph.node):
        if node.op_type != "Softmax":
            continue
        found = matcher.match(node)
        if found is None:
            continue
        fused, used = found
        if any(index[id(n)] in replace for n in used):
            continue
        for n in used:
            replace[index[id(n)]] = None
        replace[index[id(used[-1])]] = fused  # the output MatMul's place: every input exists there
        count += 1
    rewriter._apply(replace)
    return count
