"""Runtime: load an ONNX graph, bind kernels to a device, run it (eager, later captured)."""

from onnxgen.runtime.device_kernels import argmax_advance, device_kernels_available
from onnxgen.runtime.session import InferenceSession, NodeArg

__all__ = ["InferenceSession", "NodeArg", "argmax_advance", "device_kernels_available"]
