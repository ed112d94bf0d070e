"""Which kernel serves each form of a block-quantized weight, decided from the node and its
initializers alone, so that ``onnxgen show`` can name the path before anything runs and the ops
(contrib_quant) decide with the very same rules.

A form that no fast kernel takes still runs: through the reference kernel, which for MatMulNBits
dequantizes the weight once and keeps that copy (contrib_quant.DEQUANT_CACHE) and for
GatherBlockQuantized dequantizes only the gathered rows.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx

from onnxgen import options

INT4PACK_GROUPS = (32, 64, 128, 256)  # the group sizes torch's CPU int4 GEMM accepts
_INT4PACK_PATH = (
    "torch int4 GEMM (bf16 activations); a prompt chunk's many rows: the packed weight dequantized for "
    "the call, fp32 GEMM (ops/int4pack_rows.py); packed codes only"
)
_INT4PACK_PLANES_PATH = (
    "torch int4 GEMM over the codes' high and low nibbles as two 4-bit planes (bf16 activations); a prompt "
    "chunk's many rows: both planes dequantized for the call, fp32 GEMM (ops/int4pack_rows.py); packed codes only"
)


def q4_form_unserved(
    *, bits: int, block_size: int, has_g_idx: bool, codes_uint8: bool, scales_float: bool, zero: str
) -> str | None:
    """Why gpu/linear_q4.py's packed 4- and 8-bit kernels cannot take this MatMulNBits form (None:
    they can). ``zero``: "none", "packed" (uint8 codes) or "float" (the scales' dtype) or "other"."""
    if bits not in (4, 8):
        return f"bits={bits} (the packed kernels are 4- and 8-bit)"
    if block_size < 16 or block_size & (block_size - 1):
        return f"block_size={block_size} is not a power of two >= 16"
    if has_g_idx:
        return "g_idx (blocks out of order)"
    if not codes_uint8:
        return "B is not uint8 codes"
    if not scales_float:
        return "scales are not floating point"
    if zero == "other":
        return "zero points are neither uint8 codes nor of the scales' dtype"
    return None


def int4pack_form_unserved(
    *, accuracy_level: int, bits: int, has_g_idx: bool, block_size: int, k: int, n: int
) -> str | None:
    """Why torch's CPU int4 GEMM (bf16 activations) cannot take this MatMulNBits form (None: it can)."""
    if accuracy_level < 3:
        return f"accuracy_level={accuracy_level} asks for fp32 compute (the int4 GEMM is bf16: levels >= 3)"
    if bits not in (4, 8):
        return f"bits={bits} (the CPU int4 GEMM takes 4-bit codes, and 8-bit ones as two 4-bit planes)"
    if has_g_idx:
        return "g_idx (blocks out of order)"
    if block_size not in INT4PACK_GROUPS:
        return f"block_size={block_size} (the CPU int4 GEMM takes {', '.join(map(str, INT4PACK_GROUPS))})"
    if k % block_size:
        return f"K={k} is not a whole number of blocks"
    if n % 16:
        return f"N={n} is not a multiple of 16"
    return None


@dataclass(frozen=True)
class _Form:
    op: str
    text: str  # the form, as show prints it
    path: str  # the kernel that serves it on the device asked about, or the fallback and why


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _input(node: onnx.NodeProto, index: int) -> str:
    return node.input[index] if len(node.input) > index else ""


def zero_kind(present: bool, uint8: bool, scales_dtype: bool) -> str:
    """The zero points' form as q4_form_unserved names it: "none", "packed" (uint8 codes), "float"
    (of the scales' dtype) or "other"."""
    if not present:
        return "none"
    if uint8:
        return "packed"
    return "float" if scales_dtype else "other"


def int4pack_enabled(opts: options.Options) -> bool:
    """The options let torch's CPU int4 GEMM serve (it is not turned off, and no int8 emulation of
    the activations is asked for, which only the exact path does)."""
    return opts.cpu_int4_gemm and opts.int8_activations == "none"


def _zero_kind(name: str, inits: dict[str, onnx.TensorProto], scales_type: int | None) -> str:
    t = inits.get(name) if name else None
    if name and t is None:
        return "other"  # computed at run time
    return zero_kind(bool(name), t is not None and t.data_type == onnx.TensorProto.UINT8,
                     t is not None and t.data_type == scales_type)  # fmt: skip


_FLOATS = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


def _matmul_nbits_form(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto], device: str) -> _Form:
    a = _attrs(node)
    bits, block, level = int(a.get("bits", 4)), int(a.get("block_size", 0)), int(a.get("accuracy_level", 0))
    k, n = int(a.get("K", 0)), int(a.get("N", 0))
    b, scales = inits.get(_input(node, 1)), inits.get(_input(node, 2))
    scales_type = scales.data_type if scales is not None else None
    zero = _zero_kind(_input(node, 3), inits, scales_type)
    has_g_idx = bool(_input(node, 4))
    text = f"bits={bits} block_size={block} zero_points={zero} accuracy_level={level}" + (" g_idx" if has_g_idx else "")
    copy = "fp16/bf16" if device == "cuda" else "fp32"
    if device == "cuda":
        if not options.current().triton_q4:
            return _Form("MatMulNBits", text, f"dequantized {copy} copy (ONNXGEN_TRITON_Q4=0)")
        why = q4_form_unserved(
            bits=bits, block_size=block, has_g_idx=has_g_idx,
            codes_uint8=b is not None and b.data_type == onnx.TensorProto.UINT8,
            scales_float=scales_type in _FLOATS, zero=zero,
        )  # fmt: skip
        if why is None:
            return _Form("MatMulNBits", text, f"packed {bits}-bit kernels (gpu/linear_q4.py), no dequantized copy")
    else:
        why = int4pack_form_unserved(accuracy_level=level, bits=bits, has_g_idx=has_g_idx, block_size=block, k=k, n=n)
        if why is None and not int4pack_enabled(options.current()):
            why = "ONNXGEN_CPU_INT4_GEMM=0 or ONNXGEN_INT8_ACTIVATIONS set"
        if why is None:
            return _Form("MatMulNBits", text, _INT4PACK_PATH if bits == 4 else _INT4PACK_PLANES_PATH)
    return _Form("MatMulNBits", text, f"reference: dequantized {copy} copy kept ({why})")


def _gather_form(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto], device: str) -> _Form:
    a = _attrs(node)
    bits, block = int(a.get("bits", 4)), int(a.get("block_size", 128))
    gather_axis, quant_axis = int(a.get("gather_axis", 0)), int(a.get("quantize_axis", 1))
    data = inits.get(_input(node, 0))
    zero = _zero_kind(_input(node, 3), inits, None)
    text = f"bits={bits} block_size={block} zero_points={zero}"
    two_d = data is not None and len(data.dims) == 2
    served = bits == 4 and two_d and gather_axis == 0 and quant_axis in (1, -1) and zero in ("none", "packed")
    if device == "cuda" and served:
        return _Form("GatherBlockQuantized", text, "one-kernel 4-bit row gather (gpu/prelude.py)")
    return _Form("GatherBlockQuantized", text, "reference: dequantizes the gathered rows only")


def _reshaped_initializers(model: onnx.ModelProto, inits: dict[str, onnx.TensorProto]) -> dict[str, onnx.TensorProto]:
    """Reshape outputs of an initializer by a constant shape (a tied 4-bit table that the embedding's
    GatherBlockQuantized reads as rows of the LM head's codes), as header-only TensorProtos: the
    source's type, the new dims."""
    out: dict[str, onnx.TensorProto] = {}
    for node in model.graph.node:
        if node.op_type != "Reshape" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        source, shape = inits.get(node.input[0]), inits.get(node.input[1])
        if source is None or shape is None:
            continue
        dims = [int(d) for d in onnx.numpy_helper.to_array(shape).reshape(-1)]
        if dims.count(-1) == 1:
            known = int(np.prod([d for d in dims if d != -1])) or 1
            dims[dims.index(-1)] = int(np.prod(source.dims)) // known
        header = onnx.TensorProto(name=node.output[0], data_type=source.data_type, dims=dims)
        out[node.output[0]] = header
    return out


def quantized_weight_paths(model: onnx.ModelProto, device: str) -> list[dict[str, object]]:
    """One entry per form of MatMulNBits / GatherBlockQuantized in the graph: op, form, node count,
    and the kernel that serves it on ``device`` (or the fallback, with its reason), under the
    options in force."""
    inits = {t.name: t for t in model.graph.initializer}
    inits.update(_reshaped_initializers(model, inits))
    forms: Counter[_Form] = Counter()
    for node in model.graph.node:
        if node.domain != "com.microsoft":
            continue
        if node.op_type == "MatMulNBits":
            forms[_matmul_nbits_form(node, inits, device)] += 1
        elif node.op_type == "GatherBlockQuantized":
            forms[_gather_form(node, inits, device)] += 1
    return [{"op": f.op, "form": f.text, "nodes": count, "path": f.path} for f, count in forms.most_common()]
