"""Whether onnxgen's Triton kernels may run on a tensor's device.

Triton is used on CUDA only, where it is installed with torch. Tests run the same kernels on the
CPU through Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported), so a CPU
tensor qualifies when the interpreter is on. ``ONNXGEN_TRITON=0`` (option ``triton``) turns the
kernels off (the torch kernels run instead), which the benches use to measure what the kernels bring.
The switches are onnxgen.options fields, read per call (a few attribute reads: the decode step
calls these when it records, not when it replays); what the device and triton can do is cached.

Also here: which one-row GEMV path runs (linear_row_serves: Triton where programmatic dependent
launch is, else cuBLAS; the 4-bit kernel opt-in), the launch arguments of PDL (pdl_launch) and the
compile options every launch names (COMPILE_OPTIONS).
"""

from __future__ import annotations

import functools
import warnings
from collections import Counter

import torch

from onnxgen import options

# how often each fused kernel ran in this process (tests check that the fused path was taken)
LAUNCHES: Counter[str] = Counter()
_BUFFERS: dict[tuple[str, int, torch.device], list[torch.Tensor]] = {}

# compile options every onnxgen kernel launch passes (pdl_launch includes them). enable_fp_fusion: a
# multiply and an add compile to one fused multiply-add, as every kernel's rounding and instruction
# counts were measured with; Triton 3.9 warns that its default turns this off in 3.10, so a launch
# names it instead of inheriting whichever default the installed Triton has. The same binary as
# Triton 3.6-3.9's default, so captured steps and the recorded numbers stand.
COMPILE_OPTIONS: dict[str, bool] = {"enable_fp_fusion": True}

# the activation dtypes the Triton kernels take (fp32 math inside; fp64 stays on the torch path)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def cached_buffers(
    kernel: str, size: int, device: torch.device, specs: list[tuple[int, torch.dtype]]
) -> list[torch.Tensor]:
    """Zeroed device buffers of ``specs`` ((numel, dtype); numel 0: a 0-d tensor), made once per
    (``kernel``, ``size``, device): a kernel's partials and tickets, which it leaves at zero (the
    tickets) or writes before reading (the rest), so a captured graph keeps their addresses."""
    key = (kernel, size, device)
    found = _BUFFERS.get(key)
    if found is None:
        found = _BUFFERS[key] = [torch.zeros(n if n else (), dtype=dtype, device=device) for n, dtype in specs]
    return found


def triton_importable() -> bool:
    """Triton kernels are on (option ``triton``) and triton imports."""
    return options.current().triton and _imports()


@functools.cache
def _imports() -> bool:
    try:
        import triton  # noqa: F401
    except Exception as exc:
        _MISSING.append(f"{type(exc).__name__}: {exc}")
        return False
    return True


_MISSING: list[str] = []
_WARNED: list[bool] = []


def _warn_fallback() -> None:
    """Said once per process: without Triton the CUDA decode step runs torch's unfused kernels."""
    if _MISSING and not _WARNED:
        _WARNED.append(True)
        warnings.warn(
            f"triton cannot be imported ({_MISSING[0]}): onnxgen's fused CUDA kernels (one-row GEMVs, "
            "RMSNorm, GroupQueryAttention decode, SiLU-mul) are off and torch/cuBLAS run instead (slower decode)",
            RuntimeWarning,
            stacklevel=3,
        )


@functools.cache
def interpreting() -> bool:
    """Triton's interpreter is on (a process-lifetime option, which override refuses to change:
    triton itself decides when a kernel is defined; so it is cached here)."""
    return options.current().triton_interpret


def triton_serves(t: torch.Tensor) -> bool:
    """Triton kernels apply to tensors on this device."""
    if t.device.type == "cuda":
        if triton_importable():
            return True
        _warn_fallback()
        return False
    return interpreting() and t.device.type == "cpu" and triton_importable()


def linear_row_mode() -> str:
    """Whether the one-row GEMV kernels of gpu/linear_row.py run: ``ONNXGEN_TRITON_LINEAR=1`` always,
    ``=0`` never, unset ("auto") where programmatic dependent launch is (Hopper and later). There,
    chained with PDL, they beat cuBLAS on the whole step (docs/benchmarks/2026-12-01-h200-pdl.md);
    without PDL they lost on the 1.5B shape."""
    return options.current().triton_linear


def q4_kernels_serve(a: torch.Tensor) -> bool:
    """MatMulNBits over ``a`` may run gpu/linear_q4.py's kernels on the packed 4- or 8-bit codes (option
    ``triton_q4``, on by default; ``ONNXGEN_TRITON_Q4=0`` keeps a dequantized fp16 copy instead). An
    int4 package then holds its weights as int4 only; on the H200 the copy still decodes faster
    (docs/benchmarks/2026-12-02-h200-int4-packed.md), which is the opt-out's trade."""
    return options.current().triton_q4 and a.dtype in KERNEL_DTYPES and triton_serves(a)


def pdl_unavailable(capability: tuple[int, int], launcher_options: set[str] | None) -> str | None:
    """Why programmatic dependent launch cannot be used (None: it can), for a device of this
    compute capability and a triton whose CUDA launcher takes these options (None: no CUDA backend)."""
    if capability < (9, 0):
        return f"the device is sm_{capability[0]}{capability[1]}; griddepcontrol needs sm_90 or later"
    if launcher_options is None:
        return "triton has no CUDA backend"
    if "launch_pdl" not in launcher_options:
        return "this triton's launcher has no launch_pdl option (triton 3.4 or later has it)"
    return None


def _pdl_on_device(index: int) -> bool:
    """PDL is on (option ``pdl``) and cuda:``index`` with this triton can do it."""
    return options.current().pdl and _pdl_supported(index)


@functools.cache
def _pdl_supported(index: int) -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        launcher: set[str] | None = set(getattr(CUDAOptions, "__dataclass_fields__", {}))
    except Exception:
        launcher = None
    capability = torch.cuda.get_device_capability(index)
    reason = pdl_unavailable(capability, launcher)
    if reason is not None and capability >= (9, 0):
        # said once per device: this GPU could chain the step's kernels, and does not (slower decode)
        warnings.warn(
            f"programmatic dependent launch is off on cuda:{index} ({reason}): the decode step's "
            "one-row GEMVs run on cuBLAS, its Triton kernels without PDL (slower decode)",
            RuntimeWarning,
            stacklevel=4,  # past _pdl_on_device, to the caller that asked (as before the options split)
        )
    return reason is None


# the storages the most recent PDL launch writes. A kernel launched next may start before that one
# ends, and reads its outputs only after its wait; anything else was written two or more kernels
# back (or by a kernel without PDL, which ends before the next starts) and may be read before it
_LAST_PDL_WRITES: list[int] = []


def pdl_launch(t: torch.Tensor, *writes: torch.Tensor | None) -> dict[str, bool]:
    """Launch arguments for a kernel with a ``PDL`` constexpr: programmatic dependent launch on
    Hopper and later (``ONNXGEN_PDL=0`` turns it off). The kernel may then start while the kernel
    before it finishes; it reads only constant weights until ``gdc_wait()``, which returns once
    every earlier kernel is done, and so a captured step computes exactly what a serial one does.
    ``writes``: every tensor the kernel writes (see settled_before_launch). COMPILE_OPTIONS come with
    them."""
    if pdl_applies(t):
        _LAST_PDL_WRITES[:] = [w.untyped_storage().data_ptr() for w in writes if w is not None]
        return {**COMPILE_OPTIONS, "PDL": True, "launch_pdl": True}
    _LAST_PDL_WRITES.clear()
    return {**COMPILE_OPTIONS, "PDL": False}


def pdl_applies(t: torch.Tensor) -> bool:
    """A kernel over ``t`` is launched with programmatic dependent launch."""
    return t.device.type == "cuda" and _pdl_on_device(t.device.index or 0)


def settled_before_launch(*tensors: torch.Tensor | None) -> bool:
    """None of ``tensors`` is written by the most recent PDL launch: a PDL kernel launched now may read
    them before its wait. That kernel was launched after its own wait returned, so every kernel
    before it is done; only its own outputs may still be in flight. Call before pdl_launch."""
    written = set(_LAST_PDL_WRITES)
    return not any(t is not None and t.untyped_storage().data_ptr() in written for t in tensors)


def linear_row_serves(a: torch.Tensor) -> bool:
    """A one-row linear layer over ``a`` may run as gpu/linear_row.py's kernel."""
    if a.dtype not in KERNEL_DTYPES:
        return False
    mode = options.current().triton_linear  # linear_row_mode(), one call less per op
    if mode == "auto":
        return a.device.type == "cuda" and _pdl_on_device(a.device.index or 0) and triton_serves(a)
    return mode == "on" and triton_serves(a)
