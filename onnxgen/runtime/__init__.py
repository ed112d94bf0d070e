"""Runtime: load an ONNX graph, bind kernels to a device, run it (eager, later captured)."""

from onnxgen.runtime.device_kernels import (
    NOISY_ARGMAX_TOP_K_MAX,
    argmax_advance,
    device_kernels_available,
    noisy_argmax,
)
from onnxgen.runtime.session import InferenceSession, NodeArg

__all__ = [
    "NOISY_ARGMAX_TOP_K_MAX",
    "InferenceSession",
    "NodeArg",
    "argmax_advance",
    "device_kernels_available",
    "noisy_argmax",
]
