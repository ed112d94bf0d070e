"""The one-row 4-bit kernels compiled for sm_90 here, without a GPU: what each program runs after its
PDL wait (the part of a decode-step kernel that cannot overlap the kernel before it).

    python -m bench.sass_census                                 # the 0.5B step's short-row layers
    python -m bench.sass_census --layer qkv:1152x896:pair:16:2:skip_rms --layer ...

Per configuration: SASS instructions in all and after the wait (griddepcontrol.wait, ACQBULK in
SASS), and after it the barriers (BAR), warp shuffles (SHFL), shared-memory stores and loads, global
loads, and how many of those barriers come before the last global load: a barrier makes every warp
of the program wait for the slowest, and a global load after the wait is a round trip to L2 that the
kernel's result waits for, so a load behind a barrier is a round trip in series with what came
before. A static census, not a timing: counts say where a program's dependent chain is, the GPU says
what it costs (bench/step_sweep.py, bench/gemv_micro.py). Counts depend on the Triton version (the
lent GPU machine has 3.6; docs/benchmarks cite which).

The kernels are compiled as the runtime launches them: 16-byte-aligned pointers, and the integer
arguments that are multiples of 16 at these shapes (n, k, the row's bytes or words) marked so, which
is what Triton's launcher specializes on."""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from typing import Any, NamedTuple

PROLOGUES = {"none": 0, "rms": 1, "skip_rms": 2, "silu_mul": 3}


def compiled_for_sm90(fn: Any, signature: dict[str, str], constexprs: dict[str, object], num_warps: int = 4,
                      aligned: tuple[str, ...] = (), pointers_aligned: bool = True) -> Any:  # fmt: skip
    """``fn`` compiled for sm_90 (no device needed). Constexpr parameters not given take their defaults
    (PDL off unless given); ``aligned`` names integer arguments to mark as multiples of 16, and with
    ``pointers_aligned`` every pointer is marked 16-byte aligned, as the runtime's launches are (the
    compile tests mark nothing)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from onnxgen.runtime.gpu.launch import COMPILE_OPTIONS

    constexprs = {"PDL": False, **constexprs} if "PDL" in fn.arg_names else constexprs
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
    constexprs = {**{n: v for n, v in defaults.items() if n not in signature}, **constexprs}
    sig = {name: ("constexpr" if name in constexprs else signature[name]) for name in fn.arg_names}
    marked = [
        n
        for n in signature
        if n not in constexprs and ((pointers_aligned and signature[n].startswith("*")) or n in aligned)
    ]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in marked}
    source = ASTSource(fn, sig, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, **COMPILE_OPTIONS})


def sass_instructions(kernel: Any) -> list[str]:
    """The SASS of a compiled kernel, an instruction a line (nvdisasm, which Triton ships beside ptxas)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        text = subprocess.run([tool, "-c", path], capture_output=True, text=True, check=True).stdout
    return [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", text)]


def opcode(instruction: str) -> str:
    """The base opcode of one SASS line: no predicate, no modifiers (``@P0 LDG.E.128`` -> ``LDG``)."""
    words = instruction.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


class Census(NamedTuple):
    total: int
    after_wait: int
    counts: collections.Counter  # opcode -> count after the wait
    barriers_before_loads: int  # barriers after the wait and before its last global load


def census(kernel: Any) -> Census:
    ops = [opcode(i) for i in sass_instructions(kernel)]
    wait = ops.index("ACQBULK")
    after = ops[wait:]
    last_load = max((i for i, op in enumerate(after) if op == "LDG"), default=0)
    return Census(len(ops), len(after), collections.Counter(after), after[:last_load].count("BAR"))


class Layer(NamedTuple):
    name: str
    n: int
    k: int
    kernel: str  # byte (gpu/linear_q4.py), words (linear_q4_words.py), pair (linear_q4_half.py)
    block_n: int
    warps: int
    prologue: str


# the Qwen2.5-0.5B step's short-row layers at their default configurations (q4_config on fp16 with
# integer zero points), and one-warp forms of the same products
DEFAULT_LAYERS = [
    Layer("qkv", 1152, 896, "byte", 16, 4, "skip_rms"),
    Layer("o_proj", 896, 896, "byte", 8, 4, "none"),
    Layer("gate_up", 9728, 896, "pair", 16, 2, "skip_rms"),
    Layer("qkv pair 4 x 1 warp", 1152, 896, "pair", 4, 1, "skip_rms"),
    Layer("o_proj pair 4 x 1 warp", 896, 896, "pair", 4, 1, "none"),
    Layer("qkv byte 4 x 1 warp", 1152, 896, "byte", 4, 1, "skip_rms"),
]


def parse_layer(text: str) -> Layer:
    """NAME:NxK:KERNEL:BLOCK_N:WARPS:PROLOGUE, e.g. qkv:1152x896:pair:16:2:skip_rms."""
    try:
        name, shape, kernel, block_n, warps, prologue = text.split(":")
        n, k = (int(v) for v in shape.split("x"))
        layer = Layer(name, n, k, kernel, int(block_n), int(warps), prologue)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME:NxK:KERNEL:BLOCK_N:WARPS:PROLOGUE, got {text!r}") from None
    if kernel not in ("byte", "words", "pair") or prologue not in PROLOGUES:
        raise argparse.ArgumentTypeError(f"KERNEL is byte, words or pair and PROLOGUE one of {sorted(PROLOGUES)}")
    return layer


def compile_layer(layer: Layer, block_size: int = 32) -> Any:
    """The one-tile kernel of ``layer`` (its row in power-of-two parts, integer zero points packed two
    a byte, fp16 activations), under PDL."""
    from onnxgen.runtime.gpu import linear_q4, linear_q4_half, linear_q4_words
    from onnxgen.runtime.gpu.linear_q4 import power_parts

    n_blocks = -(-layer.k // block_size)
    b0, b1, b2 = power_parts(n_blocks)
    sig = dict.fromkeys(["x_ptr", "x2_ptr", "gamma_ptr", "sum_ptr", "bias_ptr", "out_ptr", "scale_ptr"], "*fp16")
    sig.update(zero_ptr="*u8", eps="fp32", **dict.fromkeys(["n", "k", "n_blocks", "zp_row_bytes"], "i32"))
    code = PROLOGUES[layer.prologue]
    const = dict(PROLOGUE=code, ZERO_KIND=1, HAS_BIAS=code == 0, QBLOCK=block_size, BLOCK_N=layer.block_n, PDL=True,
                 B0=b0, B1=b1, B2=b2)  # fmt: skip
    if layer.kernel == "byte":
        fn, row = linear_q4._q4_tile_kernel, "row_bytes"
        sig.update(b_ptr="*u8", row_bytes="i32")
        const.update(BITS=4)
    else:
        fn = linear_q4_half._q4h_tile_kernel if layer.kernel == "pair" else linear_q4_words._q4w_tile_kernel
        row = "row_words"
        sig.update(w_ptr="*i32", row_words="i32")
        if layer.kernel == "words":
            sig.update(magic_bits="i32")
    row_units = n_blocks * block_size // (2 if row == "row_bytes" else 8)
    aligned = tuple(name for name, value in (("n", layer.n), ("k", layer.k), (row, row_units)) if value % 16 == 0)
    return compiled_for_sm90(fn, sig, const, num_warps=layer.warps, aligned=aligned)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layer", action="append", type=parse_layer, help="NAME:NxK:KERNEL:BLOCK_N:WARPS:PROLOGUE")
    args = parser.parse_args()
    import triton

    print(f"Triton {triton.__version__}, sm_90; after the PDL wait, per thread:")
    print(f"{'layer':<26} {'kernel':<6} {'rows/warps':>10} {'all':>6} {'after':>6} {'BAR':>4} {'SHFL':>5} "
          f"{'STS':>4} {'LDS':>4} {'LDG':>4} {'BAR<LDG':>8}")  # fmt: skip
    for layer in args.layer or DEFAULT_LAYERS:
        c = census(compile_layer(layer))
        shared_stores = c.counts["STS"] + c.counts["STSM"]
        shared_loads = c.counts["LDS"] + c.counts["LDSM"]
        print(f"{layer.name:<26} {layer.kernel:<6} {f'{layer.block_n}/{layer.warps}':>10} {c.total:>6} "
              f"{c.after_wait:>6} {c.counts['BAR']:>4} {c.counts['SHFL']:>5} {shared_stores:>4} {shared_loads:>4} "
              f"{c.counts['LDG']:>4} {c.barriers_before_loads:>8}")  # fmt: skip


if __name__ == "__main__":
    main()
