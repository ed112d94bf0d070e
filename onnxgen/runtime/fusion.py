"""Graph rewrites that cut the number of kernels per decode step on CUDA.

A batch-1 decode step is bound by launches, not bandwidth: every node costs a kernel (~2-5 us even
inside a CUDA graph, measured on the H200: docs/benchmarks/). The rewrites, each a pattern
match on the ONNX graph that keeps every value name the rest of the graph reads:

- ``MatMulGroup``: MatMuls that share their input A and have constant 2-D weights (Q/K/V; gate/up)
  become one GEMM over the concatenated weights, split into the original outputs; a following
  Add of a constant bias (Qwen's QKV bias) folds into it.
- ``MatMulNBitsGroup``: the same for com.microsoft MatMulNBits siblings with equal K, bits,
  block size and accuracy level (the CUDA kernel dequantizes and concatenates them once).
- ``SiluMul``: Sigmoid(g) -> Mul(g, .) -> Mul(., u), the SwiGLU of Llama-style MLPs, becomes
  silu(g) * u in one kernel.
- ``RowSumCast``: ReduceSum over axis 1 of a 2-D integer graph input, minus a constant, cast to an
  integer type (the attention mask's valid lengths that GroupQueryAttention reads): one kernel
  instead of three, the first of every decode step.
- Singles: a lone MatMul with a constant 2-D weight (o_proj, down_proj) or a lone MatMulNBits
  becomes a group of one, so that every decode GEMV runs through one kernel family.
- Tied embedding: Gather(Transpose(W), ids) over a 2-D constant W (a tied lm_head weight stored
  once, as onnxruntime-genai's builder writes it) becomes Transpose(Gather(W, ids, axis=1)), so no
  step copies the whole table. The only rewrite that is not CUDA-only.
- ``L2Normalize`` and the key repeat of inverse-GQA linear attention (fusion_hybrid.py): the per-head
  L2 norm of Gated DeltaNet queries and keys (ReduceSumSquare -> Add eps -> Sqrt -> Div) as one op,
  and the Tile that repeats key heads for LinearAttention dropped where the op shares packed keys
  the same way.
- Rotary casts and query scales (fusion_genai.py), two chains onnxruntime-genai's builder writes: a
  half-precision input cast to fp32 for (M)RotaryEmbedding and back becomes the op on the input
  itself (the same values), and a scalar Mul of LinearAttention's query folds into its scale.
- ``SigmoidGate`` (fusion_gates.py): Sigmoid(g) -> Mul(y, .) (-> Add(x, .)), the gated attention
  output and the shared expert's gate of gated decoders, as one op.
- ``FusedLinearAttention`` (fusion_delta_rule.py): a Gated DeltaNet layer's query / key L2 norms
  and its LinearAttentionGate folded into its LinearAttention, whose step kernel computes them.
- Reshape chains (fusion_reshapes.py): Reshape(Reshape(x, s1), s2) as one Reshape, so that a
  strided view is not copied into a shape it is reshaped out of at once (gated attention's query).
- Prologues: the op that feeds a group and nothing else (SimplifiedLayerNormalization, its Skip
  variant, or SiluMul) moves into the group as its ``prologue``: at one row the group's kernel
  recomputes it per program (gpu/linear_row.py) instead of a kernel of its own; at more
  rows the group runs it first, as the unfused graph did. The Skip variant's residual sum becomes
  the group's last output.

The fused ops live in the ``onnxgen`` domain (implementations: ops/fused.py, shapes:
shapes/rules/fused.py). They change roundings a little (one GEMM + bias epilogue instead of GEMM
then Add; silu in fp32 rounded once): parity with onnxruntime is tested within the stated
tolerances, and captured == eager holds because both run the same fused graph.
CUDA sessions get every rewrite, CPU sessions the attention and tied-embedding ones (DEVICE_REWRITES says
why); ``ONNXGEN_FUSE=0`` (option ``fuse``) turns them off.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import onnx
import onnx.numpy_helper
from onnx import helper

from onnxgen import options
from onnxgen.errors import OptionError

FUSED_DOMAIN = "onnxgen"
DEFAULT_DOMAINS = ("", "ai.onnx")  # the default ONNX domain, as a node may spell it
_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
_INTS = (onnx.TensorProto.INT32, onnx.TensorProto.INT64)


@dataclass
class FusionReport:
    attention: int = 0
    matmul_groups: int = 0
    matmul_nbits_groups: int = 0
    silu_mul: int = 0
    singles: int = 0
    prologues: int = 0
    row_sums: int = 0
    tied_gathers: int = 0
    l2_norms: int = 0
    key_repeats: int = 0
    rotary_casts: int = 0
    query_scales: int = 0
    sigmoid_gates: int = 0
    delta_prologues: int = 0
    reshape_chains: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))


ALL_REWRITES = frozenset(
    {
        "attention", "matmul_groups", "matmul_nbits_groups", "silu_mul", "singles", "prologues", "row_sums",
        "tied_gathers", "l2_norms", "key_repeats", "rotary_casts", "query_scales", "sigmoid_gates", "delta_prologues",
        "reshape_chains",
    }
)  # fmt: skip
# what pays on each device (measured, docs/benchmarks/cpu.md and 2026-11-29-h200-capture.md): on the
# CPU the grouped GEMMs give up the split one-row GEMV (ops/cpu_gemv.py) and lose with every
# rewrite on, while the attention rewrite alone gains; on CUDA every rewrite removes launches. The
# tied-embedding gather runs everywhere: it removes a copy of the whole table per step
# (docs/benchmarks/2026-12-02-cpu-foreign.md)
DEVICE_REWRITES = {"cuda": ALL_REWRITES, "cpu": frozenset({"attention", "tied_gathers"})}


def node_attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    """The value of ``node``'s attribute ``name`` (``default`` where it has none)."""
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def fusion_enabled(device_type: str, opts: options.Options | None = None) -> bool:
    return bool(DEVICE_REWRITES.get(device_type)) and (opts or options.current()).fuse


def fuse_for_device(
    model: onnx.ModelProto, device_type: str, opts: options.Options | None = None
) -> tuple[onnx.ModelProto, FusionReport]:
    """The model rewritten for ``device_type`` (a copy; the input is left alone) and what was fused,
    under ``opts`` (default: the options in force)."""
    if not fusion_enabled(device_type, opts):
        return model, FusionReport()
    return fuse_graph(model, device_rewrites(device_type, opts))


def device_rewrites(device_type: str, opts: options.Options | None = None) -> frozenset[str]:
    """The rewrites a ``device_type`` session runs: the device's, less option ``fuse_skip``
    (``ONNXGEN_FUSE_SKIP``), whose names must be rewrites."""
    skip = (opts or options.current()).fuse_skip
    unknown = sorted(skip - ALL_REWRITES)
    if unknown:
        raise OptionError(f"ONNXGEN_FUSE_SKIP names {', '.join(unknown)}, which are not graph rewrites; the rewrites "
                         f"are {', '.join(sorted(ALL_REWRITES))}")  # fmt: skip
    return DEVICE_REWRITES.get(device_type, frozenset()) - skip


# an op each rewrite needs (at least this many times) before the graph is worth copying
_LINEAR = ("MatMul", "MatMulNBits")
_NEEDS = {"attention": (("Softmax",), 1), "silu_mul": (("Sigmoid",), 1), "matmul_groups": (("MatMul",), 2),
          "matmul_nbits_groups": (("MatMulNBits",), 2), "singles": (_LINEAR, 1), "prologues": (_LINEAR, 1),
          "row_sums": (("ReduceSum",), 1), "tied_gathers": (("Transpose",), 1),
          "l2_norms": (("ReduceSumSquare",), 1), "key_repeats": (("LinearAttention",), 1),
          "rotary_casts": (("RotaryEmbedding", "MRotaryEmbedding"), 1),
          "query_scales": (("LinearAttention",), 1), "sigmoid_gates": (("Sigmoid",), 1),
          "delta_prologues": (("LinearAttention",), 1), "reshape_chains": (("Reshape",), 2)}  # fmt: skip


# what each rewrite looks for, as `onnxgen show --capture` says it where the graph has the op a
# rewrite starts from but the rewrite matched nothing
PATTERNS = {
    "attention": "Softmax in a masked attention chain (MatMul(Q, K^T) scaled, plus a mask, Softmax, MatMul(., V))",
    "matmul_groups": "MatMuls that share their input A, with constant 2-D weights",
    "matmul_nbits_groups": "MatMulNBits siblings sharing A, with equal K, bits, block size and accuracy level",
    "silu_mul": "Sigmoid(g) -> Mul(g, .) -> Mul(., u), each the only reader of the last",
    "singles": "a lone MatMul with a constant 2-D weight, or a lone MatMulNBits",
    "prologues": "a (Skip)SimplifiedLayerNormalization or SiluMul whose output only one group reads",
    "row_sums": "ReduceSum over axis 1 of a 2-D integer graph input, minus a constant, cast to an integer",
    "tied_gathers": "Gather(Transpose(W), ids) over a 2-D constant W, every reader of the table such a Gather",
    "l2_norms": "ReduceSumSquare(x, last axis, keepdims) -> Add a float scalar -> Sqrt -> Div(x, .), each the only "
    "reader of the last",
    "key_repeats": "LinearAttention (com.microsoft, more KV than query heads) reading Reshape(Tile(Reshape(k, "
    "[0, 0, Hq, 1, d]), [1, 1, 1, Hkv / Hq, 1]), [0, 0, Hkv * d])",
    "rotary_casts": "Cast(x, to=FLOAT) -> (M)RotaryEmbedding -> Cast(to=T), x declared of type T (float16 or "
    "bfloat16), each the only reader of the last",
    "query_scales": "LinearAttention (com.microsoft, scale attribute set) whose query is Mul(q, a float scalar "
    "constant) read by it alone",
    "sigmoid_gates": "Sigmoid(g) -> Mul(y, .) (-> Add(x, .)), y not g, each the only reader of the last",
    "delta_prologues": "LinearAttention whose query and key are Reshape*(L2Normalize or LpNormalization(p=2) of "
    "Reshape(s, [0, 0, ...])) and/or whose decay and beta are one LinearAttentionGate's outputs, read by it alone",
    "reshape_chains": "Reshape(Reshape(x, s1), s2), constant shapes, the inner one read by the outer alone, no "
    "allowzero, no 0 of s2 where s1 has -1",
}


# a rewrite whose starting ops an earlier rewrite may take whole (a SiLU's Sigmoid is SiluMul's)
_TAKEN_BY = {"sigmoid_gates": "silu_mul"}


def unmatched_rewrites(model: onnx.ModelProto, device_type: str, report: FusionReport) -> dict[str, str]:
    """The rewrites a ``device_type`` session tries that matched nothing although the graph has the op
    they start from (and an earlier rewrite did not take them all): rewrite name -> the pattern it
    looks for."""
    rewrites = device_rewrites(device_type)
    ops = Counter(n.op_type for n in model.graph.node)

    def left(name: str) -> int:
        taken = getattr(report, _TAKEN_BY[name]) if name in _TAKEN_BY else 0
        return sum(ops[op] for op in _NEEDS[name][0]) - taken

    return {
        name: PATTERNS[name] for name in sorted(rewrites) if not getattr(report, name) and left(name) >= _NEEDS[name][1]
    }


def fuse_graph(model: onnx.ModelProto, rewrites: frozenset[str] = ALL_REWRITES) -> tuple[onnx.ModelProto, FusionReport]:
    report = FusionReport()
    ops = Counter(n.op_type for n in model.graph.node)
    if not any(sum(ops[op] for op in _NEEDS[r][0]) >= _NEEDS[r][1] for r in rewrites):
        return model, report  # nothing can match: no copy (a model with inline weights would double)
    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    _Rewriter(fused.graph).run(report, rewrites)
    if not report.total:
        return model, report
    if not any(o.domain == FUSED_DOMAIN for o in fused.opset_import):
        fused.opset_import.append(helper.make_opsetid(FUSED_DOMAIN, 1))
    return fused, report


class _Rewriter:
    def __init__(self, graph: onnx.GraphProto):
        self.graph = graph
        self.inits = {t.name: t for t in graph.initializer}
        # small values the patterns read (axes, offsets): initializers, or Constant nodes' tensors (as
        # onnxruntime-genai's builder writes them); the executor folds both into initializers
        self.scalars = dict(self.inits)
        for node in graph.node:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.output:
                value = next(
                    (a.t for a in node.attribute if a.name == "value" and a.type == onnx.AttributeProto.TENSOR), None
                )
                if value is not None:
                    self.scalars[node.output[0]] = value
        self.graph_outputs = {o.name for o in graph.output}

    def _consumers(self) -> dict[str, list[onnx.NodeProto]]:
        found: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for node in self.graph.node:
            for name in node.input:
                if name:
                    found[name].append(node)
            for attr in node.attribute:  # a subgraph reading the value counts as a consumer
                for sub in [attr.g, *attr.graphs]:
                    for inner in sub.node:
                        for name in inner.input:
                            if name:
                                found[name].append(node)
        return found

    def run(self, report: FusionReport, rewrites: frozenset[str] = ALL_REWRITES) -> None:
        from onnxgen.runtime.fusion_attention import fuse_masked_attention
        from onnxgen.runtime.fusion_delta_rule import fold_delta_prologues
        from onnxgen.runtime.fusion_gates import fuse_sigmoid_gates
        from onnxgen.runtime.fusion_genai import fold_query_scales, fuse_rotary_casts
        from onnxgen.runtime.fusion_hybrid import elide_key_repeats, fuse_l2_norms
        from onnxgen.runtime.fusion_reshapes import fold_reshape_chains

        if "tied_gathers" in rewrites:
            report.tied_gathers += self._fuse_tied_gathers()
        if "attention" in rewrites:
            report.attention += fuse_masked_attention(self)
        if "l2_norms" in rewrites:
            report.l2_norms += fuse_l2_norms(self)
        if "key_repeats" in rewrites:
            report.key_repeats += elide_key_repeats(self)
        if "rotary_casts" in rewrites:
            report.rotary_casts += fuse_rotary_casts(self)
        if "query_scales" in rewrites:
            report.query_scales += fold_query_scales(self)
        if "delta_prologues" in rewrites:  # after l2_norms, key_repeats and query_scales: it takes their output
            report.delta_prologues += fold_delta_prologues(self)
        if "silu_mul" in rewrites:
            report.silu_mul += self._fuse_silu_mul()
        if "sigmoid_gates" in rewrites:  # after silu_mul: a SiLU's Sigmoid is that rewrite's
            report.sigmoid_gates += fuse_sigmoid_gates(self)
        if "matmul_groups" in rewrites:
            report.matmul_groups += self._fuse_groups("MatMul", "", self._matmul_member)
        if "matmul_nbits_groups" in rewrites:
            report.matmul_nbits_groups += self._fuse_groups("MatMulNBits", "com.microsoft", self._nbits_member)
        if "singles" in rewrites:
            report.singles += self._fuse_groups("MatMul", "", self._matmul_member, least=1)
            report.singles += self._fuse_groups("MatMulNBits", "com.microsoft", self._nbits_member, least=1)
        if "prologues" in rewrites:
            report.prologues += self._fuse_prologues()
        if "row_sums" in rewrites:
            report.row_sums += self._fuse_row_sums()
        if "reshape_chains" in rewrites:  # last: the patterns above read the Reshapes as written
            report.reshape_chains += fold_reshape_chains(self)

    # -- the only-consumer test every pattern needs ----------------------------------------

    def _sole_consumer(self, value: str, consumers: dict[str, list[onnx.NodeProto]]) -> onnx.NodeProto | None:
        users = consumers.get(value, [])
        if len(users) != 1 or value in self.graph_outputs:
            return None
        return users[0]

    def _const(self, name: str, rank: int) -> onnx.TensorProto | None:
        t = self.inits.get(name)
        return t if t is not None and len(t.dims) == rank else None

    # -- SiluMul ---------------------------------------------------------------------------

    def _fuse_silu_mul(self) -> int:
        consumers = self._consumers()
        replace: dict[int, onnx.NodeProto | None] = {}
        index = {id(n): i for i, n in enumerate(self.graph.node)}
        count = 0
        for node in self.graph.node:
            if node.op_type != "Sigmoid" or node.domain not in ("", "ai.onnx") or index[id(node)] in replace:
                continue
            gate, sig = node.input[0], node.output[0]
            first = self._sole_consumer(sig, consumers)
            if first is None or first.op_type != "Mul" or first.domain not in ("", "ai.onnx"):
                continue
            if sorted(first.input) != sorted([gate, sig]):
                continue
            second = self._sole_consumer(first.output[0], consumers)
            if second is None or second.op_type != "Mul" or second.domain not in ("", "ai.onnx"):
                continue
            up = second.input[1] if second.input[0] == first.output[0] else second.input[0]
            if up == first.output[0]:
                continue
            name = f"{second.name or first.name}/SiluMul"
            fused = helper.make_node("SiluMul", [gate, up], [second.output[0]], name=name, domain=FUSED_DOMAIN)
            # the fused node takes the second Mul's place: `up` is produced before it
            replace[index[id(node)]] = None
            replace[index[id(first)]] = None
            replace[index[id(second)]] = fused
            count += 1
        self._apply(replace)
        return count

    # -- the embedding of a tied lm_head ---------------------------------------------------

    def _declared_tensors(self, name: str) -> Iterator[onnx.TypeProto.Tensor]:
        """The tensor types the graph's inputs and value_infos declare for ``name``, in that order."""
        for vi in [*self.graph.input, *self.graph.value_info]:
            if vi.name == name and vi.type.HasField("tensor_type"):
                yield vi.type.tensor_type

    def _declared_rank(self, name: str) -> int | None:
        return next((len(t.shape.dim) for t in self._declared_tensors(name) if t.HasField("shape")), None)

    def _fuse_tied_gathers(self) -> int:
        """Gather(Transpose(W), ids) with W a 2-D initializer: the embedding of a model that stores its
        tied lm_head weight [hidden, vocab] once, as onnxruntime-genai's builder writes it. Run as
        written, every step copies the whole transposed table (Transpose's output is contiguous) to
        read a few rows of it. Gathering W's columns (axis 1) and transposing those few rows gives
        the same values with no copy of the table. Applied where every reader of the transposed
        table is such a Gather (axis 0) and the ids' rank is declared."""
        consumers = self._consumers()
        index = {id(n): i for i, n in enumerate(self.graph.node)}
        replace: dict[int, onnx.NodeProto | list[onnx.NodeProto] | None] = {}
        count = 0
        for node in self.graph.node:
            if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") or len(node.input) != 1:
                continue
            weight = self._const(node.input[0], 2)
            perm = [list(a.ints) for a in node.attribute if a.name == "perm"]
            if weight is None or (perm and perm[0] != [1, 0]) or node.output[0] in self.graph_outputs:
                continue
            table = node.output[0]
            readers = consumers.get(table, [])
            ranks = [self._declared_rank(r.input[1]) if len(r.input) == 2 else None for r in readers]
            if not readers or any(
                r.op_type != "Gather" or r.domain not in ("", "ai.onnx") or r.input[0] != table
                or r.input[1] == table or any(a.name == "axis" and a.i != 0 for a in r.attribute) or rank is None
                for r, rank in zip(readers, ranks)
            ):  # fmt: skip
                continue
            for reader, rank in zip(readers, ranks):
                assert rank is not None
                columns = f"{reader.output[0]}/tied_columns"
                gather = helper.make_node(
                    "Gather", [node.input[0], reader.input[1]], [columns], name=f"{reader.name}/tied", axis=1
                )
                # [hidden, *ids] -> [*ids, hidden]
                rows = helper.make_node(
                    "Transpose", [columns], [reader.output[0]], name=f"{reader.name}/tied_rows",
                    perm=[*range(1, rank + 1), 0],
                )  # fmt: skip
                replace[index[id(reader)]] = [gather, rows]
            replace[index[id(node)]] = None
            count += len(readers)
        self._apply(replace)
        return count

    # -- RowSumCast -------------------------------------------------------------------------

    def _int_scalar(self, name: str) -> int | None:
        t = self.scalars.get(name)
        if t is None or t.data_type not in _INTS or len(t.dims) > 1 or (t.dims and t.dims[0] != 1):
            return None
        return int(onnx.numpy_helper.to_array(t).reshape(-1)[0])

    def _fuse_row_sums(self) -> int:
        consumers = self._consumers()
        inputs = {vi.name: vi.type.tensor_type for vi in self.graph.input}
        index = {id(n): i for i, n in enumerate(self.graph.node)}
        replace: dict[int, onnx.NodeProto | None] = {}
        count = 0
        for node in self.graph.node:
            if node.op_type != "ReduceSum" or node.domain not in ("", "ai.onnx") or not node.input:
                continue
            data = inputs.get(node.input[0])
            if data is None or data.elem_type not in _INTS or len(data.shape.dim) != 2:
                continue
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            if len(node.input) > 1 and node.input[1]:
                axes = self.scalars.get(node.input[1])
                axes_list = [] if axes is None else [int(v) for v in onnx.numpy_helper.to_array(axes).reshape(-1)]
            else:
                axes_list = [int(v) for v in attrs.get("axes", [])]
            if axes_list not in ([1], [-1]):
                continue
            sub = self._sole_consumer(node.output[0], consumers)
            if sub is None or sub.op_type != "Sub" or sub.domain not in ("", "ai.onnx"):
                continue
            if sub.input[0] != node.output[0]:  # sum - c only (c - sum is another op)
                continue
            minus = self._int_scalar(sub.input[1])
            if minus is None or self.scalars[sub.input[1]].data_type != data.elem_type:
                continue
            cast = self._sole_consumer(sub.output[0], consumers)
            if cast is None or cast.op_type != "Cast" or cast.domain not in ("", "ai.onnx"):
                continue
            to = int(next((helper.get_attribute_value(a) for a in cast.attribute if a.name == "to"), 0))
            if to not in _INTS:
                continue
            fused = helper.make_node(
                "RowSumCast", [node.input[0]], [cast.output[0]], name=f"{node.name}/RowSumCast", domain=FUSED_DOMAIN,
                offset=-minus, to=to, keepdims=int(attrs.get("keepdims", 1)),
            )  # fmt: skip
            replace[index[id(node)]] = fused
            replace[index[id(sub)]] = None
            replace[index[id(cast)]] = None
            count += 1
        self._apply(replace)
        return count

    # -- MatMul / MatMulNBits groups -------------------------------------------------------

    def _matmul_member(self, node: onnx.NodeProto) -> tuple | None:
        w = self._const(node.input[1], 2) if len(node.input) == 2 else None
        if w is None or w.data_type not in _FLOATS:
            return None
        return (w.data_type, w.dims[0])  # members must agree on this

    def _nbits_member(self, node: onnx.NodeProto) -> tuple | None:
        inputs = list(node.input) + [""] * (6 - len(node.input))
        if inputs[4] or inputs[5]:  # g_idx (act order) and a fused bias: left alone
            return None
        if any(n and n not in self.inits for n in inputs[1:4]):
            return None
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if int(attrs.get("weight_prepacked", 0)) or "N" not in attrs or "K" not in attrs:
            return None
        return (attrs["K"], attrs.get("bits", 4), attrs["block_size"], attrs.get("accuracy_level", 0))

    def _bias_of(self, node: onnx.NodeProto, width: int, consumers, dtype: int | None) -> onnx.NodeProto | None:
        add = self._sole_consumer(node.output[0], consumers)
        if add is None or add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.input) != 2:
            return None
        other = add.input[1] if add.input[0] == node.output[0] else add.input[0]
        bias = self._const(other, 1)
        if bias is None or bias.dims[0] != width or (dtype is not None and bias.data_type != dtype):
            return None
        return add

    def _fuse_groups(self, op_type: str, domain: str, member_key, least: int = 2) -> int:
        consumers = self._consumers()
        by_input: dict[tuple, list[onnx.NodeProto]] = defaultdict(list)
        for node in self.graph.node:
            if node.op_type != op_type or node.domain not in (domain, "ai.onnx" if not domain else domain):
                continue
            key = member_key(node)
            if key is not None and node.input[0]:
                by_input[(node.input[0], key)].append(node)
        index = {id(n): i for i, n in enumerate(self.graph.node)}
        replace: dict[int, onnx.NodeProto | None] = {}
        count = 0
        for (a, key), members in by_input.items():
            if len(members) < least:
                continue
            if op_type == "MatMul":
                widths = [self.inits[m.input[1]].dims[1] for m in members]
                dtype = key[0]
            else:
                widths = [next(helper.get_attribute_value(x) for x in m.attribute if x.name == "N") for m in members]
                dtype = None
            adds = [self._bias_of(m, w, consumers, dtype) for m, w in zip(members, widths)]
            biases = [("" if add is None else (add.input[1] if add.input[0] == m.output[0] else add.input[0]))
                      for m, add in zip(members, adds)]  # fmt: skip
            outputs = [m.output[0] if add is None else add.output[0] for m, add in zip(members, adds)]
            first = min(members, key=lambda m: index[id(m)])
            if op_type == "MatMul":
                inputs = [a, *(m.input[1] for m in members), *biases]
                fused = helper.make_node(
                    "MatMulGroup", inputs, outputs, name=f"{first.name}/MatMulGroup", domain=FUSED_DOMAIN,
                    widths=[int(w) for w in widths],
                )  # fmt: skip
            else:
                triples = []
                for m in members:
                    padded = list(m.input) + [""] * (4 - len(m.input))
                    triples += padded[1:4]
                k, bits, block_size, level = key
                fused = helper.make_node(
                    "MatMulNBitsGroup", [a, *triples, *biases], outputs, name=f"{first.name}/MatMulNBitsGroup",
                    domain=FUSED_DOMAIN, widths=[int(w) for w in widths], K=int(k), bits=int(bits),
                    block_size=int(block_size), accuracy_level=int(level),
                )  # fmt: skip
            for m, add in zip(members, adds):
                replace[index[id(m)]] = None
                if add is not None:
                    replace[index[id(add)]] = None
            replace[index[id(first)]] = fused  # every input exists where the first member ran
            count += 1
        self._apply(replace)
        return count

    # -- prologues -------------------------------------------------------------------------

    def _prologue_of(self, node: onnx.NodeProto) -> tuple[str, list[str], float, str] | None:
        """(prologue, [x, x2, gamma], epsilon, residual-sum output) when ``node`` can move into the
        group that reads its output, else None."""
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        inputs = list(node.input)
        if node.op_type == "SiluMul" and node.domain == FUSED_DOMAIN:
            return "silu_mul", [inputs[0], inputs[1], ""], 0.0, ""
        if int(attrs.get("stash_type", 1)) != 1:
            return None
        if node.op_type == "SimplifiedLayerNormalization" and node.domain in ("", "ai.onnx", "com.microsoft"):
            if int(attrs.get("axis", -1)) != -1 or len(inputs) != 2 or any(node.output[1:]):
                return None
            if self._const(inputs[1], 1) is None:
                return None
            return "rms", [inputs[0], "", inputs[1]], float(attrs.get("epsilon", 1e-5)), ""
        if node.op_type == "SkipSimplifiedLayerNormalization" and node.domain == "com.microsoft":
            if len(inputs) > 3 and inputs[3]:  # a bias: left alone
                return None
            outs = list(node.output) + [""] * (4 - len(node.output))
            if outs[1] or outs[2] or self._const(inputs[2], 1) is None:
                return None
            return "skip_rms", inputs[:3], float(attrs.get("epsilon", 1e-12)), outs[3]
        return None

    def _fuse_prologues(self) -> int:
        consumers = self._consumers()
        producer = {out: node for node in self.graph.node for out in node.output if out}
        index = {id(n): i for i, n in enumerate(self.graph.node)}
        replace: dict[int, onnx.NodeProto | None] = {}
        count = 0
        for node in self.graph.node:
            if node.op_type not in ("MatMulGroup", "MatMulNBitsGroup") or node.domain != FUSED_DOMAIN:
                continue
            if any(a.name == "prologue" for a in node.attribute):
                continue
            before = producer.get(node.input[0])
            if before is None or index[id(before)] in replace:
                continue
            if self._sole_consumer(node.input[0], consumers) is not node:
                continue
            found = self._prologue_of(before)
            if found is None:
                continue
            kind, (x, x2, gamma), eps, total = found
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            fused = helper.make_node(
                node.op_type, [x, *node.input[1:], x2, gamma], [*node.output, total] if kind == "skip_rms" else
                list(node.output), name=f"{node.name}/{kind}", domain=FUSED_DOMAIN, prologue=kind, epsilon=eps, **attrs,
            )  # fmt: skip
            # at the prologue's place: its inputs exist there, the group's others are constants, and
            # the residual sum's readers may come before the group
            replace[index[id(before)]] = fused
            replace[index[id(node)]] = None
            count += 1
        self._apply(replace)
        return count

    def _apply(self, replace: dict[int, onnx.NodeProto | list[onnx.NodeProto] | None]) -> None:
        if not replace:
            return
        nodes = []
        for i, node in enumerate(self.graph.node):
            if i in replace:
                new = replace[i]
                if isinstance(new, list):
                    nodes.extend(new)
                elif new is not None:
                    nodes.append(new)
            else:
                nodes.append(node)
        del self.graph.node[:]
        self.graph.node.extend(nodes)


def _readers(program: Any) -> Counter[str]:
    readers: Counter[str] = Counter()
    for node in program.nodes:
        readers.update(name for name in node.inputs if name)
        for sub in node.ctx.subgraphs.values():
            readers.update(sub.outer_references())
    return readers


def _drop_unread(program: Any, readers: Counter[str], names: list[str]) -> None:
    for old in names:
        readers[old] -= 1
        if readers[old] == 0:
            del program.initializers[old]


# the inputs after A that a group node's packing joins, per member: MatMulGroup (A, weights..., biases...)
# its weight (the biases stay apart); MatMulNBitsGroup (A, (codes, scales, zero points)..., biases...) all four
_MEMBER_WEIGHTS = {"MatMulGroup": 1, "MatMulNBitsGroup": 4}


def _weight_span(op_type: str, members: int) -> int:
    """How many inputs after A pack_matmul_groups / pack_nbits_groups join for a group of ``members``."""
    return _MEMBER_WEIGHTS[op_type] * members


def group_weight_names(model: onnx.ModelProto) -> frozenset[str]:
    """The weight inputs of the fused graph's MatMulGroup and MatMulNBitsGroup nodes (codes, scales,
    zero points, biases): what pack_matmul_groups and pack_nbits_groups join. The session keeps them
    on the host until they are joined."""
    names: set[str] = set()
    for node in model.graph.node:
        if node.domain != FUSED_DOMAIN or node.op_type not in _MEMBER_WEIGHTS:
            continue
        widths = next((list(a.ints) for a in node.attribute if a.name == "widths"), [])
        names.update(name for name in node.input[1 : 1 + _weight_span(node.op_type, len(widths))] if name)
    return frozenset(names)


def pack_matmul_groups(program: Any) -> int:
    """Concatenate each MatMulGroup's weights once, as the GEMM wants them ([sum N, K]), and drop
    the separate weights the program no longer reads: the group then holds one copy of its weights
    instead of two. Members held on the host (GraphProgram.host_held) go to the device one group at a
    time, so that the device never holds all of them beside their joins. Returns the number of groups
    packed."""
    import torch

    readers = _readers(program)
    graph_inputs = {vi.name for vi in program.inputs} | {vi.name for vi in program.outputs}
    packed = 0
    for node in program.nodes:
        if node.ctx.op_type != "MatMulGroup" or node.ctx.domain != FUSED_DOMAIN or node.ctx.attrs.get("packed_weight"):
            continue
        n = len(node.ctx.attrs["widths"])
        names = node.inputs[1 : 1 + _weight_span("MatMulGroup", n)]
        weights = [program.initializers.get(name) for name in names]
        if any(w is None or name in graph_inputs for w, name in zip(weights, names)):
            continue
        name = f"onnxgen.packed[{','.join(names)}]"
        # the transposing copy runs on the device (on the host it is slow for half precision); one group's
        # members at a time, and the next group's are of the same sizes, so their blocks are reused
        members = [w.to(program.device) for w in weights]
        program.initializers[name] = torch.cat([w.t() for w in members]).contiguous()
        del members
        node.inputs[1 : 1 + n] = [name] + [""] * (n - 1)
        node.ctx.attrs["packed_weight"] = 1
        _drop_unread(program, readers, names)
        packed += 1
    return packed


def pack_nbits_groups(program: Any) -> int:
    """The same for MatMulNBitsGroup: each group's codes, scales, zero points and biases joined
    along N once ([sum N, row bytes], [sum N, blocks], ...), the members' own tensors dropped where
    nothing else reads them, so a group holds its 4-bit weights once. Members whose zero points are
    of different kinds (absent, packed, float) stay apart. Returns the number of groups packed."""
    from onnxgen.runtime.ops.fused import join_nbits_members

    readers = _readers(program)
    graph_inputs = {vi.name for vi in program.inputs} | {vi.name for vi in program.outputs}
    packed = 0
    for node in program.nodes:
        ctx = node.ctx
        if ctx.op_type != "MatMulNBitsGroup" or ctx.domain != FUSED_DOMAIN or ctx.attrs.get("packed_weight"):
            continue
        widths = [int(w) for w in ctx.attrs["widths"]]
        n = len(widths)
        if n < 2:
            continue
        span = _weight_span("MatMulNBitsGroup", n)
        names = node.inputs[1 : 1 + span] + [""] * (span - len(node.inputs[1 : 1 + span]))
        tensors = [program.initializers.get(name) if name else None for name in names]
        if any((name and (t is None or name in graph_inputs)) for name, t in zip(names, tensors)):
            continue  # a member computed or fed at run time: leave the group as it is
        triples = [tensors[3 * i : 3 * i + 3] for i in range(n)]
        biases = tensors[3 * n :]
        if any(b is None or s is None for b, s, _ in triples):
            continue
        n_blocks = -(-int(ctx.attrs["K"]) // int(ctx.attrs["block_size"]))
        joined = join_nbits_members(triples, biases, widths, n_blocks)
        if joined is None:
            continue
        label = ",".join(names[0 : 3 * n : 3])
        new_names = []
        for role, tensor in zip(("codes", "scales", "zeros", "bias"), joined):
            if tensor is None:
                new_names.append("")
                continue
            name = f"onnxgen.packed_{role}[{label}]"
            program.initializers[name] = tensor.contiguous().to(program.device)
            new_names.append(name)
        slots = [""] * span
        slots[0:3] = new_names[0:3]
        slots[3 * n] = new_names[3]
        node.inputs[1 : 1 + span] = slots
        ctx.attrs["packed_weight"] = 1
        _drop_unread(program, readers, [name for name in names if name])
        packed += 1
    return packed
