"""Pieces both graph flavours share: options, weight conversion, linears, embedding, MLP, LM head.

A `DecoderGraph` pairs a GraphWriter with the weight source and the build options; the
flavour modules (builder_gqa, builder_standard) call its methods layer by layer, so every
weight is fetched, converted and written once, in build order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from onnx import TensorProto

from onnxgen.errors import OnnxgenError
from onnxgen.models.config import DecoderConfig, WeightSource, iter_layer_names
from onnxgen.models.graph_writer import GraphWriter, onnx_dtype
from onnxgen.models.quantize import on_4bit_grid, quantize_4bit, quantize_4bit_symmetric

if TYPE_CHECKING:
    from onnxgen.models.build_pool import BuildPool

Progress = Callable[[str, int, int], None]  # (what, done, total) in weight tensors


class BuildError(OnnxgenError):
    """The model cannot be built with the requested options; the message says why."""


@dataclass(frozen=True)
class BuildOptions:
    precision: str  # fp32 | fp16 | int4
    device: str  # cpu | cuda
    attention: str  # gqa | standard
    context_length: int
    block_size: int = 32
    # "exact": a weight already on a 4-bit grid per block keeps it, with float zero points;
    # "packed": every MatMulNBits weight gets 4-bit zero points, the form onnxruntime's CPU kernel
    # runs fast (it takes a slow path for float ones), at the cost of rounding such a weight again;
    # "none": symmetric blocks and no zero points (onnxruntime-genai's builder's default form).
    int4_zero_points: str = "exact"

    def zero_point_form(self, table: bool = False) -> str:
        """q4_tensors' form for a weight; ``table``: read by GatherBlockQuantized too, whose zero
        points must be packed like its codes (or absent)."""
        if self.int4_zero_points == "none":
            return "none"
        return "packed" if table or self.int4_zero_points == "packed" else "exact"

    @property
    def io_dtype(self) -> np.dtype:
        """Activation dtype, as onnxruntime-genai's builder picks it: int4 keeps fp32 on CPU, fp16 on CUDA."""
        if self.precision == "fp32" or (self.precision == "int4" and self.device == "cpu"):
            return np.dtype(np.float32)
        return np.dtype(np.float16)

    @property
    def io_type(self) -> int:
        return onnx_dtype(self.io_dtype)

    @property
    def accuracy_level(self) -> int:
        # 4 = int8 activations in MatMulNBits on CPU (genai's default there); CUDA ignores it (0).
        return 4 if self.device == "cpu" else 0


def _where(source: WeightSource) -> str:
    """The file or folder a weight source reads, for error messages."""
    where = getattr(source, "path", None) or getattr(source, "directory", None)
    return str(where) if where else f"the {type(source).__name__}"


def checked_weight(source: WeightSource, name: str) -> np.ndarray:
    """One weight from the source as float32, checked for NaN/Inf.

    A damaged file decodes to non-finite values (numpy's overflow warnings are silenced: the
    error below says what and where), and a package built from them would only print nothing.
    """
    try:
        with np.errstate(all="ignore"):
            array = np.asarray(source.get(name), dtype=np.float32)
    except KeyError as e:
        raise BuildError(f"the weight source has no tensor {name!r}") from e
    bad = array.size - int(np.count_nonzero(np.isfinite(array)))
    if bad:
        raise BuildError(
            f"weight {name!r} has {bad} non-finite values (NaN or Inf) of {array.size} in {_where(source)}; "
            "the file is damaged or was written wrongly, so no package was built"
        )
    return array


@dataclass
class Q4Tensors:
    """MatMulNBits' B [N, blocks, block/2], flat scales (float32) and zero points of W [N, K]."""

    b: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray  # packed uint8, or float32 where float_zero_points; empty: none (symmetric)
    float_zero_points: bool
    n: int
    k: int

    @property
    def has_zero_points(self) -> bool:
        return self.zero_points.size > 0


def q4_tensors(w: np.ndarray, block_size: int, zero_points: str = "exact") -> Q4Tensors:
    """W [N, K] for MatMulNBits, by ``zero_points`` form: "exact", a weight already on a 4-bit grid
    per block (a 4-bit checkpoint dequantized) keeps its exact values with float zero points
    (quantize.on_4bit_grid) and any other is quantized with 4-bit ones; "packed", every weight with
    4-bit ones (GatherBlockQuantized reads the table too, and its zero points must be packed like
    its codes); "none", symmetric blocks without zero points. A pure function of W: the build
    pool's workers run it too, and their tensors must be the ones a serial build writes."""
    if zero_points == "none":
        q = quantize_4bit_symmetric(w, block_size)
    else:
        q = None if zero_points == "packed" else on_4bit_grid(w, block_size)
        q = q or quantize_4bit(w, block_size)
    b, scales, zp = q.matmulnbits_tensors()
    return Q4Tensors(b, scales, zp, q.float_zero_points, q.n, q.k)


def rotary_frequencies(config: DecoderConfig, length: int) -> np.ndarray:
    """Angles [length, rotary_dim/2]: position * theta^(-2i/rotary_dim), computed in float64."""
    dim = rotary_dim(config)
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    return np.outer(np.arange(length, dtype=np.float64), inv_freq)


def rotary_dim(config: DecoderConfig) -> int:
    dim = int(config.head_dim * config.partial_rotary_factor)
    if dim % 2 or dim <= 0:
        raise BuildError(
            f"rotary dimension {dim} (head_dim {config.head_dim} x {config.partial_rotary_factor}) must be even"
        )
    return dim


class DecoderGraph:
    def __init__(
        self,
        writer: GraphWriter,
        source: WeightSource,
        options: BuildOptions,
        progress: Progress | None,
        pool: BuildPool | None = None,
    ) -> None:
        self.w = writer
        # computes quantized tensors ahead of the build (build_pool); None: each is computed when asked for
        self.pool = pool
        self.source = source
        self.config = source.config
        self.opt = options
        self._progress = progress
        self._fetched = 0
        # a tied int4 head either shares the embedding's 4-bit codes (fetched once) or quantizes the
        # table a second time beside the float one kept for the Gather
        refetch = self.config.tie_word_embeddings and options.precision == "int4" and not self.shares_q4_table
        self._total = sum(1 for _ in iter_layer_names(self.config)) + int(refetch)
        self._shared_head: tuple[list[str], int, int] | None = None  # the tied 4-bit table's initializers, N, K

    # --- weights ------------------------------------------------------------------------

    def fetch(self, name: str) -> np.ndarray:
        """One weight from the source as float32, checked against the config and for NaN/Inf."""
        array = checked_weight(self.source, name)
        self.fetched(name)
        return array

    def fetched(self, name: str) -> None:
        """Count one weight as read (by fetch, or by the build pool for this graph) for the progress."""
        self._fetched += 1
        if self._progress is not None:
            self._progress(name, min(self._fetched, self._total), self._total)

    def io_const(self, value: float | list) -> str:
        return self.w.const(value, self.opt.io_dtype)

    def cast(self, name: str, array: np.ndarray) -> np.ndarray:
        """`array` in the activation dtype; a finite weight beyond float16's range is an error, not Inf."""
        with np.errstate(over="ignore"):
            out = array.astype(self.opt.io_dtype)
        if out.dtype != array.dtype and not np.isfinite(out).all():
            raise BuildError(
                f"weight {name!r} has values beyond {out.dtype}'s range (largest magnitude "
                f"{float(np.abs(array).max()):.6g}); build with --precision fp32"
            )
        return out

    def float_weight(self, name: str, array: np.ndarray) -> str:
        return self.w.initializer(name, self.cast(name, array))

    # --- building blocks ----------------------------------------------------------------

    def linear(
        self, x: str, prefix: str, *, bias: bool = False, weight: np.ndarray | None = None, output: str | None = None
    ) -> str:
        """x @ W^T (+ b) for the HF Linear `prefix` ("model.layers.0.self_attn.q_proj")."""
        if self.opt.precision == "int4" and self.opt.attention == "gqa":
            form = self.opt.zero_point_form()
            q = self.q4(prefix + ".weight") if weight is None else q4_tensors(weight, self.opt.block_size, form)
            weights = self._write_q4(q, prefix)
            y = self._nbits_node(x, weights, prefix, None if bias else output, n=q.n, k=q.k)
            del q
        else:
            w = self.fetch(prefix + ".weight") if weight is None else weight
            if self.opt.precision != "int4":
                wt = self.float_weight(prefix + ".MatMul.weight", np.ascontiguousarray(w.T))
                y = self.w.node(
                    "MatMul", [x, wt], name=prefix + "/MatMul", outputs=None if bias or output is None else [output]
                )[0]
            else:
                y = self._dequantize_matmul(x, w, prefix, None if bias else output)
            del w
        if bias:
            b = self.float_weight(prefix + ".bias", self.fetch(prefix + ".bias"))
            y = self.w.node("Add", [y, b], name=prefix + "/BiasAdd", outputs=None if output is None else [output])[0]
        return y

    def q4(self, name: str, *, table: bool = False) -> Q4Tensors:
        """The MatMulNBits tensors of weight `name` (q4_tensors; ``table``: the embedding's, see
        BuildOptions.zero_point_form): the build pool's, where it computed them ahead, else
        computed here."""
        form = self.opt.zero_point_form(table)
        if self.pool is not None:
            q = self.pool.take(("linear", name, form))
            if q is not None:
                self.fetched(name)
                return q
        return q4_tensors(self.fetch(name), self.opt.block_size, form)

    def _write_q4(self, q: Q4Tensors, prefix: str) -> list[str]:
        """MatMulNBits' B, scales and zero points (none for symmetric blocks) written as initializers
        (scales, and float zero points, in the activations' dtype); their names."""
        names = [
            self.w.initializer(prefix + ".MatMulNBits.qweight", q.b),
            self.w.initializer(prefix + ".MatMulNBits.scales", self.cast(prefix + ".weight scales", q.scales)),
        ]
        if q.has_zero_points:
            zeros = self.cast(prefix + ".weight zero points", q.zero_points) if q.float_zero_points else q.zero_points
            names.append(self.w.initializer(prefix + ".MatMulNBits.qzeros", zeros))
        return names

    def _nbits_node(self, x: str, weights: list[str], prefix: str, output: str | None, *, n: int, k: int) -> str:
        return self.w.node(
            "MatMulNBits",
            [x, *weights],
            name=prefix + "/MatMulNBits",
            domain="com.microsoft",
            outputs=None if output is None else [output],
            K=k,
            N=n,
            bits=4,
            block_size=self.opt.block_size,
            accuracy_level=self.opt.accuracy_level,
        )[0]

    def _dequantize_matmul(self, x: str, w: np.ndarray, prefix: str, output: str | None) -> str:
        """Default-domain int4: blocked DequantizeLinear (opset 21, UINT4) feeding a MatMul."""
        n, k = w.shape
        if k % self.opt.block_size:
            raise BuildError(
                f"{prefix}: in_features {k} is not a multiple of the int4 block size {self.opt.block_size}"
            )
        q = quantize_4bit(w, self.opt.block_size)
        xq, scale, zp = q.dequantize_linear_tensors()
        nb = q.n_blocks
        del q
        inputs = [
            self.w.packed_initializer(prefix + ".DequantizeLinear.qweight", xq, (k, n), TensorProto.UINT4),
            self.w.initializer(prefix + ".DequantizeLinear.scales", self.cast(prefix + ".weight scales", scale)),
            self.w.packed_initializer(prefix + ".DequantizeLinear.qzeros", zp, (nb, n), TensorProto.UINT4),
        ]
        wt = self.w.op(
            "DequantizeLinear", *inputs, name=prefix + "/DequantizeLinear", axis=0, block_size=self.opt.block_size
        )
        return self.w.node("MatMul", [x, wt], name=prefix + "/MatMul", outputs=None if output is None else [output])[0]

    @property
    def shares_q4_table(self) -> bool:
        """A tied int4 graph with contrib ops whose hidden size is whole quantization blocks: the
        embedding gathers rows of the LM head's 4-bit codes (GatherBlockQuantized), so the table is
        held once, in 4 bits. Elsewhere the Gather keeps a float table (the default-domain flavour
        has no quantized gather; a padded last block would widen the gathered rows)."""
        return self.q4_table_shared(self.config, self.opt)

    @staticmethod
    def q4_table_shared(config: DecoderConfig, options: BuildOptions) -> bool:
        return (
            config.tie_word_embeddings
            and options.precision == "int4"
            and options.attention == "gqa"
            and config.hidden_size % options.block_size == 0
        )

    def embedding(self, input_ids: str) -> tuple[str, str]:
        """Gather from the embedding table: float, or the tied LM head's 4-bit codes (shares_q4_table).

        Returns (hidden states, float table initializer name or "") so a tied LM head can reuse the table.
        """
        if self.shares_q4_table:
            return self._q4_embedding(input_ids), ""
        table = self.fetch("model.embed_tokens.weight")
        name = self.float_weight("model.embed_tokens.weight", table)
        return self.w.op("Gather", name, input_ids, name="/model/embed_tokens/Gather"), name

    def _q4_embedding(self, input_ids: str) -> str:
        """GatherBlockQuantized over the head's MatMulNBits tensors, reshaped to rows: B [N, blocks,
        block/2] is [N, K/2] bytes row by row; the flat scales and zero points are [N, blocks] and
        [N, ceil(blocks/2)]. Both ops read the same initializers, so the codes are stored once."""
        q = self.q4("model.embed_tokens.weight", table=True)
        n, k = q.n, q.k
        weights = self._write_q4(q, "lm_head")
        del q
        self._shared_head = (weights, n, k)
        blocks = k // self.opt.block_size
        rows = [
            self.w.op("Reshape", name, self.w.const([n, width]), name=f"/model/embed_tokens/Reshape_{role}")
            for name, width, role in zip(weights, (k // 2, blocks, -(-blocks // 2)), ("codes", "scales", "zeros"))
        ]
        return self.w.op(
            "GatherBlockQuantized", rows[0], input_ids, *rows[1:],
            name="/model/embed_tokens/GatherBlockQuantized", domain="com.microsoft",
            bits=4, block_size=self.opt.block_size, gather_axis=0, quantize_axis=1,
        )  # fmt: skip

    def mlp(self, x: str, layer: int) -> str:
        """SiLU-gated MLP: down(silu(gate(x)) * up(x)); SiLU written as x * Sigmoid(x)."""
        p = f"model.layers.{layer}.mlp."
        if self.config.hidden_act not in ("silu", "swish"):
            raise BuildError(f"hidden_act {self.config.hidden_act!r} is not supported (only silu)")
        gate = self.linear(x, p + "gate_proj")
        up = self.linear(x, p + "up_proj")
        sig = self.w.op("Sigmoid", gate, name=p + "act/Sigmoid")
        act = self.w.op("Mul", gate, sig, name=p + "act/Mul")
        prod = self.w.op("Mul", act, up, name=p + "Mul")
        return self.linear(prod, p + "down_proj")

    def lm_head(self, x: str, embed_table: str) -> str:
        """Final projection to the vocabulary, written to the graph output `logits`."""
        if not self.config.tie_word_embeddings:
            return self.linear(x, "lm_head", output="logits")
        if self._shared_head is not None:  # the embedding's 4-bit codes (shares_q4_table)
            weights, n, k = self._shared_head
            return self._nbits_node(x, weights, "lm_head", "logits", n=n, k=k)
        if self.opt.precision == "int4":
            # A quantized copy of the tied table (the Gather keeps the float one).
            return self.linear(x, "lm_head", weight=self.fetch("model.embed_tokens.weight"), output="logits")
        # Float and tied: Gemm(transB=1) reads the embedding table itself, no second copy.
        hidden = self.config.hidden_size
        flat = self.w.op("Reshape", x, self.w.const([-1, hidden]), name="/lm_head/Reshape")
        y = self.w.op("Gemm", flat, embed_table, name="/lm_head/Gemm", transB=1)
        lead = self.w.op("Shape", x, name="/lm_head/Shape", start=0, end=2)
        shape = self.w.op("Concat", lead, self.w.const([self.config.vocab_size]), name="/lm_head/Concat", axis=0)
        return self.w.node("Reshape", [y, shape], name="/lm_head/Reshape_out", outputs=["logits"])[0]

    # --- graph I/O ----------------------------------------------------------------------

    def declare_kv_io(self) -> list[tuple[str, str, str, str]]:
        """past_key_values.%d.key/value inputs and present.%d.key/value outputs, per layer."""
        c = self.config
        io = []
        for i in range(c.num_hidden_layers):
            names = (f"past_key_values.{i}.key", f"past_key_values.{i}.value", f"present.{i}.key", f"present.{i}.value")
            for name in names[:2]:
                self.w.add_input(
                    name, self.opt.io_type, ["batch_size", c.num_key_value_heads, "past_sequence_length", c.head_dim]
                )
            for name in names[2:]:
                self.w.add_output(
                    name, self.opt.io_type, ["batch_size", c.num_key_value_heads, "total_sequence_length", c.head_dim]
                )
            io.append(names)
        return io

    def declare_logits(self) -> None:
        self.w.add_output("logits", self.opt.io_type, ["batch_size", "sequence_length", self.config.vocab_size])
