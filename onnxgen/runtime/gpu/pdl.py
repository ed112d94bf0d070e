"""The one ordering point of programmatic dependent launch, shared by every Triton kernel of the
decode step (launch arguments: launch.pdl_launch).

Before ``wait_for_previous`` a kernel may read only constant data (weights): the kernel before it
may still be running. After it, every earlier kernel is done and its writes are visible, and the
next kernel may be launched; its own pre-wait part then overlaps this kernel's work. Every program
of a kernel calls it before it reads an activation or writes anything, which keeps the chain
transitive, so a captured step computes exactly what a serial one does.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
