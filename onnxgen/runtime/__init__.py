"""Runtime: load an ONNX graph, bind kernels to a device, run it (eager, later captured)."""

from onnxgen.runtime.session import InferenceSession, NodeArg

__all__ = ["InferenceSession", "NodeArg"]
