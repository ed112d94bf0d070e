"""onnxgen: run ONNX generative models on NVIDIA GPUs and CPUs."""

__version__ = "0.1.0"
